"""Pipeline schedules as small, pure-Python objects (no torch, no torch.distributed).

A schedule says, for every pipeline device, which forward (``F``) and backward (``B``) steps it
runs and in which order. A *stage* is one piece of the model; a *device* is one pipeline rank
(one ``pp`` position; it may itself hold several GPUs for tensor / data parallelism). Stage ``s``
of micro-batch ``m`` is written ``F(s, m)`` / ``B(s, m)``.

Dependencies (the only ones the simulation knows; communication is free and instantaneous):

* ``F(s, m)`` runs after ``F(s-1, m)`` has finished;
* ``B(s, m)`` runs after ``F(s, m)`` and after ``B(s+1, m)`` have finished
  (the last stage's backward needs only its own forward: the loss is computed there);
* a device runs its actions strictly in its list order, one at a time.

Cost model (used by :meth:`Schedule.timeline`, :meth:`Schedule.bubble_fraction`): discrete time,
every forward costs 1 unit, every backward ``backward_cost`` units (default 2, i.e. ``B = 2F``,
the usual ratio for transformer layers; any positive integer is accepted). Under this model
GPipe and 1F1B on ``p`` stages and ``m`` micro-batches both last ``(m + p - 1) * (1 + b)`` units
while each device is busy ``m * (1 + b)``, so their bubble is exactly ``(p - 1) / (m + p - 1)``
for *any* backward cost ``b`` -- that is :meth:`Schedule.analytic_bubble`.

Schedules (names are the ``pipeline_scheduler`` values of the ``pp`` / ``hybrid`` policies):

=====================  =====================================================================
``gpipe``              all forwards, then all backwards (backwards in micro-batch order).
``1f1b``               warm-up ``p-1-s`` forwards on stage ``s``, steady one-forward-one-
                       backward, cool-down backwards. Peak in-flight micro-batches ``p - s``.
``1f1b_plus``          1F1B with one more warm-up forward per stage (``p - s`` instead of
                       ``p-1-s``, capped at ``m``): each device keeps one extra activation so a
                       late backward from the next stage never leaves it idle when it could
                       already run the next forward. Peak in-flight ``min(p - s + 1, m)``.
                       Same bubble as 1F1B in the zero-latency model when the last stage
                       keeps 1F1B's order (it does: its warm-up stays 0, see the class).
``1f1b_interleaved``   Megatron-LM's interleaved 1F1B: ``v`` model chunks per device,
                       ``nstages = v * ndevices``, stage ``s`` on device ``s % ndevices``;
                       requires ``nmicros % ndevices == 0``.
``chimera_direct``     two replicas of a 4-stage pipeline in opposite directions (see class).
``infer_pipe``         inference: forwards only, micro-batches in order.
=====================  =====================================================================

Use :func:`get_schedule` to build one by name; ``print(schedule.render())`` shows the timeline.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

from .config import ConfigError
from .errors import NnScalerError

__all__ = [
    "Action", "Schedule", "ExplicitSchedule", "GPipe", "OneFOneB", "OneFOneBPlus", "Interleaved1F1B",
    "ChimeraDirect", "InferPipe", "ScheduleError", "ScheduleDeadlockError", "get_schedule",
    "SCHEDULES", "TRAINING_SCHEDULES", "INFERENCE_SCHEDULES",
]


class ScheduleError(NnScalerError, ValueError):
    """A schedule's action lists are malformed (missing, duplicated or misplaced actions)."""


class ScheduleDeadlockError(ScheduleError):
    """The devices' action orders can never all complete: some device waits forever."""


@dataclass(frozen=True, order=True)
class Action:
    """One step of a pipeline schedule: forward (``'F'``) or backward (``'B'``) of micro-batch
    ``micro`` on stage ``stage``."""

    kind: str
    stage: int
    micro: int

    def __post_init__(self):
        if self.kind not in ("F", "B"):
            raise ScheduleError(f"Action.kind must be 'F' (forward) or 'B' (backward), got {self.kind!r}")

    def __str__(self) -> str:
        return f"{self.kind}{self.micro}@s{self.stage}"


