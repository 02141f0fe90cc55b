"""Run a pipelined ParallelModule's micro-batches on its schedule.

The generated module of a pipelined plan has one method per stage it holds,
``_stage_{s}(acts, *forward args)``, returning the stage's outputs, and a ``PIPELINE``
(`nnscaler.ir.contracts.PipelineMeta`, identical on every rank) naming, per stage, the values it
receives and sends. The executor
walks this rank's action list of the schedule:

* ``F(s, m)``: receive the stage's inputs for micro-batch ``m`` (as leaves that require a
  gradient when the sender's tensor did), run ``_stage_s`` on sample ``m``, send each output to
  every stage that reads it;
* ``B(s, m)``: receive the gradients of the stage's outputs (summed over their consumers; the
  loss gets 1), run autograd on them, send the inputs' gradients back to their producers.

Receives follow each peer's send order (inbox.py), so the same code is right where messages
match in issue order (NCCL) as well as by tag (gloo). Sends are asynchronous; after every action
the sends that the schedule proves delivered (the peer has since sent this rank something it
sends only after receiving them) are released, the rest at the end of the step: a sent tensor is
held about as long as its micro-batch is in flight, not for the whole step.

The module's precision (`apply_precision`) is applied here, since its forward hooks never run:
samples cast to the input dtype, stage forwards under autocast, outputs fp32 in the mixed modes;
other forward hooks on the module are refused. `scale_fn` (train_step) turns the loss into what
backward seeds (loss scaling).

Gradients accumulate locally over the step (every backward runs with this module's reducers
paused, `PipelineGradSync.hold`; other modules' are left alone); at the end the module's reducers
synchronise once -- unless the caller is inside ``module.no_sync()`` or ``sync_grad_when(False)`` (accumulating over several ``train_step``
calls), in which case they stay local until a synchronising call. The forward's
outputs of every micro-batch are broadcast over the unit, so every rank returns the same list.
`last_timeline` keeps (action, start, end) in seconds of the last step, for measurements.
"""
from __future__ import annotations

import time
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from nnscaler.ir.contracts import PipelineMeta
from nnscaler.ir import map_tensors
from nnscaler.ir.schedules import Action

from .. import failures
from ..errors import NnScalerError
from ..gradients import scaled_loss
from ..precision.casting import autocast, cast_inputs, cast_outputs, get_precision, precision_hook_ids
from .finals import broadcast_finals
from .inbox import OrderedInbox, acks_between, sends_between
from .p2p import Mailbox, PeerFailure

__all__ = ["PipelineExecutor"]


