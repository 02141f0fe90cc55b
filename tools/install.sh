#!/usr/bin/env bash
# Install nnscaler on a machine where nothing was installed by hand.
#
#   bash tools/install.sh           # torch (if missing), numpy, all packages editable
#   bash tools/install.sh --test    # the same plus the test extra (pytest)
#   bash tools/install.sh --unlocked  # resolve from the packages' ranges, ignoring the lock
#
# The lock: constraints.txt (repository root) holds the exact versions CI resolved and passed
# with; every install uses it as a pip constraints file (`-c`), so a fresh machine gets what CI
# got. It constrains, it does not add: a package only lands when a part asks for it. Refresh it
# with `bash tools/lock.sh` (a new venv, installed --unlocked, then `pip freeze`).
#
# Everything goes through ONE pip command: the parts depend on each other by name
# (nnscaler-runtime needs nnscaler-ir, ...), so pip must see all of them at once to resolve
# those names to the local checkouts instead of looking for them on an index.
#
# torch: if `import torch` already works, torch is not named at all, and pip keeps the installed
# version (it satisfies the packages' ranges). If it does not, `torch==2.13.0` is pinned in the
# same command: a bare `torch` would let pip pick the newest build, and lightning would drag
# that one in (gigabytes of CUDA packages) unless torch is pinned next to it.
# NNSCALER_TORCH_SPEC replaces the pin (e.g. NNSCALER_TORCH_SPEC='torch==2.13.0+cu126'); when
# set it is passed even if torch is installed, so pip enforces that spec.
#
# The build backend (hatchling, editables) is installed into the environment too; once it is
# there, later runs pass --no-build-isolation and take seconds instead of a minute spent
# creating nine isolated build environments.
# PYTHON selects the interpreter (default: python, else python3).
set -euo pipefail

usage() { sed -n '2,7p' "$0" | sed 's/^# \{0,1\}//'; }

with_test=0
locked=1
for arg in "$@"; do
  case "$arg" in
    --test) with_test=1 ;;
    --unlocked) locked=0 ;;
    -h|--help) usage; exit 0 ;;
    *) echo "install.sh: unknown argument '$arg'" >&2; usage >&2; exit 2 ;;
  esac
done

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"

if [ -z "${PYTHON:-}" ]; then
  if command -v python >/dev/null 2>&1; then PYTHON=python; else PYTHON=python3; fi
fi

reqs=(numpy hatchling editables)
keep_torch=0  # 1: the lock's torch line does not apply (torch installed already, or a spec given)
if [ -n "${NNSCALER_TORCH_SPEC:-}" ]; then
  reqs+=("$NNSCALER_TORCH_SPEC"); keep_torch=1
elif ! "$PYTHON" -c "import torch" >/dev/null 2>&1; then
  reqs+=("torch==2.13.0")
else
  keep_torch=1
fi

constraints=()
if [ "$locked" = 1 ]; then
  [ -f constraints.txt ] || { echo "install.sh: constraints.txt is missing (run bash tools/lock.sh, or pass --unlocked)" >&2; exit 2; }
  lock="$(mktemp "${TMPDIR:-/tmp}/nnscaler-constraints.XXXXXX")"
  trap 'rm -f "$lock"' EXIT
  if [ "$keep_torch" = 1 ]; then
    # an installed torch (e.g. a CUDA build) or NNSCALER_TORCH_SPEC wins over the lock's CPU torch
    grep -v -i -E '^(torch|nvidia-[a-z0-9-]+|triton)==' constraints.txt > "$lock" || true
  else
    cp constraints.txt "$lock"
  fi
  constraints=(-c "$lock")
fi

editables=()
for pyproject in packages/nnscaler-*/pyproject.toml; do
  editables+=(-e "$(dirname "$pyproject")")
done
if [ "$with_test" = 1 ]; then editables+=(-e ".[test]"); else editables+=(-e .); fi

export PIP_ROOT_USER_ACTION="${PIP_ROOT_USER_ACTION:-ignore}"  # containers install as root
pip_opts=(-q --disable-pip-version-check)
if "$PYTHON" -c "import hatchling, editables" >/dev/null 2>&1; then
  pip_opts+=(--no-build-isolation)
fi

shown_constraints=""
[ "$locked" = 1 ] && shown_constraints="-c constraints.txt "
echo "install.sh: pip install ${pip_opts[*]} ${shown_constraints}${reqs[*]} ${editables[*]}"
"$PYTHON" -m pip install "${pip_opts[@]}" "${constraints[@]}" "${reqs[@]}" "${editables[@]}"

"$PYTHON" - <<'PY'
import importlib.metadata as md
import torch
import nnscaler
parts = {d.metadata["Name"] for d in md.distributions()
         if (d.metadata["Name"] or "").startswith("nnscaler")}
print(f"install.sh: ok: nnscaler {nnscaler.__version__} ({len(parts)} distributions), "
      f"torch {torch.__version__}")
PY
