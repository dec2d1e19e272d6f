"""The builder registry: one builder per spec backend, each in its own module under builders/.

A builder builds one variant of one backend (the spec's `VariantSpec.backend` literal: onnxruntime, tensorrt,
torch) and returns a `BuildResult` with a status (ok / failed / skipped, with the reason): a variant that cannot be
built on this node (TensorRT without a GPU) is skipped visibly, never dropped. Builder `<backend>` lives in
`builders/<backend>.py` and registers itself there, `@register_builder("<backend>", source=...)`; the registry finds
the modules by listing the builders package, so a new backend is one module plus its spec literal
(docs/builders.md; tests/components/test_builders.py checks that the literals and the builders agree).

Dispatch goes through the registered entry, as Evidently's stattests registry does (`get_stattest` returns the
`StatTest` whose function is then called): `get_builder(backend)` returns a `Builder`, which says what it builds
from (`source`) and holds the function to call (`build`). A second registration of a backend raises; an unknown
backend raises with the list of known ones.
"""

from __future__ import annotations

import importlib
import importlib.util
import pkgutil
from dataclasses import dataclass
from typing import Callable, Literal

from tailguard.core.errors import TailguardError
from tailguard.core.results import BuildResult

# The package whose modules are the builders, one per backend, named after it (imported by name, on demand).
BUILDERS_PACKAGE = "tailguard.components.build.builders"

# What a builder builds from: "onnx", the checked FP32 ONNX export (the build-<variant> task's `main`, through
# `logic.build_variant`); "torch", the registered FP32 torch reference (the task's `torch_main`).
Source = Literal["onnx", "torch"]
SOURCES: tuple[str, ...] = ("onnx", "torch")


class UnknownBuilderError(TailguardError):
    """No builder is registered for that backend."""


@dataclass(frozen=True)
class Builder:
    """One registered builder.

    Attributes:
        backend: the spec's backend literal it builds (`VariantSpec.backend`), e.g. "onnxruntime".
        source: what it builds from, "onnx" (the FP32 ONNX export; called as
            `build(variant, fp32_onnx, out_dir, *, calibration, model, calibration_batch_size, profile)`) or
            "torch" (the registered torch reference; called as `build(variant, load_module, out_dir, *, calibration,
            model, source_sha256, reference_format)`).
        build: the function; returns a `BuildResult`.
    """

    backend: str
    source: Source
    build: Callable[..., BuildResult]

    @property
    def module(self) -> str:
        """The module that defines the builder, `<BUILDERS_PACKAGE>.<backend>`."""
        return self.build.__module__


_REGISTRY: dict[str, Builder] = {}


def register_builder(backend: str, *, source: Source = "onnx") -> Callable[[Callable[..., BuildResult]],
                                                                           Callable[..., BuildResult]]:
    """Decorator: register `fn` as the builder of spec backend `backend`, built from `source`.

    Args:
        backend: the `VariantSpec.backend` literal; the decorated function must live in `builders/<backend>.py`.
        source: "onnx" or "torch" (`Builder.source`).

    Raises:
        ValueError: the backend is already registered by another function, the function is not defined in
            `builders/<backend>.py` (one module per builder), or `source` is not one of `SOURCES`.
    """
    if source not in SOURCES:
        raise ValueError(f"builder {backend!r}: source {source!r} is not one of {list(SOURCES)}")

    def deco(fn: Callable[..., BuildResult]) -> Callable[..., BuildResult]:
        expected = f"{BUILDERS_PACKAGE}.{backend}"
        if fn.__module__ != expected:
            raise ValueError(f"builder {backend!r} is defined in {fn.__module__}; a builder lives in its own module, "
                             f"{expected} (components/build/builders/{backend}.py)")
        known = _REGISTRY.get(backend)
        if known is not None and known.build is not fn:
            raise ValueError(f"builder {backend!r} is already registered by {known.module}.{known.build.__name__}")
        _REGISTRY[backend] = Builder(backend=backend, source=source, build=fn)
        return fn

    return deco


def builder_modules() -> list[str]:
    """The backends that have a module in the builders package (`builders/<backend>.py`), sorted; nothing is
    imported."""
    spec = importlib.util.find_spec(BUILDERS_PACKAGE)
    paths = list(spec.submodule_search_locations or []) if spec is not None else []
    return sorted(m.name for m in pkgutil.iter_modules(paths) if not m.name.startswith("_"))


def get_builder(backend: str) -> Builder:
    """The registered builder of `backend`, importing its module (only that one) on first use.

    Raises:
        UnknownBuilderError: no module `builders/<backend>.py`, or that module registers no builder for
            `backend`; the message lists the known backends.
    """
    if backend not in _REGISTRY and backend in builder_modules():
        importlib.import_module(f"{BUILDERS_PACKAGE}.{backend}")
    try:
        return _REGISTRY[backend]
    except KeyError:
        raise UnknownBuilderError(f"no builder for backend {backend!r}; known: {builder_modules()} "
                                  "(components/build/builders/<backend>.py, docs/builders.md)") from None


def registered_builders() -> list[str]:
    """The backends with a registered builder, after importing every module of the builders package."""
    for backend in builder_modules():
        importlib.import_module(f"{BUILDERS_PACKAGE}.{backend}")
    return sorted(_REGISTRY)
