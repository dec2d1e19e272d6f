"""tailguard.core: the kernel every other unit imports (spec, errors, data, runtime, tracking, taskio, home, the
step registry, the cache, the contract constants); it imports no component, no monitor and no application module
(tests/test_layout.py keeps it so; docs/architecture.md, Layers)."""
