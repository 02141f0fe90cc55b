#!/usr/bin/env bash
# The GPU check: one script for a machine with one CUDA GPU, run on its image as it is.
#
#   OUT=/some/dir bash tools/gpu_check.sh
#
# Nothing is installed or fetched: the packages run from source (PYTHONPATH lists every
# packages/*/src and the umbrella's src/), and the `nnscaler` sub-commands, which are entry points
# of the installed distributions, come from minimal `<name>-<version>.dist-info` directories
# generated from the pyproject files into a throw-away directory on PYTHONPATH. Steps, each under
# `timeout`, the whole run under 8 minutes (TOTAL_S):
#
#   env        device name, torch and CUDA versions
#   imports    every nnscaler package imports from this checkout's sources
#   cli        `python -m nnscaler.cli --help` lists train / compile / ckpt / plan; `nnscaler info`
#   gpu_tests  `pytest -m gpu` on tests/gpu and every test file with a gpu-marked test (240 s)
#   bench      `python bench/gpu.py --out $OUT/bench_gpu.json` (the full config; CUDA only; 210 s
#              or what is left of TOTAL_S)
#
# Without CUDA the CUDA parts are skipped and said so ("no CUDA device: skipped ..."): the gpu tests
# are collected and skip themselves, and the benchmark runs its tiny --smoke config on the CPU
# instead of the full one (about 20 s; GPU_CHECK_CPU_SMOKE=0 skips it). Writes $OUT/gpu_check.log (everything the steps print) and
# $OUT/gpu_check.json (device, versions, each step's status and reason, pytest counts, the bench
# result's path, total seconds); without OUT, under ./gpu_check_out. Exit status 0 when every step
# that ran passed (skips are fine), 1 otherwise.
#
# GPU_CHECK_PYTHON names the interpreter (a command, split on spaces; default python3, e.g.
# "python3 -S" to ignore site-packages' .pth files); a PYTHONPATH already set is kept after the
# source directories. NCCL needs one GPU per rank: multi-rank NCCL is not run here (the two-process
# tests use gloo over CUDA tensors on the one GPU).
set -u
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT" || exit 1
START=$SECONDS
TOTAL_S=${GPU_CHECK_TOTAL_S:-460}   # hard budget for all steps (8 minutes at most, as the lent machine allows)
read -r -a PY <<< "${GPU_CHECK_PYTHON:-python3}"

OUT="${OUT:-$ROOT/gpu_check_out}"
mkdir -p "$OUT" || exit 1
OUT="$(cd "$OUT" && pwd)"
LOG="$OUT/gpu_check.log"
JSON="$OUT/gpu_check.json"
STEPS_FILE="$OUT/.gpu_check_steps.tsv"
: > "$LOG"
: > "$STEPS_FILE"
WORK="$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT

say() { echo "gpu_check: $*" | tee -a "$LOG"; }
say "output in $OUT (log gpu_check.log, summary gpu_check.json)"

