#!/usr/bin/env bash
# SPDX-License-Identifier: MIT OR Apache-2.0
# Every Rust and CUDA source carries the SPDX line the Contributing chapter asks for, on line 1.
set -euo pipefail
cd "$(dirname "$0")/.."
missing=0
while IFS= read -r f; do
  if [ "$(head -n1 "$f")" != "// SPDX-License-Identifier: MIT OR Apache-2.0" ]; then
    echo "missing SPDX header on line 1: $f" >&2
    missing=1
  fi
done < <(git ls-files --cached --others --exclude-standard -- '*.rs' '*.cu' '*.cuh' '*.h' '*.hpp' '*.cpp')
exit $missing
