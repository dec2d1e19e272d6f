"""The base of every spec model: unknown keys are refused (`extra="forbid"`) and defaults are validated."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class SpecModel(BaseModel):
    """A section of the spec: pydantic v2 model with extra="forbid" (an unknown or misspelled key is an error, not
    ignored) and validate_default=True (defaults pass the same validators as given values)."""

    model_config = ConfigDict(extra="forbid", validate_default=True)
