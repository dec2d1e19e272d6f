"""tailguard: quantize/compile models, prove each variant against its FP32 reference per slice, promote in MLflow.

The import package `tailguard` is the repository's pipelines/ folder (spec, builder, CLI);
`tailguard.components` (components/) holds the pipeline steps and `tailguard.monitoring` (monitoring/)
the shadow-traffic monitor.
"""

__version__ = "0.1.0"
