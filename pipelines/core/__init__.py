"""tailguard.core: the kernel, what two or more units share (components, the monitor, the application).

The spec (the `spec` package: loading and checking in its `__init__`, the models one module per section, the root
`Spec` in `spec.root`; its quantization `presets`), the error family (`errors`), data loading (`data`), the runners
and the torch backend (`runtime`, `torch_backend`), MLflow access (`tracking`), task I/O (`taskio`, `home`), the
local cache (`cache`), the constants and tag names that cross units (`contract`), the typed results between steps
(`results`), artifact checks (`artifacts`), the reference model's reader (`reference`), node facts (`hardware`), URI
redaction (`redact`), parity, slices and latency (`parity`, `slices`, `latency`), the reports' shared building
blocks (`report`), the metric catalogue (`metrics`) and statistics (`stats`). It imports no component, no monitor
and no application module; each module has two or more importing units (tests/integration/test_layout.py keeps both
so; docs/architecture.md, Layers).
"""
