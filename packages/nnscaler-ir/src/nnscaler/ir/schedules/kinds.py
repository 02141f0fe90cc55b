"""The built-in schedules (the ``pipeline_scheduler`` values): GPipe, 1F1B, 1F1B+, interleaved
1F1B, Chimera (direct), inference, and an explicit one given as action lists."""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence

from ..config import ConfigError
from .base import Action, Schedule, ScheduleError, _check_int

__all__ = ["GPipe", "OneFOneB", "OneFOneBPlus", "Interleaved1F1B", "ChimeraDirect", "InferPipe", "ExplicitSchedule"]


def _one_f_one_b(stage: int, micros: Sequence[int], warmup: int) -> List[Action]:
    """The 1F1B order of one stage over ``micros``: ``warmup`` forwards, then F/B pairs, then Bs."""
    n = len(micros)
    w = max(0, min(warmup, n))
    out = [Action("F", stage, micros[i]) for i in range(w)]
    for i in range(n - w):
        out += [Action("F", stage, micros[w + i]), Action("B", stage, micros[i])]
    out += [Action("B", stage, micros[i]) for i in range(n - w, n)]
    return out


class GPipe(Schedule):
    """GPipe: every device runs the forwards of all micro-batches, then all backwards.
    Peak in-flight micro-batches: ``m`` on every device."""

    name = "gpipe"

    def _build(self):
        m = range(self.nmicros)
        return [[Action("F", s, i) for i in m] + [Action("B", s, i) for i in m] for s in range(self.nstages)]


class OneFOneB(Schedule):
    """1F1B (PipeDream-flush): stage ``s`` runs ``min(p-1-s, m)`` warm-up forwards, then
    alternates one forward and one backward, then the remaining backwards.
    Peak in-flight micro-batches on stage ``s``: ``min(p - s, m)``."""

    name = "1f1b"

    def _warmup(self, stage: int) -> int:
        return self.nstages - 1 - stage

    def _build(self):
        micros = list(range(self.nmicros))
        return [_one_f_one_b(s, micros, self._warmup(s)) for s in range(self.nstages)]


class OneFOneBPlus(OneFOneB):
    """1F1B+ : 1F1B with one extra warm-up forward on every stage but the last.

    Stage ``s < p-1`` runs ``min(p - s, m)`` warm-up forwards (1F1B runs ``p-1-s``); the last
    stage keeps 1F1B's order (F, B, F, B, ...), since an extra forward there would only delay
    the first backward. The extra activation per device is slack: when the backward coming
    from stage ``s+1`` is late (communication, uneven stages) the device already holds the next
    forward's input and can run it instead of idling. With zero-latency communication and
    equal stages the timeline has the same length and bubble as 1F1B; the price is one more
    in-flight micro-batch: peak ``min(p - s + 1, m)`` on stage ``s < p-1``.

    (Upstream nnScaler's ``1f1b_plus`` additionally interleaves tensor-parallel segments that
    span all devices between the pipeline stages; that is a plan property, not modelled here.)
    """

    name = "1f1b_plus"

    def _warmup(self, stage: int) -> int:
        return 0 if stage == self.nstages - 1 else self.nstages - stage


