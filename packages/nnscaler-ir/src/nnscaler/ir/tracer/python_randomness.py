"""Python-level randomness and clock reads in forward: refused (training) or warned about (eval).

The trace records one run of the forward, so a number the forward draws from Python's ``random``,
``numpy.random`` or reads from the clock (``time.time()``, ``datetime.now()``) is fixed at trace
time: stochastic depth written ``if self.training and random.random() < 0.5:`` takes the same
branch on every step of the generated program. Torch's random ops are ops of the program (they
draw from the module's random streams at every step); these are not.

While the forward is traced, `watch_python_randomness` swaps those functions, in their modules
and in the globals of the model's own modules (``from random import random``), for wrappers that
look at their caller: a call from the user's code (not nnscaler, torch or the standard library)
raises `TraceError` in training mode, naming the user's line and the fix (draw from torch:
``torch.rand(()) < p``), and warns (`TracingWarning`) in eval mode, where a value drawn and not
used (a layer-drop probability read before ``if not self.training or ...``) is harmless. Every
function is put back when the trace ends, also when it raises.

Not seen: a ``numpy.random.Generator`` or ``random.Random`` instance the model keeps (their
methods cannot be swapped), and modules imported under another name than the model's.
"""
from __future__ import annotations

import contextlib
import datetime as _datetime
import functools
import random as _random
import sys
import threading
import time as _time
import warnings
from typing import Callable, Dict, List, Tuple

import numpy.random as _npr
import torch

from ..errors import TraceError, TracingWarning
from .guards import _loc, _ours

_RANDOM_NAMES = ("random", "uniform", "randint", "randrange", "choice", "choices", "sample", "shuffle", "gauss",
                 "normalvariate", "lognormvariate", "expovariate", "vonmisesvariate", "gammavariate",
                 "betavariate", "paretovariate", "weibullvariate", "triangular", "getrandbits", "randbytes",
                 "binomialvariate")
_NUMPY_SKIP = {"seed", "get_state", "set_state", "Generator", "RandomState", "SeedSequence", "MT19937", "Philox", "PCG64",
               "PCG64DXSM", "SFC64", "BitGenerator"}
_CLOCK_NAMES = ("time", "time_ns", "perf_counter", "perf_counter_ns", "monotonic", "monotonic_ns",
                "process_time", "process_time_ns")

RANDOM_FIX = ("draw from torch's generator instead, e.g. `torch.rand(()) < p` for a probability, "
              "`torch.randint(...)`, `torch.randn(...)`: torch's random ops are part of the program and draw from "
              "nnscaler's random streams on every step (see docs/tracing.md, Random numbers)")
CLOCK_FIX = ("read the clock outside forward (time the call of the module instead), or pass the value in as a "
             "tensor argument of forward")


def _targets() -> List[Tuple[object, str, str, str]]:
    """(owner, attribute, text shown, kind) of every function watched."""
    out = [(_random, n, f"random.{n}()", "random") for n in _RANDOM_NAMES if hasattr(_random, n)]
    out += [(_time, n, f"time.{n}()", "clock") for n in _CLOCK_NAMES if hasattr(_time, n)]
    out += [(_npr, n, f"numpy.random.{n}()", "random") for n in _npr.__all__
            if n not in _NUMPY_SKIP and callable(getattr(_npr, n, None))]
    return out


def _message(what: str, kind: str, where: str, training: bool) -> str:
    if kind == "random":
        head = f"forward draws a Python random number ({what}) at {where}"
        effect = ("the generated program runs the ops of one traced run, so the number drawn while tracing "
                  "would be a constant of the program: every step would take the same branch (or use the same "
                  "value)")
        fix = RANDOM_FIX
    else:
        head = f"forward reads the clock ({what}) at {where}"
        effect = ("the generated program runs the ops of one traced run, so the time read while tracing would be "
                  "a constant of the program, and Python code between the ops (timing, logging) does not run in it")
        fix = CLOCK_FIX
    if training:
        return f"{head}: {effect}. Fix: {fix}"
    return (f"{head} (in eval mode): {effect}; if forward uses the value, {fix}. "
            f"In training mode this is refused")


