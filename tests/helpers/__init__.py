"""Shared test helpers (not tests): tiny real models, datasets, specs and servers the test modules build on.

`mlflow_server` (a real MLflow server / uvicorn in a thread, free ports), `resolve_models` (state-dict classes for
resolve), `search_models` (the planted MLP for search), `tiny_models` (tiny torch/ONNX encoders and classifiers),
`user_models` (small trained CNNs as a user would bring them). Import them as `tests.helpers.<name>`.
"""