def _check_int(name: str, value, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{name} must be an integer >= {minimum}, got {value!r}")
    if value < minimum:
        raise ConfigError(f"{name} must be >= {minimum}, got {value}")
    return value


class Schedule:
    """Base class: a named set of per-device action lists plus a placement of stages.

    Subclasses set ``name`` / ``training`` and implement :meth:`_build` (one list of
    :class:`Action` per device, in execution order) and, where it differs from
    ``stage % ndevices``, :meth:`device_of`.
    """

    name: str = "schedule"
    training: bool = True

    def __init__(self, nstages: int, nmicros: int, ndevices: Optional[int] = None, *, backward_cost: int = 2):
        self.nstages = _check_int("nstages (pipeline_nstages)", nstages)
        self.nmicros = _check_int("nmicros (pipeline_nmicros)", nmicros)
        self.ndevices = _check_int("ndevices (pp_size)", nstages if ndevices is None else ndevices)
        self.backward_cost = _check_int("backward_cost", backward_cost)
        self._check()
        self._actions: List[List[Action]] = [list(a) for a in self._build()]
        self._timeline: Optional[List[List[Optional[Action]]]] = None

    # -- to override -----------------------------------------------------------------------
    def _check(self) -> None:
        """Refuse configurations the schedule cannot apply to (raise ConfigError)."""
        if self.ndevices != self.nstages:
            raise ConfigError(
                f"pipeline_scheduler={self.name!r} places one stage per device: ndevices (pp_size) must equal "
                f"nstages (pipeline_nstages); got ndevices={self.ndevices}, nstages={self.nstages}")

    def _build(self) -> List[List[Action]]:
        raise NotImplementedError

    def device_of(self, stage: int, micro: int = 0) -> int:
        """The device that runs ``stage`` (for ``micro``; only Chimera depends on it)."""
        return stage % self.ndevices

    def analytic_bubble(self) -> Optional[float]:
        """Closed-form bubble fraction under the module's cost model, or None if there is none."""
        p, m = self.ndevices, self.nmicros
        return (p - 1) / (m + p - 1)

    # -- queries ---------------------------------------------------------------------------
    def actions(self, device: int) -> List[Action]:
        """The actions of ``device`` in execution order (a copy)."""
        if not 0 <= device < self.ndevices:
            raise ValueError(f"device must be in [0, {self.ndevices}), got {device}")
        return list(self._actions[device])

    def cost(self, action: Action) -> int:
        return 1 if action.kind == "F" else self.backward_cost

    def _deps(self, a: Action) -> List[Tuple[str, int, int]]:
        if a.kind == "F":
            return [("F", a.stage - 1, a.micro)] if a.stage > 0 else []
        deps = [("F", a.stage, a.micro)]
        if a.stage < self.nstages - 1:
            deps.append(("B", a.stage + 1, a.micro))
        return deps

    def timeline(self) -> List[List[Optional[Action]]]:
        """Simulate the schedule; per device, one entry per time unit: the running Action or None.

        A backward occupies ``backward_cost`` consecutive slots. Raises ScheduleDeadlockError when
        at some time no device is running and none can start its next action.
        """
        if self._timeline is None:
            self._timeline = self._simulate()
        return [list(row) for row in self._timeline]

    def _simulate(self) -> List[List[Optional[Action]]]:
        D = self.ndevices
        lists = self._actions
        ptr = [0] * D
        running: List[Optional[Action]] = [None] * D
        busy_until = [0] * D
        done: Dict[Tuple[str, int, int], int] = {}
        slots: List[List[Optional[Action]]] = [[] for _ in range(D)]
        t = 0
        while any(ptr[d] < len(lists[d]) for d in range(D)) or any(r is not None for r in running):
            for d in range(D):
                if running[d] is not None and busy_until[d] == t:
                    a = running[d]
                    done[(a.kind, a.stage, a.micro)] = t
                    running[d] = None
            if all(ptr[d] == len(lists[d]) and running[d] is None for d in range(D)):
                break
            for d in range(D):
                if running[d] is None and ptr[d] < len(lists[d]):
                    a = lists[d][ptr[d]]
                    if all(dep in done for dep in self._deps(a)):
                        running[d] = a
                        busy_until[d] = t + self.cost(a)
                        ptr[d] += 1
            if all(r is None for r in running):
                waiting = "\n".join(
                    f"  dev{d}: waits at {lists[d][ptr[d]]} for "
                    f"{[f'{k}{m}@s{s}' for (k, s, m) in self._deps(lists[d][ptr[d]]) if (k, s, m) not in done]}"
                    for d in range(D) if ptr[d] < len(lists[d]))
                orders = "\n".join(f"  dev{d}: " + " ".join(str(a) for a in lists[d]) for d in range(D))
                raise ScheduleDeadlockError(
                    f"schedule {self.name!r} deadlocks at time {t} (no device can run its next action):\n"
                    f"{waiting}\naction lists:\n{orders}")
            for d in range(D):
                slots[d].append(running[d])
            t += 1
        return slots

    def makespan(self) -> int:
        """Length of the simulated timeline, in time units."""
        return len(self.timeline()[0])

    def bubble_fraction(self) -> float:
        """Idle device-time over total device-time, measured from the simulated timeline."""
        tl = self.timeline()
        total = sum(len(row) for row in tl)
        idle = sum(1 for row in tl for slot in row if slot is None)
        return idle / total

    def peak_inflight(self, device: int) -> int:
        """Most (stage, micro-batch) activations held at once on ``device``: forwards run whose
        backward has not finished yet (the activation-memory proxy). Counted in stage
        activations: with several stages per device (interleaved: ``v`` chunks, Chimera: 2)
        each one is a fraction of the device's layers, so compare in layers, not in counts.
        Inference holds none beyond the running forward, so it reports 1."""
        if not self.training:
            return 1 if self._actions[device] else 0
        cur = peak = 0
        for a in self.actions(device):
            cur += 1 if a.kind == "F" else -1
            peak = max(peak, cur)
        return peak

    def validate(self) -> "Schedule":
        """Check completeness, placement and absence of deadlock; returns self.

        Every (stage, micro) has exactly one F (and, when training, exactly one B), each on
        ``device_of(stage, micro)``; the simulated run completes.
        """
        if len(self._actions) != self.ndevices:
            raise ScheduleError(f"schedule {self.name!r} has {len(self._actions)} action lists for "
                                f"{self.ndevices} devices")
        seen: Dict[Tuple[str, int, int], int] = {}
        for d, acts in enumerate(self._actions):
            for a in acts:
                if not (0 <= a.stage < self.nstages and 0 <= a.micro < self.nmicros):
                    raise ScheduleError(f"schedule {self.name!r}: {a} on dev{d} is out of range "
                                        f"(nstages={self.nstages}, nmicros={self.nmicros})")
                if not self.training and a.kind == "B":
                    raise ScheduleError(f"inference schedule {self.name!r} has a backward action {a} on dev{d}")
                want = self.device_of(a.stage, a.micro)
                if want != d:
                    raise ScheduleError(f"schedule {self.name!r}: {a} is on dev{d} but stage {a.stage} "
                                        f"of micro-batch {a.micro} is placed on dev{want}")
                key = (a.kind, a.stage, a.micro)
                if key in seen:
                    raise ScheduleError(f"schedule {self.name!r}: {a} appears twice (dev{seen[key]}, dev{d})")
                seen[key] = d
        kinds = ("F", "B") if self.training else ("F",)
        missing = [f"{k}{m}@s{s}" for k in kinds for s in range(self.nstages) for m in range(self.nmicros)
                   if (k, s, m) not in seen]
        if missing:
            raise ScheduleError(f"schedule {self.name!r} misses actions: {', '.join(missing[:20])}"
                                + (" ..." if len(missing) > 20 else ""))
        self._timeline = None
        self.timeline()
        return self

    # -- display ---------------------------------------------------------------------------
    def _token(self, a: Action) -> str:
        stages_per_dev = self.nstages // self.ndevices if self.name != ChimeraDirect.name else 1
        return f"{a.kind}{a.micro}" + (f"s{a.stage}" if stages_per_dev > 1 else "")

    def render(self) -> str:
        """The simulated timeline as text, one line per device, one column per time unit.

        ``F3`` is the forward of micro-batch 3, ``B3`` its backward (repeated over each unit it
        occupies), ``.`` is idle; with several stages per device the stage is appended (``F3s5``),
        except for Chimera where the micro-batch's parity already names the stage (even: down
        replica, stage ``d``; odd: up replica, stage ``3 - d``).
        """
        tl = self.timeline()
        toks = [[self._token(a) if a is not None else "." for a in row] for row in tl]
        width = max((len(t) for row in toks for t in row), default=1)
        return "\n".join(f"dev{d}: " + " ".join(t.ljust(width) for t in row).rstrip()
                         for d, row in enumerate(toks))

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(nstages={self.nstages}, nmicros={self.nmicros}, "
                f"ndevices={self.ndevices}, backward_cost={self.backward_cost})")


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
                        if all(dep in done for dep in self._deps(a)):
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


TRAINING_SCHEDULES = {c.name: c for c in (OneFOneB, OneFOneBPlus, Interleaved1F1B, GPipe, ChimeraDirect)}
INFERENCE_SCHEDULES = {c.name: c for c in (InferPipe,)}
SCHEDULES = {**TRAINING_SCHEDULES, **INFERENCE_SCHEDULES}


def get_schedule(name: str, nstages: int, nmicros: int, ndevices: Optional[int] = None, *,
                 training: Optional[bool] = None, backward_cost: int = 2) -> Schedule:
    """Build the schedule called ``name`` (a ``pipeline_scheduler`` value) and validate it.

    ``ndevices`` (``pp_size``) defaults to ``nstages``, except for ``1f1b_interleaved`` where it
    defaults to ``nstages // 2`` (two stages per device). ``training=True`` refuses inference
    schedules, ``training=False`` refuses training schedules, None accepts both.
    Raises ConfigError (a ValueError) naming the parameter and the rule it breaks.
    """
    if not isinstance(name, str) or name not in SCHEDULES:
        raise ConfigError(f"unknown pipeline_scheduler {name!r}; valid: training "
                          f"{sorted(TRAINING_SCHEDULES)}, inference {sorted(INFERENCE_SCHEDULES)}")
    if training is True and name in INFERENCE_SCHEDULES:
        raise ConfigError(f"pipeline_scheduler={name!r} is an inference schedule (forward only) but a training "
                          f"schedule is needed; use one of {sorted(TRAINING_SCHEDULES)}")
    if training is False and name in TRAINING_SCHEDULES:
        raise ConfigError(f"pipeline_scheduler={name!r} is a training schedule but inference has no backward; "
                          f"use one of {sorted(INFERENCE_SCHEDULES)}")
    _check_int("nstages (pipeline_nstages)", nstages)
    _check_int("nmicros (pipeline_nmicros)", nmicros)
    if ndevices is None and name == Interleaved1F1B.name:
        if nstages % 2:
            raise ConfigError(f"pipeline_scheduler='1f1b_interleaved' without ndevices (pp_size) puts 2 stages "
                              f"per device, so nstages (pipeline_nstages) must be even; got nstages={nstages}")
        ndevices = nstages // 2
    return SCHEDULES[name](nstages, nmicros, ndevices, backward_cost=backward_cost).validate()
