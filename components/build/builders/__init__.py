"""The builders, one module per spec backend (`VariantSpec.backend`): `onnxruntime.py`, `tensorrt.py`, `torch.py`.

Each module registers its builder under its own name (`tailguard.components.build.registry.register_builder`);
the registry imports a module by name when its backend is first asked for. docs/builders.md shows how a new
backend lands.
"""
