"""Old import path of tailguard.core.runtime, kept for users: the same module object (see docs/architecture.md, Layers)."""

import sys

from tailguard.core import runtime as _m

sys.modules[__name__] = _m
