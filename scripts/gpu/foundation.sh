#!/usr/bin/env bash
# SPDX-License-Identifier: MIT OR Apache-2.0
# Foundation checks on the GPU machine: `met doctor` (text and JSON) and `met check-kernels`
# (every CUDA kernel against its host reference). Run from the repo root with a release `met`
# at target/release/met; full logs go to $OUT (default ./gpu-out), a summary is printed last.
set -uo pipefail
out="${OUT:-gpu-out}"
mkdir -p "$out"
met="${MET:-target/release/met}"
{
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "met: $("$met" --version)"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null | sed 's/^/gpu: /'
} | tee "$out/env.txt"
"$met" doctor > "$out/doctor.txt" 2>&1; doctor=$?
"$met" doctor --json > "$out/doctor.json" 2>&1; doctor_json=$?
"$met" check-kernels ${SEED:+--seed "$SEED"} > "$out/check-kernels.txt" 2>&1; check=$?
cat "$out/doctor.txt"
cat "$out/check-kernels.txt"
echo
echo "| step | exit |"
echo "|---|---|"
echo "| met doctor | $doctor |"
echo "| met doctor --json | $doctor_json |"
echo "| met check-kernels | $check |"
[ "$doctor" = 0 ] && [ "$doctor_json" = 0 ] && [ "$check" = 0 ]
