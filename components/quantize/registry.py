"""The builder registry: one build backend per stable name.

Every builder (a function that builds one variant: quantize, compile) is registered under a stable name
(`quantize.onnxruntime`, `compile.tensorrt`, `compile.torch`). "Step" is kept for pipeline steps (KFP tasks).
A duplicate name raises; an unknown name raises with the list of known names. Builders return a
`BuildResult` with a status (ok / failed / skipped, with the reason): a variant that cannot be built on
this node (TensorRT without a GPU) is skipped visibly, never dropped.
"""

from __future__ import annotations

import importlib
from typing import Callable

from tailguard.core.errors import TailguardError
from tailguard.core.results import BuildResult

# Modules whose import registers builders; `load_all()` imports them so the registry is complete.
BUILDER_MODULES = (
    "tailguard.components.quantize.onnxruntime_builder",
    "tailguard.components.quantize.tensorrt_build",
    "tailguard.components.quantize.torch_builder",
)

_REGISTRY: dict[str, Callable[..., "BuildResult"]] = {}


class UnknownBuilderError(TailguardError):
    """No builder is registered under that name."""


def register_builder(name: str) -> Callable[[Callable[..., BuildResult]], Callable[..., BuildResult]]:
    """Decorator: register `fn` under `name` (e.g. "quantize.onnxruntime").

    Raises:
        ValueError: the name is already registered.
    """

    def deco(fn: Callable[..., BuildResult]) -> Callable[..., BuildResult]:
        if name in _REGISTRY and _REGISTRY[name] is not fn:
            raise ValueError(f"builder {name!r} is already registered by {_REGISTRY[name].__module__}")
        _REGISTRY[name] = fn
        return fn

    return deco


def load_all() -> None:
    """Import every module in BUILDER_MODULES so that every builder is registered."""
    for mod in BUILDER_MODULES:
        importlib.import_module(mod)


def get_builder(name: str) -> Callable[..., BuildResult]:
    """The builder registered under `name`.

    Raises:
        UnknownBuilderError: with the list of known names.
    """
    load_all()
    try:
        return _REGISTRY[name]
    except KeyError:
        raise UnknownBuilderError(f"unknown builder {name!r}; known: {sorted(_REGISTRY)}") from None


def registered_builders() -> list[str]:
    """Names of all registered builders (after importing every builder module)."""
    load_all()
    return sorted(_REGISTRY)
