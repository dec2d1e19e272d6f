"""`tailguard demo` (application layer): the main job end to end on real input, on the embedded default.

Modules: `run` (`run_demo`, what `tailguard demo` calls: data, registration, pipeline, monitor replay), `data`
(WordNet 3.0 glosses -> tokenized, sliced Parquet files), `planted_drift` (the monitor stage: replay with a drift
the demo plants), and `spec.yaml` (a verbatim copy of examples/minilm/spec.yaml, shipped as package data).
The model wrappers the demo registers stay in `tailguard.models`: registered versions store their class path.
"""
