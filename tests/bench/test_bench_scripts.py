"""Every bench/ script runs: each one (a file with a ``__main__`` block) in its smallest
configuration (``--smoke``) exits 0 and writes a well-formed results file where ``--out`` says,
leaving bench/results/ alone (the scripts with a test of their own, which runs ``--smoke`` and
checks what they report, are not run twice); and no file in bench/ is named like an importable module
(``python bench/x.py`` puts bench/ first on sys.path, where bench/lightning.py once hid the
``lightning`` package). The figures are the benchmarks' business: no timing is checked."""
from __future__ import annotations

import json
import os
import pkgutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BENCH = os.path.join(ROOT, "bench")
RESULTS = os.path.join(BENCH, "results")


def _scripts():
    names = []
    for f in sorted(os.listdir(BENCH)):
        if f.endswith(".py") and not f.startswith("_"):
            with open(os.path.join(BENCH, f)) as fh:
                if 'if __name__ == "__main__":' in fh.read():
                    names.append(f[:-3])
    return names


SCRIPTS = _scripts()
OWN_TEST = {"autodist": "test_autodist_bench.py", "guards": "test_guards_bench.py", "pipeline": "test_pipeline_bench.py",
            "gpu": "test_gpu_bench.py", "moe": "test_moe_bench.py",
            "long_context": "test_long_context_bench.py"}


def test_no_bench_file_shadows_an_importable_module():
    bench = {f[:-3] for f in os.listdir(BENCH) if f.endswith(".py")}
    tests = os.path.join(ROOT, "tests")  # pytest's own path entries: not what a bench script sees

    def seen_by_scripts(finder_path):
        path = os.path.abspath(finder_path)
        return path != BENCH and not (path + os.sep).startswith(tests + os.sep)
    elsewhere = {m.name for m in pkgutil.iter_modules() if seen_by_scripts(getattr(m.module_finder, "path", ""))}
    shadowing = sorted(bench & (elsewhere | set(sys.stdlib_module_names)))
    assert not shadowing, f"bench/{shadowing[0]}.py hides the module {shadowing[0]!r} from every bench script: rename it"


def test_the_scripts_are_found():
    assert {"ckpt", "lightning_strategy", "trainer", "autodist", "pipeline"} <= set(SCRIPTS)
    assert "lightning" not in SCRIPTS
    for script, test in OWN_TEST.items():  # those run by their own test, in the same configuration
        with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), test)) as f:
            text = f.read()
        assert f'"{script}.py"), "--smoke"' in text or f'run_smoke("{script}.py"' in text, (script, test)


def _results_state():
    return {f: os.stat(os.path.join(RESULTS, f)).st_mtime_ns for f in sorted(os.listdir(RESULTS))}


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize("script", [s for s in SCRIPTS if s not in OWN_TEST])
def test_script_runs_in_its_smallest_configuration(script, tmp_path):
    out = tmp_path / "out" / f"{script}.json"
    (tmp_path / "tmp").mkdir()
    env = dict(os.environ, NNSCALER_CACHE_DIR=str(tmp_path / "cache"), XDG_CACHE_HOME=str(tmp_path / "xdg"),
               TMPDIR=str(tmp_path / "tmp"), PYTHONWARNINGS="ignore")
    before = _results_state()
    done = subprocess.run([sys.executable, os.path.join(BENCH, f"{script}.py"), "--smoke", "--out", str(out)],
                          capture_output=True, text=True, timeout=900, cwd=ROOT, env=env)
    assert done.returncode == 0, f"{script}.py --smoke failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
    data = json.loads(out.read_text())
    assert isinstance(data, dict) and {"timestamp", "command", "machine"} <= set(data), sorted(data)
    assert "--smoke" in data["command"] and data["machine"]["cores"] >= 1
    assert len(data) > 3  # figures beyond the header
    assert _results_state() == before  # bench/results/ untouched