# -- the packages from source, and their entry points ------------------------------------------
SRC_PATHS="$ROOT/src"
for d in "$ROOT"/packages/*/src; do SRC_PATHS="$SRC_PATHS:$d"; done
DIST="$WORK/dist"
mkdir -p "$DIST"
export PYTHONPATH="$DIST:$SRC_PATHS${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONDONTWRITEBYTECODE=1
export NNSCALER_CACHE_DIR="$WORK/cache" XDG_CACHE_HOME="$WORK/xdg-cache" HF_HOME="$WORK/hf" \
       TORCHINDUCTOR_CACHE_DIR="$WORK/inductor" TRITON_CACHE_DIR="$WORK/triton" MPLCONFIGDIR="$WORK/mpl"

# step NAME SECONDS COMMAND...: run under timeout (bounded by what is left of TOTAL_S), log its output
step() {
  local name="$1" limit="$2"; shift 2
  local left=$((TOTAL_S - (SECONDS - START)))
  if [ "$left" -lt 10 ]; then
    say "step $name: skipped: time budget of ${TOTAL_S} s spent"
    printf '%s\tskipped\t0\ttime budget spent\n' "$name" >> "$STEPS_FILE"
    return 0
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  local shown="$*"
  [ "${shown%%$'\n'*}" != "$shown" ] && shown="${shown%%$'\n'*}..."
  say "step $name: $shown (timeout ${limit} s)"
  local t0=$SECONDS rc=0 from
  from=$(wc -l < "$LOG")
  timeout --kill-after=10 "$limit" "$@" >> "$LOG" 2>&1 || rc=$?
  local took=$((SECONDS - t0)) status=passed reason="" shown_lines=0
  if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then status=failed; reason="timed out after ${limit} s"
  elif [ "$rc" != 0 ]; then status=failed; reason="exit status $rc"; fi
  # the end of what the step printed, on stdout too (a caller that sees only stdout sees why)
  if [ "$status" = failed ]; then shown_lines=80; elif [ "$name" = gpu_tests ] || [ "$name" = bench ]; then shown_lines=20; fi
  if [ "$shown_lines" -gt 0 ]; then tail -n +"$((from + 1))" "$LOG" | tail -n "$shown_lines" | sed 's/^/  | /'; fi
  say "step $name: $status${reason:+ ($reason)} after ${took} s"
  printf '%s\t%s\t%s\t%s\n' "$name" "$status" "$took" "$reason" >> "$STEPS_FILE"
}

skip() {  # skip NAME REASON
  say "step $1: skipped: $2"
  printf '%s\tskipped\t0\t%s\n' "$1" "$2" >> "$STEPS_FILE"
}

# The dist-info directories (METADATA + entry_points.txt) of the nine distributions.
"${PY[@]}" - "$ROOT" "$DIST" >> "$LOG" 2>&1 <<'EOF' || say "could not generate the dist-info directories (see the log)"
import pathlib, re, sys
try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib
root, dist = map(pathlib.Path, sys.argv[1:])
for pyproject in [root / "pyproject.toml", *sorted(root.glob("packages/*/pyproject.toml"))]:
    project = tomllib.loads(pyproject.read_text())["project"]
    name, version = project["name"], project["version"]
    info = dist / f"{re.sub(r'[-_.]+', '_', name)}-{version}.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
                                   f"Summary: {project.get('description', '')}\n")
    groups = project.get("entry-points", {})
    text = "".join(f"[{g}]\n" + "".join(f"{k} = {v}\n" for k, v in eps.items()) + "\n" for g, eps in groups.items())
    (info / "entry_points.txt").write_text(text)
    print(f"dist-info: {info.name} ({sum(len(e) for e in groups.values())} entry points)")
EOF

# -- env ---------------------------------------------------------------------------------------
ENV_JSON="$OUT/.gpu_check_env.json"
step env 60 "${PY[@]}" -c '
import json, sys, torch
cuda = torch.cuda.is_available()
info = {"python": sys.version.split()[0], "torch": torch.__version__, "cuda": torch.version.cuda,
        "cuda_available": cuda, "device": torch.cuda.get_device_name(0) if cuda else None,
        "device_count": torch.cuda.device_count() if cuda else 0}
print(json.dumps(info))
json.dump(info, open(sys.argv[1], "w"))
' "$ENV_JSON"
HAS_CUDA=$("${PY[@]}" -c 'import json,sys; print(int(json.load(open(sys.argv[1]))["cuda_available"]))' "$ENV_JSON" 2>/dev/null || echo 0)
if [ "$HAS_CUDA" = 1 ]; then
  say "CUDA device: $("${PY[@]}" -c 'import json,sys; print(json.load(open(sys.argv[1]))["device"])' "$ENV_JSON")"
else
  say "no CUDA device: skipped the CUDA parts (the gpu tests skip themselves, bench/gpu.py runs only --smoke)"
fi

# -- imports from source -------------------------------------------------------------------------
step imports 90 "${PY[@]}" -c '
import importlib, importlib.metadata as md, os, sys
root = sys.argv[1]
mods = ["nnscaler", "nnscaler.ir", "nnscaler.policies", "nnscaler.codegen", "nnscaler.runtime",
        "nnscaler.ckpt", "nnscaler.trainer", "nnscaler.lightning", "nnscaler.cli"]
for name in mods:
    f = importlib.import_module(name).__file__
    assert os.path.realpath(f).startswith(root + os.sep), f"{name} imported from {f}, not from {root}"
    print(f"{name}: {f}")
for dist in ("nnscaler", "nnscaler-trainer", "nnscaler-ckpt", "nnscaler-policies"):
    d = md.distribution(dist)
    where = getattr(d, "_path", "?")
    print(f"{dist} {d.version}: {where}")
from nnscaler import parallelize, ComputeConfig  # the umbrella re-exports
print("ok")
' "$ROOT"

# -- the CLI and its plug-in commands, from source ----------------------------------------------
step cli 90 bash -c '
set -e
help=$("$@" -m nnscaler.cli --help)
echo "$help"
for c in train compile ckpt plan info; do
  echo "$help" | grep -qw "$c" || { echo "nnscaler --help does not list \"$c\""; exit 1; }
