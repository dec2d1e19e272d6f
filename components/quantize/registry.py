"""Step registry and step results.

Every build/compile step is registered under a stable name (`quantize.onnxruntime`, `compile.tensorrt`, ...).
A duplicate name raises; an unknown name raises with the list of known names. Steps return a
`StepResult` with a status (ok / failed / skipped, with the reason): a variant that cannot be built on
this node (TensorRT without a GPU) is skipped visibly, never dropped.
"""

from __future__ import annotations

import importlib
from typing import Callable

from tailguard.core.errors import TailguardError
from tailguard.core.results import StepResult

# Modules whose import registers steps; `load_all()` imports them so the registry is complete.
STEP_MODULES = (
    "tailguard.components.quantize.logic",
    "tailguard.components.quantize.torch_step",
)

_REGISTRY: dict[str, Callable[..., "StepResult"]] = {}


class UnknownStepError(TailguardError):
    """No step is registered under that name."""


def register_step(name: str) -> Callable[[Callable[..., StepResult]], Callable[..., StepResult]]:
    """Decorator: register `fn` under `name` (e.g. "quantize.onnxruntime").

    Raises:
        ValueError: the name is already registered.
    """

    def deco(fn: Callable[..., StepResult]) -> Callable[..., StepResult]:
        if name in _REGISTRY and _REGISTRY[name] is not fn:
            raise ValueError(f"step {name!r} is already registered by {_REGISTRY[name].__module__}")
        _REGISTRY[name] = fn
        return fn

    return deco


def load_all() -> None:
    """Import every module in STEP_MODULES so that all steps are registered."""
    for mod in STEP_MODULES:
        importlib.import_module(mod)


def get_step(name: str) -> Callable[..., StepResult]:
    """The step registered under `name`.

    Raises:
        UnknownStepError: with the list of known names.
    """
    load_all()
    try:
        return _REGISTRY[name]
    except KeyError:
        raise UnknownStepError(f"unknown step {name!r}; known: {sorted(_REGISTRY)}") from None


def registered_steps() -> list[str]:
    """Names of all registered steps (after importing every step module)."""
    load_all()
    return sorted(_REGISTRY)
