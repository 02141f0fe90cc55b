"""Helpers shared by the benchmarks in bench/ (not part of nnscaler)."""
from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import shlex
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent
RESULTS_DIR = BENCH_DIR / "results"
EXAMPLES_DIR = REPO_ROOT / "examples"


def add_examples_to_path() -> None:
    """Make `from gpt import GPT, GPTConfig, random_batch` work (examples/gpt.py)."""
    if str(EXAMPLES_DIR) not in sys.path:
        sys.path.insert(0, str(EXAMPLES_DIR))


def cpu_count() -> int:
    """CPU cores this process may use (affinity-aware)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "?"


def machine_info() -> Dict[str, object]:
    import torch
    try:
        from importlib.metadata import version
        nn_version = version("nnscaler")
    except Exception:  # noqa: BLE001 - informational only
        nn_version = "?"
    return {
        "cores": cpu_count(),
        "os_cpu_count": os.cpu_count(),
        "cpu_model": _cpu_model(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "nnscaler": nn_version,
    }


def loadavg():
    """1/5/15-minute load averages (None where unavailable): other load skews timings."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (AttributeError, OSError):
        return None


def command_line() -> str:
    return " ".join(shlex.quote(a) for a in [Path(sys.executable).name, *sys.argv])


def timestamp() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def write_json(name: str, data: Dict[str, object]) -> Path:
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / name
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, path)
    return path


def parse_args(parser, smoke: Dict[str, object], name: str):
    """`parser.parse_args()` plus ``--smoke``: the script's smallest configuration (`smoke` becomes
    the defaults; flags given still win), run by tests/bench/test_bench_scripts.py to keep every
    script working. Its results go to ``--out`` or a fresh temporary directory (file `name`), never
    to bench/results/."""
    parser.add_argument("--smoke", action="store_true",
                        help="smallest configuration (seconds); results to --out or a temporary directory")
    args = parser.parse_args()
    if args.smoke:
        parser.set_defaults(**smoke, out=None)
        args = parser.parse_args()
        if args.out is None:
            args.out = str(Path(tempfile.mkdtemp(prefix="nnscaler-bench-smoke-")) / name)
        elif Path(args.out).resolve().parent == RESULTS_DIR.resolve():
            parser.error("--smoke results never go to bench/results/: pass another --out")
    return args


def median(values: Sequence[float]) -> float:
    return statistics.median(values)


def table(headers: Sequence[str], rows: List[Sequence[object]]) -> str:
    """A plain-text table, right-aligned except the first column."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]

    def fmt(row):
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
    lines = [fmt(cells[0]), "  ".join("-" * w for w in widths)]
    lines += [fmt(r) for r in cells[1:]]
    return "\n".join(lines)


def fmt_bytes(b: float) -> str:
    """Bytes with thousands separators, no decimals."""
    return f"{b:,.0f}"


# -- the example GPT (examples/gpt.py) as the benches configure it -------------------------------

def gpt_config(args):
    """GPTConfig from args.vocab/block_size/layers/heads/embd (no SDPA)."""
    from gpt import GPTConfig
    return GPTConfig(vocab_size=args.vocab, block_size=args.block_size, n_layer=args.layers,
                     n_head=args.heads, n_embd=args.embd, use_sdpa=False)


def base_model(args):
    """The GPT with seed-0 initial weights."""
    from gpt import GPT
    import torch
    torch.manual_seed(0)
    return GPT(gpt_config(args))


def batch(args, step: int = 0):
    """random_batch(step, args.batch, config)."""
    from gpt import random_batch
    return random_batch(step, args.batch, gpt_config(args))


# -- gloo worker processes -----------------------------------------------------------------------

def free_port() -> int:
    """A free TCP port on 127.0.0.1 for MASTER_PORT."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def threads_per_rank(world: int) -> int:
    """Intra-op threads of each of `world` processes: max(1, cores // world)."""
    return max(1, cpu_count() // world)


def init_gloo(rank: int, world: int, port: int, threads: int, env: Optional[Dict[str, str]] = None) -> None:
    """torchrun-style env vars, `threads` intra-op threads, then a gloo process group."""
    import torch
    import torch.distributed as dist
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    if env:
        os.environ.update(env)
    torch.set_num_threads(threads)
    dist.init_process_group("gloo", rank=rank, world_size=world)


def teardown_groups() -> None:
    """Destroy nnscaler's rank-grid groups, then the default process group."""
    import torch.distributed as dist
    from nnscaler.runtime.grid import RankGrid
    RankGrid.destroy_all()
    dist.destroy_process_group()


def _gloo_entry(rank: int, fn: Callable, fn_args: tuple, world: int, port: int, threads: int,
                result_file: str, gather: bool, env: Optional[Dict[str, str]]) -> None:
    """mp.spawn target: init, `fn(rank, *fn_args)`, rank 0 writes the result (all ranks' results,
    gathered, if `gather`) as JSON to `result_file`, tear down."""
    import torch.distributed as dist
    init_gloo(rank, world, port, threads, env)
    try:
        mine = fn(rank, *fn_args)
        if gather:
            gathered = [None] * world
            dist.all_gather_object(gathered, mine)
            mine = gathered
        if rank == 0:
            Path(result_file).write_text(json.dumps(mine))
    finally:
        teardown_groups()


def spawn_gloo(fn: Callable, fn_args: tuple, world: int, result_file: str, *, threads: Optional[int] = None,
               gather: bool = True, env: Optional[Dict[str, str]] = None) -> Tuple[object, float]:
    """Run `fn(rank, *fn_args)` in `world` gloo processes (torch.multiprocessing.spawn; `fn` must be
    a module-level function). Returns (rank 0's JSON result, or the list of every rank's with
    `gather`; the seconds mp.spawn took). Threads per rank default to max(1, cores // world)."""
    import torch.multiprocessing as mp
    threads = threads or threads_per_rank(world)
    t0 = time.perf_counter()
    mp.spawn(_gloo_entry, args=(fn, fn_args, world, free_port(), threads, result_file, gather, env), nprocs=world)
    seconds = time.perf_counter() - t0
    return json.loads(Path(result_file).read_text()), seconds


# -- steps inside the workers (fsdp.py, moe.py) --------------------------------------------------

MIB = 1 << 20


def fmt_mib(b: Optional[float]) -> str:
    """Bytes as MiB with one decimal and thousands separators; '-' for None."""
    return "-" if b is None else f"{b / MIB:,.1f}"


def all_reduce_floats(values: Sequence[float], op=None) -> List[float]:
    """`values` all-reduced over the default process group as float64 (`op` a
    torch.distributed.ReduceOp; SUM by default)."""
    import torch
    import torch.distributed as dist
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.SUM if op is None else op)
    return t.tolist()


