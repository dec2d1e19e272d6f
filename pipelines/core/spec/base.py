"""The base of every spec model (unknown keys are refused, `extra="forbid"`, and defaults are validated) and what
several sections share: the name pattern (`NAME_RE`) and the size limits of one spec."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class SpecModel(BaseModel):
    """A section of the spec: pydantic v2 model with extra="forbid" (an unknown or misspelled key is an error, not
    ignored) and validate_default=True (defaults pass the same validators as given values)."""

    model_config = ConfigDict(extra="forbid", validate_default=True)


NAME_RE = r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$"  # DNS-1123 label: usable as a KFP task name and a K8s name
# Size limits (issue 22): each variant is a chain of KFP tasks (pods, and nodes in one Argo Workflow object, which
# etcd caps at ~1.5 MB), each slice group x parity metric an MLflow metric and a report row, each gate a check per
# variant. These bound one run's pods, metrics and report; a spec past one is refused (exit 2, naming the field).
MAX_VARIANTS = 32
MAX_SLICES = 32
MAX_SLICE_GROUPS = 1000  # slices[].max_groups
MAX_SLICE_NAME = 64  # characters; with it every slice metric key fits MLflow's 250 (validate.result.slice_key_prefix)
MAX_GATES = 128
