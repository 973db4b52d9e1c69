#!/usr/bin/env bash
# SPDX-License-Identifier: MIT OR Apache-2.0
# Installs the official OpenAI and Anthropic Python SDKs and httpx, pinned, into .venv/test-clients
# (or $METRALE_TEST_CLIENTS_VENV) for the black-box server suites in tests/server/. Idempotent: when
# the venv already holds the pinned versions nothing is installed. Prints the venv's python path on
# its last line.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
venv="${METRALE_TEST_CLIENTS_VENV:-$root/.venv/test-clients}"
pins=(
  openai==3.57.0
  anthropic==2.14.0
  httpx==0.28.1
)
py="$venv/bin/python"
have_pins() { # every pin installed at exactly its version
  [ -x "$py" ] || return 1
  "$py" - "${pins[@]}" <<'PY' 2>/dev/null
import sys
from importlib import metadata
for pin in sys.argv[1:]:
    name, version = pin.split("==")
    if metadata.version(name) != version:
        sys.exit(1)
PY
}
if ! have_pins; then
  echo "install-test-clients: installing ${pins[*]} into $venv" >&2
  [ -x "$py" ] || python3 -m venv "$venv"
  "$py" -m pip install --disable-pip-version-check -q "${pins[@]}" >&2
  have_pins || { echo "install-test-clients: the pinned versions did not install" >&2; exit 1; }
fi
"$py" -c 'import openai, anthropic, httpx; print("install-test-clients: openai", openai.__version__, "anthropic", anthropic.__version__, "httpx", httpx.__version__)' >&2
echo "$py"