class PipelineExecutor:
    """Executes train / inference steps of one pipelined ParallelModule on this rank."""

    def __init__(self, module):
        self.module = module
        meta: PipelineMeta = module.PIPELINE
        self.meta = meta
        self.nstages, self.nmicros = meta.nstages, meta.nmicros
        self.tp = meta.tp_size
        self.schedule = meta.schedule()
        grid = module.grid
        self.plan_device = grid.plan_device
        self.unit_start = grid.rank - grid.plan_device
        self.group_index, self.local = divmod(self.plan_device, self.tp)
        self.mailbox = Mailbox(grid.rank, module.device, post_ahead=_matches_by_tag())
        self.final = sorted(self._output_ids() & set(meta.producer))
        self.last_timeline: List[Tuple[str, float, float]] = []
        self._inboxes: Dict[bool, OrderedInbox] = {}
        # Activation accounting (off by default; costs a hook per saved tensor): the bytes autograd
        # keeps for backward, parameters excluded, counted per stage forward until its backward.
        self.track_activations = False
        self.live_activation_bytes = 0
        self.peak_activation_bytes = 0
        self._saved_bytes: Dict[Tuple[int, int], int] = {}
        self.precision = None  # the module's apply_precision config, read at every step
        self._broken = None  # why an earlier step failed (the pipeline cannot run again)
        self.inbox = None

    def _output_ids(self) -> set:
        ids = set()
        self.module._pipeline_output(_Recorder(ids))
        return ids

    # -- placement ----------------------------------------------------------------------------
    def rank_of(self, stage: int, micro: int) -> int:
        """The global rank that runs `stage` of `micro` at this rank's local index."""
        return self.device_rank(self.schedule.device_of(stage, micro))

    def device_rank(self, device: int) -> int:
        """The global rank of pipeline device `device` at this rank's local index."""
        return self.unit_start + device * self.tp + self.local

    def _tag(self, vid: int, stage: int, micro: int, backward: bool) -> int:
        return ((vid * self.nstages + stage) * self.nmicros + micro) * 2 + int(backward)

    def _inbox(self, training: bool) -> OrderedInbox:
        """Receives in each peer's send order (see inbox.py), for training or inference steps."""
        if training not in self._inboxes:
            me, sc, meta = self.group_index, self.schedule, self.meta
            rank = {g: self.device_rank(g) for g in range(sc.ndevices) if g != me}
            self._inboxes[training] = OrderedInbox(
                self.mailbox, {r: sends_between(sc, meta, g, me, training) for g, r in rank.items()},
                lambda msg: self._tag(msg[1], msg[2], msg[3], msg[0] == "B"),
                meta.is_int,
                acks={r: acks_between(sc, meta, me, g, training) for g, r in rank.items()})
        return self._inboxes[training]

    def _recv(self, src: int, msg) -> Any:
        if src == self.mailbox.rank:  # a stage on this rank: in memory
            tag = self._tag(msg[1], msg[2], msg[3], msg[0] == "B")
            return self.mailbox.recv_int(src, tag) if self.meta.is_int(msg[1]) else \
                self.mailbox.recv_tensor(src, tag)
        return self.inbox.recv(src, msg)

    # -- steps --------------------------------------------------------------------------------
    def run(self, samples: Sequence[Any], training: bool,
            scale_fn: Optional[Callable[[torch.Tensor], torch.Tensor]] = None) -> List[Any]:
        name = "train_step" if training else "infer_step"
        if not isinstance(samples, (list, tuple)) or len(samples) != self.nmicros:
            got = len(samples) if isinstance(samples, (list, tuple)) else type(samples).__name__
            raise NnScalerError(f"{type(self.module).__name__}.{name}: the pipeline runs pipeline_nmicros="
                                f"{self.nmicros} micro-batches per step; pass a list of {self.nmicros} samples "
                                f"(got {got})")
        actions = self.schedule.actions(self.group_index)
        if not training:
            actions = [a for a in actions if a.kind == "F"]
        elif not self.schedule.training:
            raise NnScalerError(f"{type(self.module).__name__}.train_step: pipeline_scheduler "
                                f"{self.meta.scheduler!r} runs forwards only; regenerate with a training schedule")
        if self._broken is not None:
            raise NnScalerError(f"{type(self.module).__name__}.{name}: an earlier step failed ({self._broken}); "
                                f"the pipeline's messages are out of step since, so it cannot run again: restart "
                                f"the job (every rank raised in that step)")
        self._check_step(samples, name)
        self.precision = get_precision(self.module)  # apply_precision may come after parallelize
        sync = training and not self.module.pipeline_grads.paused
        if training:
            self.module.pipeline_grads.unshare()
        self.inbox = self._inbox(training)
        self.inbox.reset()
        self.mailbox.new_step()
        self.live_activation_bytes = self.peak_activation_bytes = 0  # per step
        self.mailbox.peak_held_bytes = self.mailbox.held_bytes
        self._saved_bytes.clear()
        self._ins: Dict[Tuple[int, int], Dict[int, Any]] = {}
        self._outs: Dict[Tuple[int, int], Dict[int, Any]] = {}
        self._final: Dict[int, Dict[int, Any]] = {m: {} for m in range(self.nmicros)}
        timeline = []
        self.mailbox.sent_keys.clear()
        a = None
        try:
            with self.module.pipeline_grads.hold(), torch.set_grad_enabled(training):
                for i, a in enumerate(actions):
                    t0 = time.perf_counter()
                    for ahead in actions[i:i + POST_AHEAD]:
                        self.inbox.post([(self.rank_of(*src), msg) for src, msg in self._incoming(ahead)])
                    if a.kind == "F":
                        self._forward(a, samples[a.micro], training)
                    else:
                        self._backward(a, scale_fn)
                    self.mailbox.release(self.inbox.delivered)
                    timeline.append((str(a), t0, time.perf_counter()))
            self.mailbox.wait_sends()
        except PeerFailure as exc:  # another rank failed: pass it on, and fail this step too
            self._fail(training, a, str(exc), skip=exc.src)
            raise NnScalerError(f"{type(self.module).__name__}.{name}: {exc}") from None
        except BaseException as exc:  # this rank failed: tell the peers waiting for it, then raise
            self._fail(training, a, f"rank {self.mailbox.rank}: {type(exc).__name__}: {exc}")
            failures.report(exc, name)  # data-parallel peers in other units (runtime/failures/)
            raise
        finally:
            self._ins, self._outs = {}, {}
        self.last_timeline = timeline
        if sync:  # inside the user's sync_grad_when(False) the gradients stay local
            self.module.pipeline_grads.sync()
        outputs = []
        finals = self._broadcast_finals()
        for m in range(self.nmicros):
            out = self.module._pipeline_output(finals[m])
            if self.precision is not None:
                out = cast_outputs(out, self.precision)
            outputs.append(map_tensors(out, torch.Tensor.detach) if training else out)
        return outputs

    def _fail(self, training: bool, action, reason: str, skip: int = -1) -> None:
        """After a failure in the step: send every peer a poison in place of the next message it
        waits for from this rank (so it raises instead of waiting forever, and passes it on), and
        refuse later steps."""
        self._broken = reason
        stage, micro = (action.stage, action.micro) if action is not None else (-1, -1)
        me, sc = self.group_index, self.schedule
        for g in range(sc.ndevices):
            peer = self.device_rank(g)
            if g == me or peer == skip:
                continue
            for msg in sends_between(sc, self.meta, me, g, training):
                if (peer, msg) in self.mailbox.sent_keys:
                    continue
                kind, vid, t, m = msg
                needed = None if kind == "F" else self._grad_needed(vid, t, m)
                if needed is False:  # a gradient the peer does not wait for
                    continue
                self.mailbox.send_poison(peer, self._tag(vid, t, m, kind == "B"), self.meta.is_int(vid),
                                         stage, micro)
                if kind == "F" or needed:  # certainly the message the peer waits for next
                    break
        self.mailbox.abandon()
        if self.inbox is not None:
            self.inbox.arrived.clear()

    def _incoming(self, a: Action) -> List[Tuple[Tuple[int, int], Tuple[str, int, int, int]]]:
        """((stage, micro) of the sender, message) of what action `a` receives: a forward its
        stage's inputs, a backward the gradients of its outputs that need one."""
        meta, s, m = self.meta, a.stage, a.micro
        if a.kind == "F":
            return [((meta.producer[vid], m), ("F", vid, s, m)) for vid in meta.inputs[s]]
        return [((t, m), ("B", vid, t, m)) for vid in meta.outputs[s] for t in meta.consumers[vid]]

    def _grad_needed(self, vid: int, stage: int, micro: int):
        """Whether this rank sends the gradient of `vid` for (stage, micro): None when unknown."""
        leaf = self._ins.get((stage, micro), {}).get(vid)
        return None if not isinstance(leaf, torch.Tensor) else bool(leaf.requires_grad)

    def _check_step(self, samples: Sequence[Any], name: str) -> None:
        """What every rank refuses before the step's first message, so all fail together: forward
        hooks the pipeline would skip (apply_precision's are honoured), a mode the generated code
        cannot follow, samples the forward cannot take."""
        module = self.module
        ours = precision_hook_ids(module)
        hooks = [h for d in (module._forward_pre_hooks, module._forward_hooks) for i, h in d.items() if i not in ours]
        if hooks:
            names = ", ".join(getattr(h, "__qualname__", type(h).__name__) for h in hooks)
            raise NnScalerError(f"{type(module).__name__} is pipelined: its forward never runs as a whole, so the "
                                f"forward hooks registered on it ({names}) would not run; remove them: put that "
                                f"logic in the model's forward or read the outputs {name} returns (precision: "
                                f"apply_precision, which the pipeline honours)")
        module.check_mode()
        check = getattr(module, "_check_sample", None)
        for i, sample in enumerate(samples if check is not None else ()):
            args, kwargs = _as_call(sample)
            try:
                check(*args, **kwargs)
            except TypeError as exc:
                raise TypeError(f"{type(module).__name__}.{name}: sample {i}: "
                                f"{str(exc).replace('_check_sample()', 'forward()')}") from None

    def _forward(self, a: Action, sample: Any, training: bool) -> None:
        meta, s, m = self.meta, a.stage, a.micro
        ins = {}
        for vid in meta.inputs[s]:
            ins[vid] = self._recv(self.rank_of(meta.producer[vid], m), ("F", vid, s, m))
        args, kwargs = _as_call(sample)
        args, kwargs = self.module.to_device((args, kwargs))
        if self.precision is not None:
            args, kwargs = cast_inputs((args, kwargs), self.precision)
        stage_fn = getattr(self.module, f"_stage_{s}")
        try:
            # use_zero=3: gathered units saved as references and freed after the stage (zero3.py)
            with autocast(self.precision, self.module.device.type), self.module.rng_scope(), \
                    self.module._sharded_scope():
                if self.track_activations and training:
                    with _SavedBytes(self.module) as saved:
                        outs = stage_fn(tuple(ins[v] for v in meta.inputs[s]), *args, **kwargs)
                    self._saved_bytes[(s, m)] = saved.nbytes
                    self.live_activation_bytes += saved.nbytes
                    self.peak_activation_bytes = max(self.peak_activation_bytes, self.live_activation_bytes)
                else:
                    outs = stage_fn(tuple(ins[v] for v in meta.inputs[s]), *args, **kwargs)
        except Exception as exc:
            self.module.note_source(exc)
            raise
        outs = dict(zip(meta.outputs[s], outs))
        for vid, value in outs.items():
            for t in meta.consumers[vid]:
                dst, tag = self.rank_of(t, m), self._tag(vid, t, m, False)
                key = ("F", vid, t, m)
                if meta.is_int(vid):
                    self.mailbox.send_int(value, dst, tag, key)
                else:
                    self.mailbox.send_tensor(value, dst, tag, key)
                    # the consumer returns a gradient exactly when this tensor needs one
                    self.inbox.grad_expected[("B", vid, t, m)] = bool(value.requires_grad)
            if vid in self.final:
                self._final[m][vid] = value
        if training:
            self._ins[(s, m)] = ins
            self._outs[(s, m)] = outs

    def _backward(self, a: Action, scale_fn) -> None:
        meta, s, m = self.meta, a.stage, a.micro
        ins, outs = self._ins.pop((s, m)), self._outs.pop((s, m))
        tensors, grads = [], []
        for vid, out in outs.items():
            if not isinstance(out, torch.Tensor) or not out.requires_grad:
                continue
            grad = None
            for t in meta.consumers[vid]:
                g = self._recv(self.rank_of(t, m), ("B", vid, t, m))
                grad = g if grad is None else grad + g
            if vid == meta.loss:
                if scale_fn is None:
                    one = torch.ones_like(out)
                    grad = one if grad is None else grad + one
                else:  # backward of scale_fn(loss) seeds the loss's gradient
                    scaled = scaled_loss(out, scale_fn, type(self.module).__name__)
                    tensors.append(scaled)
                    grads.append(torch.ones_like(scaled))
            if grad is not None:
                tensors.append(out)
                grads.append(grad)
        if tensors:
            torch.autograd.backward(tensors, grads)
        self.live_activation_bytes -= self._saved_bytes.pop((s, m), 0)
        for vid, leaf in ins.items():
            if isinstance(leaf, torch.Tensor) and leaf.requires_grad:
                grad = leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)
                self.mailbox.send_tensor(grad, self.rank_of(meta.producer[vid], m), self._tag(vid, s, m, True),
                                         ("B", vid, s, m))

    # -- outputs ------------------------------------------------------------------------------
    def _broadcast_finals(self) -> List[Dict[int, Any]]:
        """Per micro-batch, the forward's output values, the same on every rank of the unit
        (finals.py: two broadcasts per source rank for the whole step)."""
        grid = self.module.grid
        if grid.plan_ngpus == 1 or not dist.is_initialized():
            return [{vid: self._final[m].get(vid) for vid in self.final} for m in range(self.nmicros)]
        items = [(m, vid, self.unit_start + self.schedule.device_of(self.meta.producer[vid], m) * self.tp,
                  self.meta.is_int(vid)) for m in range(self.nmicros) for vid in self.final]
        got = broadcast_finals(items, lambda m, vid: self._final[m][vid], grid.rank, grid.unit_group,
                               self.module.device)
        return [{vid: got[(m, vid)] for vid in self.final} for m in range(self.nmicros)]


