"""Random streams of the generated forward (user guide: docs/tracing.md "Random numbers").

Every random op the generated code runs (dropout, rand_like, bernoulli_, ...) draws from a stream
the runtime owns, not from how the user seeded each rank:

* ``ParallelModule.rng_scope()`` (entered by ``forward`` and by the pipeline executor around each
  stage) swaps the module's stream into the default generator (CPU, and the CUDA default
  generator of the module's device) and the user's state back at exit, also on exceptions. So
  ``torch.utils.checkpoint`` (which saves and restores the default generator's state) recomputes
  the same masks.
* ``rng_mode="parallel"`` (default): the stream is seeded from ``(seed, data-parallel index)``
  (the seed itself on replica 0), identical on the ranks of a unit; a random op whose output is split across the unit
  (``shard_stream``) draws a sub-seed from the stream (identical on every rank, so the stream
  stays in step) and runs under a generator seeded from ``(sub-seed, piece)``.
* ``rng_mode="exact"``: every rank's stream is seeded with the seed itself, like
  ``torch.manual_seed(seed)`` on one device; a random op is drawn at its full (single-device)
  shape and each rank keeps its piece (``full_ones`` / ``piece``): the tensor-parallel slice of
  its output and, for values computed from the forward's inputs, the rank's block of the global
  batch along dim 0 (rank r's batch is the r-th contiguous block of the global batch).

The seed is rank 0's ``torch.initial_seed()`` at module construction (broadcast), or what
``ParallelModule.manual_seed(seed)`` sets. ``rng_state()`` / ``load_rng_state()`` give the state as
plain tensors (no pickle) for checkpoints.
"""
from __future__ import annotations

import contextlib
import operator
from typing import Dict, Optional

import torch

__all__ = ["RandomStreams", "shard_stream", "full_ones", "piece", "mix_seed"]

_MASK64 = (1 << 64) - 1
_SEED_BOUND = 1 << 63  # seeds are kept in int64 tensors


def mix_seed(*values: int) -> int:
    """A 63-bit seed from ints (splitmix64 over the values): distinct inputs give unrelated seeds."""
    h = 0x9E3779B97F4A7C15
    for v in values:
        h = (h ^ (int(v) & _MASK64)) & _MASK64
        h = (h + 0x9E3779B97F4A7C15) & _MASK64
        z = h
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
        h = z ^ (z >> 31)
    return h % _SEED_BOUND


def _cuda_generator(device: torch.device):
    if device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    return torch.cuda.default_generators[index]


class RandomStreams:
    """The random stream of one ParallelModule on one rank (see the module docstring)."""

    def __init__(self, module, mode: str, nops: int):
        if mode not in ("parallel", "exact"):
            raise ValueError(f"rng_mode must be 'parallel' or 'exact', got {mode!r}")
        self.mode = mode
        self.nops = nops  # random ops in the whole generated program (same on every rank)
        self.grid = module.grid
        self.device = torch.device(module.device)
        self._active = False
        self.seed = self._initial_seed()
        self._cpu: torch.Tensor = torch.empty(0, dtype=torch.uint8)
        self._cuda: Optional[torch.Tensor] = None
        self.reseed(self.seed)

    # -- seeding --------------------------------------------------------------------------------
    def _initial_seed(self) -> int:
        """Rank 0's torch.initial_seed(), so per-rank user seeds do not matter (collective)."""
        seed = torch.initial_seed() % _SEED_BOUND
        import torch.distributed as dist
        if self.nops and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            on = self.device if dist.get_backend() == "nccl" else torch.device("cpu")
            t = torch.tensor([seed], dtype=torch.int64, device=on)
            dist.broadcast(t, src=0)
            seed = int(t.item())
        return seed

    def stream_seed(self) -> int:
        """The seed of this rank's stream: the seed itself in exact mode and on the first
        data-parallel replica (so one process draws what torch.manual_seed(seed) draws), else mixed
        with the data-parallel index (identical on the ranks of a unit, distinct per replica)."""
        if self.mode == "exact" or self.grid.dp_rank == 0:
            return self.seed
        return mix_seed(self.seed, self.grid.dp_rank)

    def reseed(self, seed: int) -> None:
        try:
            if isinstance(seed, bool):
                raise TypeError
            seed = operator.index(seed)  # int, numpy / torch integers
        except TypeError:
            raise TypeError(f"manual_seed(seed): seed must be an int, got {type(seed).__name__} {seed!r}") from None
        if not 0 <= seed < _SEED_BOUND:
            raise ValueError(f"manual_seed(seed): seed must be in [0, 2**63), got {seed}")
        self.seed = seed
        s = self.stream_seed()
        self._cpu = torch.Generator().manual_seed(s).get_state()
        if self.device.type == "cuda":
            self._cuda = torch.Generator(device=self.device).manual_seed(s).get_state()

    # -- state (checkpoints) --------------------------------------------------------------------
    def state(self) -> Dict[str, torch.Tensor]:
        out = {"seed": torch.tensor(self.seed, dtype=torch.int64), "cpu": self._cpu.clone()}
        if self._cuda is not None:
            out["cuda"] = self._cuda.clone()
        return out

    def load_state(self, state: Dict[str, torch.Tensor]) -> None:
        missing = [k for k in ("seed", "cpu") if k not in state]
        if missing:
            raise KeyError(f"load_rng_state: the state lacks {', '.join(missing)} (pass what rng_state() returned)")
        cpu = state["cpu"]
        if not isinstance(cpu, torch.Tensor) or cpu.dtype != torch.uint8 or cpu.numel() != self._cpu.numel():
            raise ValueError(f"load_rng_state: 'cpu' must be the uint8 tensor rng_state() returned "
                             f"({self._cpu.numel()} bytes), got {getattr(cpu, 'dtype', type(cpu).__name__)} "
                             f"of {getattr(cpu, 'numel', lambda: '?')()} elements")
        self.seed = int(state["seed"])
        self._cpu = cpu.detach().to("cpu").clone()
        if self.device.type == "cuda":
            if "cuda" in state:
                self._cuda = state["cuda"].detach().to("cpu").clone()
            else:  # saved on CPU: derive a CUDA stream from the seed
                self._cuda = torch.Generator(device=self.device).manual_seed(self.stream_seed()).get_state()

    # -- the swap -------------------------------------------------------------------------------
    @contextlib.contextmanager
    def scope(self):
        """The module's stream in the default generator(s) for the duration; the user's after."""
        if self._active or not self.nops:
            yield
            return
        gen, cuda = torch.default_generator, _cuda_generator(self.device)
        user = gen.get_state()
        user_cuda = cuda.get_state() if cuda is not None else None
        gen.set_state(self._cpu)
        if cuda is not None:
            cuda.set_state(self._cuda)
        self._active = True
        try:
            yield
        finally:
            self._active = False
            self._cpu = gen.get_state()
            gen.set_state(user)
            if cuda is not None:
                self._cuda = cuda.get_state()
                cuda.set_state(user_cuda)


