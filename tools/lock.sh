#!/usr/bin/env bash
# Refresh the lock (constraints.txt): the exact versions a fresh install resolves today.
#
#   bash tools/lock.sh            # then run the tests (bash tools/test.sh) before committing it
#
# Makes a new virtualenv in a temporary directory, installs everything with the test extra from
# the packages' own ranges (`tools/install.sh --test --unlocked`, torch pinned to the README's
# CPU build), and writes `pip freeze` of that venv, without the editable nnscaler parts, to
# constraints.txt. Local version labels are dropped (`torch==2.13.0+cpu` -> `torch==2.13.0`) so
# the same file applies to any build of that release. PYTHON selects the interpreter.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
if [ -z "${PYTHON:-}" ]; then
  if command -v python3.11 >/dev/null 2>&1; then PYTHON=python3.11; else PYTHON=python3; fi
fi

work="$(mktemp -d "${TMPDIR:-/tmp}/nnscaler-lock.XXXXXX")"
trap 'rm -rf "$work"' EXIT
"$PYTHON" -m venv "$work/venv"
PYTHON="$work/venv/bin/python" bash tools/install.sh --test --unlocked
{
  echo "# The lock: exact versions tools/install.sh constrains every install to."
  echo "# Refresh: bash tools/lock.sh (then run bash tools/test.sh before committing)."
  echo "# Resolved with $("$work/venv/bin/python" --version 2>&1) on $(uname -sm)."
  "$work/venv/bin/python" -m pip freeze --exclude-editable --disable-pip-version-check \
    | grep -v -E '^(-e |#)' | sed -E 's/^([A-Za-z0-9_.-]+==[^+ ]+)\+[A-Za-z0-9.]+/\1/' | LC_ALL=C sort -f
} > constraints.txt
echo "lock.sh: wrote constraints.txt ($(grep -c '==' constraints.txt) pins)"
