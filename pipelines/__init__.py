"""tailguard: quantize/compile models, prove each variant against its FP32 reference per slice, promote in MLflow.

The import package `tailguard` is the repository's pipelines/ folder (spec, pipeline, CLI);
`tailguard.components` (components/) holds the pipeline steps and `tailguard.monitoring` (monitoring/)
the shadow-traffic monitor.
"""

__version__ = "0.1.0"

__all__ = ["RegisteredModel", "register_model", "register_reference"]

# The public API, imported on first use (PEP 562) so that `import tailguard` stays light for KFP tasks.
_LAZY = {"register_model": "tailguard.registration", "RegisteredModel": "tailguard.registration",
         "register_reference": "tailguard.registration"}


def __getattr__(name: str):
    """`tailguard.register_model` (a model file -> a registry version, see tailguard.registration),
    `tailguard.RegisteredModel` and `tailguard.register_reference` (in-memory models; same module)."""
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'tailguard' has no attribute {name!r}")