def _piece_index(module, n: int) -> int:
    """This rank's piece of an op split in `n` over the unit (or a pipeline stage's devices)."""
    return module.grid.plan_device % n


@contextlib.contextmanager
def shard_stream(module, n: int):
    """Run a random op whose output is split in `n` pieces: a sub-seed drawn from the current
    stream (identical on every rank, so the stream stays in step), then a generator seeded from
    (sub-seed, this rank's piece); the stream continues after the op as if it had drawn one int."""
    sub = int(torch.randint(0, _SEED_BOUND - 1, (1,), dtype=torch.int64).item())
    seed = mix_seed(sub, _piece_index(module, n))
    gen, cuda = torch.default_generator, _cuda_generator(torch.device(module.device))
    saved = gen.get_state()
    saved_cuda = cuda.get_state() if cuda is not None else None
    gen.manual_seed(seed)
    if cuda is not None:
        cuda.manual_seed(seed)
    try:
        yield
    finally:
        gen.set_state(saved)
        if cuda is not None:
            cuda.set_state(saved_cuda)


def _splits(module, ndim: int, shard, batch: bool):
    """[(dim, n, k)], outermost first: the data-parallel block of dim 0 (when `batch`), then the
    op's own split over the unit."""
    out = []
    grid = module.grid
    if batch and grid.dp_size > 1 and ndim > 0:
        out.append((0, grid.dp_size, grid.dp_rank))
    if shard is not None:
        dim, n = shard
        out.append((dim % ndim, n, _piece_index(module, n)))
    return out


def full_ones(module, x: torch.Tensor, shard=None, batch: bool = False) -> torch.Tensor:
    """Ones of the FULL (single-device) shape of local tensor `x` (exact mode)."""
    shape = list(x.shape)
    for dim, n, _ in _splits(module, x.dim(), shard, batch):
        shape[dim] *= n
    return torch.ones(shape, dtype=x.dtype, device=x.device)


def piece(module, full: torch.Tensor, shard=None, batch: bool = False) -> torch.Tensor:
    """This rank's piece of a full-shape tensor (exact mode): the inverse of `full_ones`."""
    starts = [0] * full.dim()
    sizes = list(full.shape)
    for dim, n, k in _splits(module, full.dim(), shard, batch):
        sizes[dim] //= n
        starts[dim] += k * sizes[dim]
    index = tuple(slice(a, a + s) for a, s in zip(starts, sizes))
    return full[index]


class RandomStreamsMixin:
    """The public random-stream API of ParallelModule (contract; docs/tracing.md "Random numbers").

    The generated class carries ``RANDOM = {"mode": "parallel" | "exact", "ops": n}`` (n: random
    ops in the whole program, the same on every rank; 0 or absent: no stream, no swap)."""

    RANDOM = None

    @property
    def _random_streams(self) -> RandomStreams:
        streams = self.__dict__.get("_nnscaler_random")
        if streams is None:  # built in _post_init (collective: rank 0's seed is broadcast)
            meta = type(self).RANDOM or {}
            mode = meta.get("mode", self.compute_config.rng_mode)
            streams = RandomStreams(self, mode, int(meta.get("ops", 0)))
            self.__dict__["_nnscaler_random"] = streams
        return streams

    def manual_seed(self, seed: int) -> "RandomStreamsMixin":
        """Seed the module's random stream; call it on every rank with the same seed. In
        ``rng_mode='exact'`` the random ops then draw what the single-device model draws after
        ``torch.manual_seed(seed)``. Leaves the user's default generator alone. Returns self."""
        self._random_streams.reseed(seed)
        return self

    def initial_seed(self) -> int:
        """The seed the module's stream was last seeded with (rank 0's ``torch.initial_seed()`` at
        construction, or the last ``manual_seed``)."""
        return self._random_streams.seed

    def rng_state(self) -> Dict[str, torch.Tensor]:
        """This rank's stream as plain tensors: ``seed`` (int64), ``cpu`` (uint8 generator state),
        ``cuda`` (uint8, on a CUDA module). Per rank: save it with the rank's shard."""
        return self._random_streams.state()

    def load_rng_state(self, state: Dict[str, torch.Tensor]) -> None:
        """Restore what ``rng_state()`` returned on this rank: later random ops continue the stream."""
        self._random_streams.load_state(state)

    def rng_scope(self):
        """Context manager: the module's stream in the default generator(s), the caller's after.
        ``forward`` and the pipeline executor enter it; enter it yourself only to run generated
        methods directly."""
        return self._random_streams.scope()