def max_rel_diff(xs: Sequence[float], ref: Sequence[float]) -> float:
    """The largest |x - r| / |r| over the steps both sequences have (nan when either is empty)."""
    n = min(len(xs), len(ref))
    return max((abs(x - r) / max(abs(r), 1e-12) for x, r in zip(xs[:n], ref[:n])), default=float("nan"))


def timed_step(model, opt, batch: dict, phases: Optional[List[float]] = None):
    """One training step: `zero_grad`, forward (`model(**batch)`, the loss), backward, `step`.
    With `phases`, adds the seconds of zero_grad + forward, backward and step to phases[0], [1], [2].
    Returns the loss, detached."""
    t0 = time.perf_counter()
    opt.zero_grad()
    loss = model(**batch)
    t1 = time.perf_counter()
    loss.backward()
    t2 = time.perf_counter()
    opt.step()
    if phases is not None:
        t3 = time.perf_counter()
        phases[0] += t1 - t0
        phases[1] += t2 - t1
        phases[2] += t3 - t2
    return loss.detach()


def interleaved_rounds(cases: Sequence[str], rounds: int, block: int, run: Callable[[str], list],
                       losses: Dict[str, list]) -> Tuple[Dict[str, List[float]], List[Dict[str, float]]]:
    """`rounds` rounds in which every case runs `run(case)` (a block of `block` steps, returning their
    losses as scalar tensors, appended to `losses[case]`), the order rotated every round, a barrier
    before every block. A block's time is that of the slower rank, per step. Returns (each case's
    block times, each round's {case: block time})."""
    import torch.distributed as dist
    cases = list(cases)
    times = {c: [] for c in cases}
    per_round = []
    for r in range(rounds):
        order = cases[r % len(cases):] + cases[:r % len(cases)]
        this = {}
        for c in order:
            dist.barrier()
            t0 = time.perf_counter()
            out = run(c)
            dt = all_reduce_floats([time.perf_counter() - t0], dist.ReduceOp.MAX)[0] / block
            times[c].append(dt)
            this[c] = dt
            losses[c].extend(x.item() for x in out)
        per_round.append(this)
    return times, per_round


# -- results -------------------------------------------------------------------------------------

def run_header() -> Dict[str, object]:
    """The first keys of every results file: timestamp, command, machine."""
    return {"timestamp": timestamp(), "command": command_line(), "machine": machine_info()}


def save_results(out: str, data: Dict[str, object]) -> Path:
    """Write `data` to `out` (atomically via write_json when it is in bench/results) and print
    'wrote <path>'."""
    path = Path(out)
    if path.resolve().parent == RESULTS_DIR.resolve():
        path = write_json(path.name, data)
    else:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(data, indent=2) + "\n")
    print(f"wrote {path}")
    return path


# -- collectives (comm.py and _zero_comm.py) -----------------------------------------------------

FALLBACK = "(fallback)"


def base_key(key: str) -> str:
    """A stats key without its '(fallback)' suffix."""
    return key[:-len(FALLBACK)] if key.endswith(FALLBACK) else key


def wire_bytes(key: str, payload: float, n: int) -> float:
    """Bytes one rank sends on the wire for a recorded (key, payload bytes), ring / pairwise
    algorithms. A fallback records the payload of the collective it really ran (stats.py):
    reduce_scatter(fallback) an all-reduce of B, all_to_all(fallback) and all_gather(fallback)
    an all-gather of the local piece."""
    ran = {"reduce_scatter" + FALLBACK: "all_reduce", "all_to_all" + FALLBACK: "all_gather",
           "all_gather" + FALLBACK: "all_gather"}.get(key, base_key(key))
    if ran == "all_reduce":
        return 2 * (n - 1) / n * payload  # payload = B
    if ran == "all_gather":
        return (n - 1) * payload  # payload = B/n, wire (n-1)/n*B
    if ran == "reduce_scatter":
        return (n - 1) / n * payload  # payload = B
    if ran == "all_to_all":
        return (n - 1) / n * payload  # payload = B/n, wire (n-1)/n*B/n
    return float("nan")
