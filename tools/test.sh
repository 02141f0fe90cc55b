#!/usr/bin/env bash
# Run the test suite in its two tiers (the README's test command and .ci/run call this).
#
#   bash tools/test.sh [PYTEST ARGS...]     # extra arguments go to both tiers (e.g. -k name)
#
# 1. fast tier: `pytest -x -m "not multiprocess"`: in-process unit tests that start no process,
#    stopping at the first failure (about 30 s on 2 CPU cores);
# 2. multi-process tier: `pytest -m multiprocess`: everything that starts processes (gloo
#    workers, torchrun, the examples against their golden losses, fresh interpreters), run only
#    when the fast tier passed.
# tests/conftest.py fails a test that starts a process without the `multiprocess` marker, and
# runs its leak check after every test. A tier that selects no test (exit status 5, e.g. with
# -k) counts as passed. PYTHON selects the interpreter (default: python, else python3).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

if [ -z "${PYTHON:-}" ]; then
  if command -v python >/dev/null 2>&1; then PYTHON=python; else PYTHON=python3; fi
fi

tier() {
  local name="$1"; shift
  local start=$SECONDS rc=0
  echo "test.sh: $name tier: $PYTHON -m pytest $*"
  "$PYTHON" -m pytest "$@" || rc=$?
  if [ "$rc" = 5 ]; then rc=0; echo "test.sh: $name tier: no test selected"; fi
  echo "test.sh: $name tier: exit $rc after $((SECONDS - start)) s"
  return "$rc"
}

tier fast -q -x -m "not multiprocess" tests "$@"
tier multiprocess -q -m multiprocess tests "$@"