class Interleaved1F1B(Schedule):
    """Megatron-LM's interleaved 1F1B (Narayanan et al., 2021).

    ``v = nstages // ndevices`` model chunks per device; stage ``s`` lives on device
    ``s % ndevices`` (device ``d`` holds stages ``d, d+p, d+2p, ...``). Micro-batches go in
    groups of ``p = ndevices``: the device runs the group's forwards on chunk 0, then on chunk 1,
    ..., and backwards in the reverse chunk order. Device ``d`` warms up with
    ``min((p-1-d)*2 + (v-1)*p, v*m)`` forwards, then alternates forward/backward, then cools down.
    Requires ``nstages % ndevices == 0`` and ``nmicros % ndevices == 0``.
    Analytic bubble (Megatron's ideal): ``(p-1) / (v*m + p - 1)``.
    """

    name = "1f1b_interleaved"

    def _check(self):
        p, n = self.ndevices, self.nstages
        if n % p != 0 or n // p < 1:
            raise ConfigError(
                f"pipeline_scheduler='1f1b_interleaved' needs nstages (pipeline_nstages) to be a multiple of "
                f"ndevices (pp_size) (nstages = v * ndevices, v stages per device); got nstages={n}, ndevices={p}")
        if self.nmicros % p != 0:
            raise ConfigError(
                f"pipeline_scheduler='1f1b_interleaved' needs nmicros (pipeline_nmicros) to be a multiple of "
                f"ndevices (pp_size) (micro-batches run in groups of ndevices); got nmicros={self.nmicros}, "
                f"ndevices={p}")

    @property
    def nchunks(self) -> int:
        return self.nstages // self.ndevices

    def _build(self):
        p, v, m = self.ndevices, self.nchunks, self.nmicros
        total = v * m

        def fwd(d, k):
            chunk = (k % (p * v)) // p
            return Action("F", chunk * p + d, (k // (p * v)) * p + k % p)

        def bwd(d, k):
            chunk = v - 1 - (k % (p * v)) // p
            return Action("B", chunk * p + d, (k // (p * v)) * p + k % p)

        out = []
        for d in range(p):
            w = min((p - 1 - d) * 2 + (v - 1) * p, total) if v > 1 else min(p - 1 - d, total)
            acts = [fwd(d, k) for k in range(w)]
            for i in range(total - w):
                acts += [fwd(d, w + i), bwd(d, i)]
            acts += [bwd(d, k) for k in range(total - w, total)]
            out.append(acts)
        return out

    def analytic_bubble(self):
        p, v, m = self.ndevices, self.nchunks, self.nmicros
        return (p - 1) / (v * m + p - 1)


class ChimeraDirect(Schedule):
    """Chimera with direct concatenation (Li & Hoefler, 2021), simplified; 4 stages only.

    Two replicas of the 4-stage model run as two pipelines in opposite directions on the same 4
    devices: the *down* pipeline places stage ``s`` on device ``s`` and takes the even
    micro-batches; the *up* pipeline places stage ``s`` on device ``3 - s`` and takes the odd
    ones. So every device holds two stages (``d`` and ``3 - d``), one of each replica, and the
    two replicas' weight gradients must be all-reduced after the step (the executor's job).

    Simplification: each pipeline's per-device order is plain 1F1B over its ``m/2``
    micro-batches; the two orders are merged on each device greedily (unit-time simulation:
    run whichever head is ready, a backward before a forward, the older micro-batch first).
    This keeps Chimera's point -- the up pipeline fills the down pipeline's bubbles, memory is
    balanced (``(4 - d) + (d + 1) = 5`` activations at most per device) -- without the
    paper's forward-doubling / backward-halving variants. Requires ``nstages == 4`` and an even
    ``nmicros``. There is no closed-form bubble here: ``analytic_bubble()`` is None, use
    ``bubble_fraction()``.
    """

    name = "chimera_direct"

    def _check(self):
        if self.nstages != 4:
            raise ConfigError(f"pipeline_scheduler='chimera_direct' needs nstages (pipeline_nstages) == 4 "
                              f"(two 4-stage replicas in opposite directions); got nstages={self.nstages}")
        if self.ndevices != 4:
            raise ConfigError(f"pipeline_scheduler='chimera_direct' needs ndevices (pp_size) == 4; "
                              f"got ndevices={self.ndevices}")
        if self.nmicros % 2 != 0:
            raise ConfigError(f"pipeline_scheduler='chimera_direct' needs an even nmicros (pipeline_nmicros) "
                              f"(half the micro-batches go down, half go up); got nmicros={self.nmicros}")

    def device_of(self, stage: int, micro: int = 0) -> int:
        return stage if micro % 2 == 0 else 3 - stage

    def _build(self):
        down = list(range(0, self.nmicros, 2))
        up = list(range(1, self.nmicros, 2))
        # per device: two queues, the down replica's stage d and the up replica's stage 3-d
        queues = [[_one_f_one_b(d, down, 3 - d), _one_f_one_b(3 - d, up, 3 - (3 - d))] for d in range(4)]
        heads = [[0, 0] for _ in range(4)]
        out: List[List[Action]] = [[] for _ in range(4)]
        done = set()
        running: List[Optional[Tuple[Action, int]]] = [None] * 4
        t = 0
        left = sum(len(q) for qs in queues for q in qs)
        while left:
            for d in range(4):
                if running[d] is not None and running[d][1] == t:
                    a = running[d][0]
                    done.add((a.kind, a.stage, a.micro))
                    running[d] = None
                    left -= 1
            for d in range(4):
                if running[d] is not None:
                    continue
                ready = []
                for qi in (0, 1):
                    if heads[d][qi] < len(queues[d][qi]):
                        a = queues[d][qi][heads[d][qi]]
                        if all(dep in done for dep in self.deps(a)):
                            ready.append((a.kind != "B", a.micro, qi, a))
                if ready:
                    _, _, qi, a = min(ready)
                    heads[d][qi] += 1
                    out[d].append(a)
                    running[d] = (a, t + self.cost(a))
            if left and all(r is None for r in running):  # pragma: no cover - 1F1B queues cannot deadlock
                raise ScheduleDeadlockError("chimera_direct: greedy merge found no runnable action")
            t += 1
        return out

    def analytic_bubble(self):
        return None


class InferPipe(Schedule):
    """Inference pipeline: stage ``s`` runs the forwards of micro-batches ``0..m-1`` in order.
    Bubble ``(p - 1) / (m + p - 1)`` (forwards only)."""

    name = "infer_pipe"
    training = False

    def _build(self):
        return [[Action("F", s, i) for i in range(self.nmicros)] for s in range(self.nstages)]


class ExplicitSchedule(Schedule):
    """A schedule given by its action lists (for tests, experiments and hand-written plans).

    ``placement`` maps ``(stage, micro) -> device``; default ``stage % ndevices``.
    """

    def __init__(self, name: str, nstages: int, nmicros: int, actions: Sequence[Sequence[Action]], *,
                 placement=None, training: bool = True, backward_cost: int = 2):
        self.name = name
        self.training = training
        self._given = [list(a) for a in actions]
        self._placement = placement
        super().__init__(nstages, nmicros, len(self._given), backward_cost=backward_cost)

    def _check(self):
        pass

    def _build(self):
        return self._given

    def device_of(self, stage: int, micro: int = 0) -> int:
        if self._placement is not None:
            return self._placement(stage, micro)
        return stage % self.ndevices

    def analytic_bubble(self):
        return None