class _Watch:
    def __init__(self, training: bool):
        self.training = training
        self.warned = set()
        self.thread = threading.get_ident()

    def hit(self, what: str, kind: str) -> None:
        if threading.get_ident() != self.thread:
            return  # another thread of the program (a data loader): not the forward being traced
        frame = sys._getframe(2)  # the caller of the watched function
        if _ours(frame.f_code.co_filename):
            return  # torch, nnscaler or the standard library drawing for itself
        loc = _loc(frame)
        where = f"{loc.file}:{loc.line}" + (f" in {loc.function}" if loc.function else "")
        message = _message(what, kind, where + (f" (`{loc.code}`)" if loc.code else ""), self.training)
        if self.training:
            raise TraceError(message)
        if (loc.file, loc.line) not in self.warned:
            self.warned.add((loc.file, loc.line))
            warnings.warn_explicit(message, TracingWarning, loc.file, loc.line)

    def wrap(self, fn: Callable, what: str, kind: str) -> Callable:
        seeded = what == "numpy.random.default_rng()"  # default_rng(seed) is deterministic: fine to bake

        @functools.wraps(fn)
        def watched(*args, **kwargs):
            seed = args[0] if args else kwargs.get("seed")
            if not (seeded and seed is not None):
                self.hit(what, kind)
            return fn(*args, **kwargs)
        watched.__nnscaler_watched__ = fn
        return watched

    def wrap_datetime(self, cls):
        hit = self.hit

        class _Meta(type):  # datetimes made before the swap are still instances of datetime.datetime
            def __instancecheck__(klass, obj):
                return isinstance(obj, cls)

            def __subclasscheck__(klass, sub):
                return issubclass(sub, cls)

        class datetime(cls, metaclass=_Meta):  # noqa: N801  (shown as datetime.datetime)
            @classmethod
            def now(klass, tz=None):
                hit("datetime.now()", "clock")
                return cls.now(tz)

            @classmethod
            def utcnow(klass):
                hit("datetime.utcnow()", "clock")
                return cls.utcnow()

            @classmethod
            def today(klass):
                hit("datetime.today()", "clock")
                return cls.today()

        datetime.__qualname__ = cls.__qualname__
        datetime.__module__ = cls.__module__
        return datetime


@contextlib.contextmanager
def watch_python_randomness(module: torch.nn.Module):
    """While the block runs, calls of Python's random, numpy.random and clock functions from the
    user's code raise TraceError (module in training mode) or warn (eval mode). See module docstring."""
    watch = _Watch(module.training)
    swaps: Dict[Tuple[int, str], Tuple[dict, str, object]] = {}
    replaced: Dict[int, object] = {}  # id(original) -> wrapper

    def swap(namespace: dict, name: str, new) -> None:
        key = (id(namespace), name)
        if key not in swaps:
            swaps[key] = (namespace, name, namespace[name])
            namespace[name] = new

    for owner, name, what, kind in _targets():
        original = owner.__dict__.get(name)
        if original is None or hasattr(original, "__nnscaler_watched__"):
            continue
        replaced[id(original)] = watch.wrap(original, what, kind)
        swap(owner.__dict__, name, replaced[id(original)])
    original_dt = _datetime.__dict__["datetime"]
    replaced[id(original_dt)] = watch.wrap_datetime(original_dt)
    swap(_datetime.__dict__, "datetime", replaced[id(original_dt)])
    for name in {type(m).__module__ for m in module.modules()}:
        user_module = sys.modules.get(name)
        if user_module is None or _ours(getattr(user_module, "__file__", None) or "<>"):
            continue
        namespace = user_module.__dict__
        for attr, value in list(namespace.items()):
            if id(value) in replaced:
                swap(namespace, attr, replaced[id(value)])
    try:
        yield
    finally:
        for namespace, name, original in swaps.values():
            namespace[name] = original
