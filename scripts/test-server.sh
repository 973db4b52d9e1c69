#!/usr/bin/env bash
# SPDX-License-Identifier: MIT OR Apache-2.0
# Black-box tests of `met serve` with the official OpenAI and Anthropic Python SDKs (tests/server/).
# Needs no GPU: builds met (installing the pinned nvcc wheels, like scripts/test.sh), fetches the
# pinned test data, installs the pinned clients, starts two servers on free ports on the host
# backend (SmolLM2-135M), runs test_clients.py, load_test.py and bad_inputs.py, then checks that
# SIGINT drains an in-flight stream and exits 0 (and SIGTERM on the second server). Prints a summary
# table; exits non-zero when anything failed. Logs and JSON reports go to target/test-server/.
#
#   MET=path/to/met scripts/test-server.sh    # test that binary instead of building one
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
out="$root/target/test-server"
rm -rf "$out"
mkdir -p "$out"

step() { printf '\n== %s\n' "$*"; }
names=() results=() times=() details=()
record() { names+=("$1"); results+=("$2"); times+=("$3"); details+=("${4:-}"); }
current="setup"
pids=()
main_log="$out/server.log"
auth_log="$out/server-auth.log"

summary() {
  printf '\n== summary (logs and reports in %s)\n' "${out#"$root"/}"
  printf '  %-34s %-14s %6s  %s\n' "step" "result" "time" "detail"
  local i
  for i in "${!names[@]}"; do
    printf '  %-34s %-14s %5ss  %s\n' "${names[$i]}" "${results[$i]}" "${times[$i]}" "${details[$i]}"
  done
}

