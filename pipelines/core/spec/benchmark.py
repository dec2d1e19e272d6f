"""The spec's `benchmark` (latency measurement on the validating node) and `cost` (the node's price) sections."""

from __future__ import annotations

from pydantic import Field

from tailguard.core.spec.base import SpecModel


class BenchmarkSpec(SpecModel):
    """Latency measurement on this node: warm-up, then timed iterations per batch size."""

    batch_sizes: list[int] = Field(default_factory=lambda: [1, 32], min_length=1,
                                   description="Batch sizes to time.")
    warmup: int = Field(20, ge=0, description="Untimed iterations first.")
    iterations: int = Field(200, ge=1, description="Timed iterations per batch size.")
    max_seconds: float = Field(30.0, gt=0, description="Stop timing a batch size after this long (s).")
    precision: float | None = Field(None, gt=0, lt=1, description=(
        "Stop timing a batch size once the interval on the speed ratio against its interleaved baseline has at "
        "most this relative half-width (e.g. 0.03) and every speed gate with a confidence at that batch size is "
        "decided; bounds are Bonferroni-corrected over the looks (docs/spec.md, Latency measured to a precision). "
        "None: time every iteration up to max_seconds."))
    intra_op_num_threads: int = Field(0, ge=0, description="ORT/torch threads (0: all cores).")
    seed: int = Field(0, description="Seed for drawing the benchmark batches from the validation set.")


class CostSpec(SpecModel):
    """Price of the serving node, for cost per 1M inferences = usd_per_hour / 3600 / throughput * 1e6."""

    usd_per_hour: float = Field(gt=0, description="On-demand price of the node (USD/hour).")
    instance: str | None = Field(None, description="Node type the price is for, for the report.")
