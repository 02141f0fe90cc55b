"""Precision: per tensor type dtypes, mixed precision (autocast), fp32 master weights, loss scaling.

Four pieces, usable alone or together (``PrecisionPlugin`` strings them together for the Trainer
and the Lightning strategy):

``parse_precision(value) -> PrecisionConfig``
    The ``precision`` setting of the Trainer (``Union[str, Dict[str, str], None]``) and the five
    Lightning precision names:

    ===============  ======  ======  ======  =========  =========  ===========
    value            param   buffer  input   mixed      compute    grad scaler
    ===============  ======  ======  ======  =========  =========  ===========
    None / 'none'    --      --      --      no         --         no
    'fp32'           fp32    fp32    fp32    no         fp32       no
    'bf16'           bf16    bf16    bf16    no         bf16       no
    'fp16'           fp16    fp16    fp16    no         fp16       yes
    '32-true'        fp32    fp32    fp32    no         fp32       no
    'bf16-true'      bf16    bf16    bf16    no         bf16       no
    '16-true'        fp16    fp16    fp16    no         fp16       yes
    'bf16-mixed'     fp32    fp32    --      yes        bf16       no
    '16-mixed'       fp32    fp32    --      yes        fp16       yes
    ===============  ======  ======  ======  =========  =========  ===========

    A dict ``{'param': 'bf16', 'buffer': 'fp32', 'input': 'none'}`` sets each tensor type (a
    missing key is 'none': no conversion); the grad scaler is on when params are fp16.
    '--' (None) means "leave the tensor as it is". ``dataclasses.replace(cfg, grad_scaler=False)``
    changes a derived field.

``apply_precision(module, config)``
    Casts the floating parameters and buffers of a module (a ParallelModule or any nn.Module) in
    place -- the Parameter objects stay the same, so a Reducer or an optimizer that already holds
    them keeps working -- and installs a forward pre-hook that casts floating tensor inputs
    (nested in tuples, lists and dicts; positional and keyword) to the input dtype. In mixed mode
    the forward runs inside ``torch.autocast(device_type, dtype=compute_dtype)`` (entered by a
    forward pre-hook, left by an always-called forward hook) and its floating fp16/bf16 outputs
    are returned as fp32 (as Lightning does), so the loss is fp32. The hooks are picklable, so
    the module can still be deep-copied or saved whole.

``with_master_weights(optimizer)``
    Makes an optimizer over fp16/bf16 parameters step on fp32 master copies: the inner
    optimizer's ``param_groups`` hold the masters (so its state is fp32, and LR schedulers, which
    edit ``param_groups``, work unchanged); at ``step()`` the low-precision gradients are upcast
    into the masters, the inner step runs, and the masters are copied back (rounded to nearest)
    into the model's parameters. fp32 parameters are left as they are (nothing to do in mixed
    mode). The masters are saved in ``state_dict()['master_weights']``.

``GradScaler``
    ``torch.amp.GradScaler`` that (1) copies gradients into the master weights before unscaling,
    (2) unscales fp16 gradients too (pure fp16 training without masters), (3) all-reduces the
    inf/nan flag over the ranks, so every rank skips the same steps (with tensor parallelism the
    shards differ; a rank that saw no inf would otherwise step alone). The plain loop is::

        loss = pm(**batch)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)            # only when clipping: unscale BEFORE clipping
        opt.clip_gnorm(max_norm)
        scaler.step(opt)                # skipped when a gradient is inf/nan on any rank
        scaler.update()
        opt.zero_grad()

    With ``train_step`` (end2end, pipelined or not) pass the scaling in:
    ``pm.train_step(samples, scale_fn=scaler.scale)``. A pipeline stage that never computes the
    loss still unscales: the scaler creates its scale on first use there.

    Gradients must be unscaled before they are clipped (or their norm is read): a clip threshold
    applies to true gradients, and the scaled ones are ``scale`` times larger.
    ``PrecisionPlugin.clip_gnorm`` does this.

CPU: bf16 (true and mixed) and, with torch 2.13, fp16 too (forward/backward kernels of the usual
ops, fp16 autocast, GradScaler('cpu')) run on the CPU; see tests/runtime/test_precision.py.

Order: ``pm = parallelize(...)``; ``apply_precision(pm, cfg)``; ``opt = build_optimizer(pm, ...)``;
``opt = with_master_weights(opt)``; schedulers (``with_master_weights`` also works after a
scheduler was created). Gradient accumulation over micro-batches happens in the parameters'
dtype (bf16/fp16 in the ``-true`` modes); masters receive the accumulated gradient once per step.
"""

from .settings import PrecisionConfig, parse_precision, TENSOR_TYPES, PRECISIONS, LIGHTNING_PRECISIONS
from .casting import apply_precision, remove_precision, get_precision, cast_module, cast_inputs, cast_outputs, autocast
from .master import MixedPrecisionOptimizer, with_master_weights
from .scaler import GradScaler, PrecisionPlugin

__all__ = ["PrecisionConfig", "parse_precision", "apply_precision", "remove_precision", "get_precision", "cast_module", "cast_inputs", "cast_outputs", "autocast", "MixedPrecisionOptimizer", "with_master_weights", "GradScaler", "PrecisionPlugin", "TENSOR_TYPES", "PRECISIONS", "LIGHTNING_PRECISIONS"]
