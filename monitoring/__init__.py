"""The shadow-traffic monitor: compares the promoted variant with its FP32 reference on sampled live requests,
per slice (docs/monitor.md).

Modules: `config` (the spec's monitoring section resolved, slice rules), `sampler` (long-tail sampling with
weights), `detector` (per-slice sequential change detection: betting CUSUMs, false-alarm control, alert records),
`compare` (per-row parity via tailguard.core.parity), `slice_monitor` (`SliceMonitor`, shared by service and replay),
`combine` (one detector over the evidence of N replicas), `peers` (the combiner's reads of its peers), `oip` (Open
Inference Protocol bodies), `join` (KServe payload-logger CloudEvents joined by id), `grpc_ingest` (OIP over gRPC),
`node_check` (this node against the nodes the candidate was validated on), `prometheus` (Prometheus exposition,
METRIC_NAMES), `sink` (S3 Parquet + spool), `drift` (Evidently); the HTTP service: `service` (`MonitorService`:
life cycle and reports; `create_service`) with its parts `ingest`, `worker` (the shadow worker), `readiness` and
`body_budget`, then `app` (the FastAPI routes), `probe` (the probe port) and `serve` (`tailguard monitor serve`);
`replay` (`replay_cli`), `testing` (tiny real ONNX models for tests and benchmarks). Heavy dependencies (FastAPI,
boto3, Evidently) load only in the modules that need them. The demo's planted-drift replay lives in the
application layer, `tailguard.demo.planted_drift`.
"""
