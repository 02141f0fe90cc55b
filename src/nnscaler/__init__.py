"""nnscaler: make single-device PyTorch training run on many processes.

The user API is re-exported lazily so that ``import nnscaler`` (and ``nnscaler --help``) never
imports torch by itself::

    from nnscaler import parallelize, ComputeConfig, ReuseType, build_optimizer, register_op
"""
from pkgutil import extend_path

# The parts (nnscaler-ir, nnscaler-runtime, ...) are separate distributions that each ship a
# sub-package of ``nnscaler``; extend the path so they resolve under this package too.
__path__ = extend_path(__path__, __name__)

__version__ = "0.1.0"

_EXPORTS = {
    "ComputeConfig": "nnscaler.ir",
    "OptionalComputeConfig": "nnscaler.ir",
    "register_op": "nnscaler.ir",
    "routed_experts": "nnscaler.ir",
    "trace": "nnscaler.ir",
    "NnScalerError": "nnscaler.ir",
    "NnScalerWarning": "nnscaler.ir",
    "ReuseType": "nnscaler.runtime",
    "parallelize": "nnscaler.runtime",
    "build_optimizer": "nnscaler.runtime",
    "ParallelModule": "nnscaler.runtime",
    "sync_grad_when": "nnscaler.runtime",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'nnscaler' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
