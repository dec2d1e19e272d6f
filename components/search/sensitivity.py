"""Old import path of tailguard.components.quantize.sensitivity (sensitivity sits behind quantize's public API), kept for users: the same module object."""

import sys

from tailguard.components.quantize import sensitivity as _m

sys.modules[__name__] = _m
