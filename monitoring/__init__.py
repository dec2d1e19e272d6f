"""The shadow-traffic monitor: compares the promoted variant with its FP32 reference on sampled live requests,
per slice (docs/monitor.md).

Modules: `config` (the spec's monitoring section resolved, slice rules), `sampler` (long-tail sampling with
weights), `stats` (per-slice windows, tests, false-alarm control, alert records), `compare` (per-row parity via
tailguard.core.parity), `core` (the engine shared by service and replay), `oip` (Open Inference
Protocol bodies), `metrics` (Prometheus, METRIC_NAMES), `sink` (S3 Parquet + spool), `drift` (Evidently),
`service` (FastAPI app, `serve`), `replay` (`replay_cli`), `demo` (`replay_with_drift`), `testing` (tiny real
ONNX models for tests and benchmarks). Heavy dependencies (FastAPI, boto3, Evidently) load only in the modules
that need them.
"""
