"""What a re-decide may and may not do: decide the new gates on stored measurements only, never measure.

The validate step's `validate_variant` replays its stopping rules on a variant's stored outputs and timing rounds
(`validate.measurements.Measurements`) and asks its runners for more only when the gates need rows or rounds beyond
them. The re-decide task hands it runners that refuse every call (`StoredOnly`): a new gate that the stored rows or
rounds cannot decide raises `NotDecidable` instead of being guessed, and the local runner then runs the whole
pipeline (tailguard.rerun). So a re-decided verdict is the one the validate step computes on the same measurements,
or there is none.
"""

from __future__ import annotations

from typing import Any

# Metrics measured on the validating process itself, not stored with the measurements: a gate on one cannot be
# decided again without running the variant in a fresh validation.
PROCESS_METRICS = ("peak_rss_mb",)


class NotDecidable(Exception):
    """The new gates cannot be decided on the stored measurements alone (the reason says what is missing): the
    run falls back to the whole pipeline."""


class StoredOnly:
    """A runner that must never run: every call says what would have had to be measured again (`NotDecidable`).

    Args:
        what: the runner's role, for the reason ("the variant", "the FP32 baseline", "the exact-accumulation
            pass").
    """

    def __init__(self, what: str) -> None:
        self._what = what

    def run(self, *args: Any, **kwargs: Any) -> Any:
        """Raises NotDecidable: a re-decide measures nothing."""
        raise NotDecidable(f"the new gates need {self._what} run on rows or timed in rounds that the earlier "
                           "run did not measure")

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        raise NotDecidable(f"the new gates need {self._what} loaded ({name})")


def spec_reasons(spec: Any) -> str | None:
    """Why a spec's runs cannot be re-decided in one task at all, or None.

    A spec with `serving_targets` (one validation per target and node pool), with a variant that has a `search`
    (whether the search runs and which trial it picks depend on the gates: its trials would be judged again), both
    declared in `tailguard.core.spec.reads.NOT_REPLAYABLE`, or with a gate on a metric of the validating process
    (`PROCESS_METRICS`) runs the whole pipeline.
    """
    from tailguard.core.spec.reads import not_replayable

    why = not_replayable(spec.model_dump(mode="json"))
    if why:
        return why
    process = sorted({g.metric for g in spec.gates if g.metric in PROCESS_METRICS})
    if process:
        return f"a gate on {process[0]}, which is measured on the validating process and not stored"
    return None