class _SavedBytes:
    """Counts the distinct storages autograd saves for backward inside the block, parameters
    (and views of them) excluded: the activation memory one stage forward keeps alive."""

    def __init__(self, module):
        self.params = {p.untyped_storage().data_ptr() for p in module.parameters()}
        self.storages: Dict[int, int] = {}
        self._ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in self.params:
            self.storages[ptr] = storage.nbytes()
        return t

    @property
    def nbytes(self) -> int:
        return sum(self.storages.values())

    def __enter__(self):
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc):
        return self._ctx.__exit__(*exc)


class _Recorder(dict):
    """A `_vals` stand-in that records which value ids `_pipeline_output` reads."""

    def __init__(self, ids: set):
        super().__init__()
        self.ids = ids

    def __getitem__(self, key):
        self.ids.add(key)
        return None


POST_AHEAD = 2  # receives are posted for this many actions: the running one and the next


def _matches_by_tag() -> bool:
    """Whether the backend matches messages by tag (gloo), so receives may be posted ahead;
    NCCL matches in issue order."""
    return dist.is_initialized() and dist.get_backend() == "gloo"




def _as_call(sample: Any) -> Tuple[tuple, dict]:
    if isinstance(sample, Mapping):
        return (), dict(sample)
    if isinstance(sample, tuple):
        return sample, {}
    return (sample,), {}

