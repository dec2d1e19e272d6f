"""Default container images of the components (overridden per spec by `tailguard compile`).

Built from manifests/images/ (Dockerfiles). Kept in a stdlib-only module: component.py files import it at
module level, and KFP component modules may import only the standard library and kfp there.
"""

CPU_IMAGE = "ghcr.io/tailguard/tailguard:0.1.0"