cleanup() {
  local rc=$?
  trap - EXIT INT TERM
  local pid
  for pid in ${pids[@]+"${pids[@]}"}; do
    kill -TERM "$pid" 2>/dev/null || true
  done
  for pid in ${pids[@]+"${pids[@]}"}; do
    local n=0
    while kill -0 "$pid" 2>/dev/null && [ $n -lt 50 ]; do sleep 0.1; n=$((n + 1)); done
    kill -KILL "$pid" 2>/dev/null || true
  done
  if [ $rc -ne 0 ] && [ "$current" != "done" ]; then
    record "$current" "ABORTED" "-" "exit $rc"
  fi
  summary
  if [ $rc -ne 0 ]; then
    for log in "$main_log" "$auth_log"; do
      if [ -s "$log" ]; then
        printf '\n== last lines of %s\n' "${log#"$root"/}"
        tail -n 40 "$log"
      fi
    done
    printf '\n== server tests FAILED\n'
  else
    printf '\n== server tests passed\n'
  fi
  exit $rc
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# --- build, data, clients -------------------------------------------------------------------
t0=$SECONDS
if [ -n "${MET:-}" ]; then
  met=$MET
  record "build met" "skipped" 0 "MET=$MET"
else
  current="nvcc (pinned CUDA 13.0 wheels)"
  step "$current"
  NVCC=$(scripts/install-nvcc.sh)
  export NVCC
  # Every kernel of every target, as scripts/test.sh builds it (so the two share one build).
  unset METRALE_SKIP_BUILD METRALE_TARGET_HW METRALE_TARGET_MODEL METRALE_TARGET_QUANT
  current="build met"
  step "$current"
  cargo build --release -p metrale-server --bin met
  met=target/release/met
  record "build met" "ok" $((SECONDS - t0))
fi

current="test data"
step "$current"
t0=$SECONDS
METRALE_TEST_DATA=$(scripts/fetch-test-data.sh)
export METRALE_TEST_DATA
model="$METRALE_TEST_DATA/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
[ -f "$model" ] || { echo "test-server: $model is missing" >&2; exit 1; }

current="test clients"
step "$current (pinned openai, anthropic, httpx)"
PY=$(scripts/install-test-clients.sh | tail -n1)
record "test data and clients" "ok" $((SECONDS - t0))

# --- servers ----------------------------------------------------------------------------------
current="start servers"
step "$current"
read -r port auth_port < <("$PY" -c '
import socket
socks = [socket.socket() for _ in range(2)]
for s in socks:
    s.bind(("127.0.0.1", 0))
print(*(s.getsockname()[1] for s in socks))
for s in socks:
    s.close()')
url="http://127.0.0.1:$port"
auth_url="http://127.0.0.1:$auth_port"
ctx=2048
auth_token=secret
auth_max_seqs=2

start_server() { # start_server <log> <met serve args...>; the pid goes to $started
  local log=$1
  shift
  # Background jobs of a script start with SIGINT ignored; reset it so the server gets our SIGINT.
  "$PY" -c 'import os, signal, sys
signal.signal(signal.SIGINT, signal.SIG_DFL)
signal.signal(signal.SIGTERM, signal.SIG_DFL)
os.execv(sys.argv[1], sys.argv[1:])' "$met" serve "$@" >"$log" 2>&1 &
  started=$!
  pids+=("$started")
  echo "started pid $started: $met serve $*"
}

listening() { # listening <log> <port>: the log has the line (colour codes stripped)
  local text
  text=$(sed 's/\x1b\[[0-9;]*m//g' "$1" 2>/dev/null || true)
  [[ $text =~ Listening\ on\ 127\.0\.0\.1:$2([^0-9]|$) ]]
}

wait_listening() { # wait_listening <pid> <log> <port>
  local deadline=$((SECONDS + 120))
  while ! listening "$2" "$3"; do
    if ! kill -0 "$1" 2>/dev/null; then
      echo "test-server: the server (pid $1) exited before listening; its log:" >&2
      cat "$2" >&2
      return 1
    fi
    if [ $SECONDS -ge $deadline ]; then
      echo "test-server: no 'Listening on 127.0.0.1:$3' within 120 s; the server log:" >&2
      cat "$2" >&2
      return 1
    fi
    sleep 0.2
  done
}

t0=$SECONDS
start_server "$main_log" --model-from-path "$model" --backend host --bind 127.0.0.1 --port "$port" \
  --model-name smollm2 --max-seq-len "$ctx" --max-num-seqs 64
main_pid=$started
start_server "$auth_log" --model-from-path "$model" --backend host --bind 127.0.0.1 --port "$auth_port" \
  --model-name smollm2 --max-seq-len 256 --max-num-seqs "$auth_max_seqs" --require-auth --auth-token "$auth_token"
auth_pid=$started
wait_listening "$main_pid" "$main_log" "$port"
wait_listening "$auth_pid" "$auth_log" "$auth_port"
record "start servers" "ok" $((SECONDS - t0)) "ports $port, $auth_port (auth)"

# --- suites -----------------------------------------------------------------------------------
failed=0
report_detail() { # report_detail <report.json>: one line from a suite's JSON report
  [ -f "$1" ] || return 0
  "$PY" - "$1" <<'PY' || true
import json, sys
d = json.load(open(sys.argv[1]))
if d["suite"] == "load_test":
    print(f"{d['completed']} completed, {d['cancelled']} cancelled, {d['failed_requests']} failed; "
          f"TTFT p50 {d['ttft_p50_s']:.2f}s p99 {d['ttft_p99_s']:.2f}s; "
          f"TPOT p50 {d['tpot_p50_s'] * 1e3:.0f}ms p99 {d['tpot_p99_s'] * 1e3:.0f}ms")
elif d["suite"] == "drain_test":
    print("; ".join(r["problem"] for r in d["results"]) or "stream finished after the signal")
else:
    print(f"{d['passed']} passed, {d['failed']} failed, {d['skipped']} skipped")
PY
}
run_suite() { # run_suite <name> <command...>
  local name=$1
  shift
  current=$name
  step "$name"
  local t=$SECONDS rc=0
  "$@" --report "$out/$name.json" || rc=$?
  local result=PASS
  if [ $rc -ne 0 ]; then
    result="FAIL (exit $rc)"
    failed=1
  fi
  record "$name" "$result" $((SECONDS - t)) "$(report_detail "$out/$name.json")"
  if ! kill -0 "$main_pid" 2>/dev/null; then
    echo "test-server: the server (pid $main_pid) is gone; the rest cannot run" >&2
    exit 1
  fi
}

run_suite test_clients "$PY" tests/server/test_clients.py --base-url "$url" --met "$met" --model-path "$model" \
  --model-name smollm2
run_suite load_test "$PY" tests/server/load_test.py --base-url "$url" --model-name smollm2
run_suite bad_inputs "$PY" tests/server/bad_inputs.py --base-url "$url" --context-len "$ctx" \
  --auth-base-url "$auth_url" --auth-token "$auth_token" --auth-max-num-seqs "$auth_max_seqs"

# --- shutdown ---------------------------------------------------------------------------------
wait_exit() { # wait_exit <pid> <seconds>: sets $exit_status to the exit status, or "timeout"
  local deadline=$((SECONDS + $2))
  while kill -0 "$1" 2>/dev/null; do
    if [ $SECONDS -ge $deadline ]; then
      exit_status=timeout
      return
    fi
    sleep 0.2
  done
  exit_status=0
  wait "$1" || exit_status=$?
}
forget_pid() { # forget_pid <pid>: reaped, so the exit trap must not signal that number again
  local keep=() p
  for p in "${pids[@]}"; do
    [ "$p" = "$1" ] || keep+=("$p")
  done
  pids=(${keep[@]+"${keep[@]}"})
}
check_exit() { # check_exit <name> <pid> <signal> <started>
  wait_exit "$2" 30
  [ "$exit_status" = timeout ] || forget_pid "$2"
  local result=PASS
  if [ "$exit_status" != 0 ]; then
    result=FAIL
    failed=1
  fi
  record "$1" "$result" $((SECONDS - $4)) "SIG$3 -> exit $exit_status (want 0 within 30 s)"
}

current="SIGINT drains and exits 0"
step "$current"
t=$SECONDS
rc=0
"$PY" tests/server/drain_test.py --base-url "$url" --pid "$main_pid" --signal INT --report "$out/drain_test.json" || rc=$?
if [ $rc -eq 2 ]; then
  kill -INT "$main_pid" 2>/dev/null || true # drain_test could not reach the server and sent nothing
fi
result=PASS
if [ $rc -ne 0 ]; then
  result="FAIL (exit $rc)"
  failed=1
fi
record "drain_test" "$result" $((SECONDS - t)) "$(report_detail "$out/drain_test.json")"
check_exit "main server exit status" "$main_pid" INT "$t"

current="SIGTERM exits 0"
step "$current (the --require-auth server)"
t=$SECONDS
kill -TERM "$auth_pid"
check_exit "auth server exit status" "$auth_pid" TERM "$t"

current="done"
exit $failed