done
"$@" -m nnscaler.cli info
"$@" -m nnscaler.cli train --help > /dev/null
' cli "${PY[@]}"

# -- the gpu test tier ---------------------------------------------------------------------------
JUNIT="$OUT/gpu_tests.xml"
# tests/gpu/ whole (its modules mark themselves through gpu_support), and elsewhere every test
# file that names the marker
mapfile -t GPU_FILES < <({ [ -d tests/gpu ] && echo tests/gpu;
                           grep -rlE "mark\.gpu" tests --include='test_*.py' | grep -v '^tests/gpu/'; } | sort)
if [ "${#GPU_FILES[@]}" = 0 ]; then
  skip gpu_tests "no test file with a gpu-marked test"
else
  say "gpu test files: ${GPU_FILES[*]}"
  [ "$HAS_CUDA" = 1 ] || say "no CUDA device: skipped the gpu tests' bodies (collected and skipped)"
  step gpu_tests 240 "${PY[@]}" -m pytest -q -rs -m gpu -p no:cacheprovider --junitxml "$JUNIT" "${GPU_FILES[@]}"
fi

# -- the benchmark -------------------------------------------------------------------------------
BENCH_OUT=""
if [ ! -f bench/gpu.py ]; then
  skip bench "bench/gpu.py is absent"
elif [ "$HAS_CUDA" = 1 ]; then
  BENCH_OUT="$OUT/bench_gpu.json"
  step bench 210 "${PY[@]}" bench/gpu.py --out "$BENCH_OUT"
elif [ "${GPU_CHECK_CPU_SMOKE:-1}" = 1 ]; then
  say "no CUDA device: skipped the full bench/gpu.py; its --smoke config runs on the CPU instead"
  BENCH_OUT="$OUT/bench_gpu_smoke.json"
  step bench 120 "${PY[@]}" bench/gpu.py --smoke --out "$BENCH_OUT"
else
  skip bench "no CUDA device: skipped bench/gpu.py (GPU_CHECK_CPU_SMOKE=0)"
fi

# -- summary -------------------------------------------------------------------------------------
TOTAL=$((SECONDS - START))
"${PY[@]}" - "$ENV_JSON" "$STEPS_FILE" "$JUNIT" "$BENCH_OUT" "$TOTAL" "$JSON" <<'EOF' >> "$LOG" 2>&1
import json, os, sys
import xml.etree.ElementTree as ET
env_file, steps_file, junit, bench, total, out = sys.argv[1:]
env = json.load(open(env_file)) if os.path.exists(env_file) else {}
steps = {}
for line in open(steps_file):
    name, status, took, reason = (line.rstrip("\n").split("\t") + [""] * 4)[:4]
    steps[name] = {"status": status, "seconds": int(took or 0), "reason": reason or None}
counts = None
if os.path.exists(junit):
    counts = dict(passed=0, failed=0, errors=0, skipped=0)
    for suite in ET.parse(junit).getroot().iter("testsuite"):
        tests, fail, err, skip = (int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped"))
        counts["failed"] += fail
        counts["errors"] += err
        counts["skipped"] += skip
        counts["passed"] += tests - fail - err - skip
cuda = bool(env.get("cuda_available"))
summary = {
    "device": env.get("device"), "cuda_available": cuda, "torch": env.get("torch"), "cuda": env.get("cuda"),
    "python": env.get("python"), "steps": steps, "pytest": counts,
    "bench_result": bench if bench and os.path.exists(bench) else None,
    "cuda_parts": "ran" if cuda else "skipped: no CUDA device",
    "not_run": "multi-rank NCCL (NCCL needs one GPU per rank; the two-process tests use gloo over CUDA tensors)",
    "total_seconds": int(total),
    "ok": all(s["status"] != "failed" for s in steps.values()),
}
json.dump(summary, open(out, "w"), indent=2)
print(json.dumps(summary, indent=2))
EOF
if [ ! -s "$JSON" ]; then say "could not write $JSON"; exit 1; fi
rm -f "$STEPS_FILE" "$ENV_JSON"
FAILED=$("${PY[@]}" -c 'import json,sys; print(int(not json.load(open(sys.argv[1]))["ok"]))' "$JSON" 2>/dev/null || echo 1)
say "done in ${TOTAL} s: $( [ "$FAILED" = 0 ] && echo 'every step that ran passed' || echo 'a step failed (see the log)'); summary $JSON"
[ "$FAILED" = 0 ]
