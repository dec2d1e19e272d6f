"""`tailguard trigger serve`: start a pipeline run when MLflow registers a new model version.

MLflow (>= 3.3, tracking server with a SQL store) POSTs a webhook for the `model_version.created` event. The
request is signed as MLflow's `mlflow/webhooks/delivery.py` does it, following the Standard Webhooks scheme
(https://www.standardwebhooks.com):

    headers   X-MLflow-Delivery-Id: <uuid4>   X-MLflow-Timestamp: <unix seconds>
              X-MLflow-Signature: "v1,<base64(HMAC-SHA256(secret, f"{delivery_id}.{timestamp}.{body}"))>"
    body      {"entity": "model_version", "action": "created", "timestamp": "<ISO 8601>",
               "data": {"name", "version", "source", "run_id", "tags", "description"}}

Checks, in this order, each rejection counted in `tailguard_trigger_webhooks_total{outcome}` and logged:

0. the body size, before the body is read: a `Content-Length` over `max_body_bytes` is answered at once, a chunked
   body is counted while it is read and abandoned at the limit -> `too_large` (413);
1. the signature (constant-time compare; several space-separated `v1,<sig>` entries are accepted, for secret
   rotation) -> `bad_signature` (401);
2. the timestamp within `max_clock_skew_s` of the receiver's clock, both directions -> `stale` (401);
3. the delivery id not already accepted within the replay window -> `replayed` (409);
4. the body is JSON with the fields above -> `bad_payload` (400);
5. the event is `model_version.created` -> else `ignored_event` (200, nothing started);
6. the registered model name is configured -> else `unknown_model` (200, nothing started).

A delivery that passes all six starts one run through the injectable `Launcher`
(`launch(spec_path, model_name, version) -> run id`); the default is `tailguard.runner.launch_run` (KFP client when
`kfp_host` is set, else the local runner), imported lazily. Runs are idempotent on (model, version, sha256 of the
spec file): a second delivery for the same version answers with the first run id and starts nothing. When the
launcher raises, the receiver answers 500 (outcome `launch_failed`) and does not remember the delivery, so MLflow's
own retry (urllib3 Retry on 5xx, same headers) can succeed.

Every answer carries `outcome` and a `reason` code (REASONS), never exception text (that goes to the log only).
Accepted delivery ids persist in $TAILGUARD_HOME/trigger/replay.json, so a restart does not reopen the replay
window. Local runs get only the environment variables they need (`run_environment`: never the webhook secret).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import inspect
import json
import logging
import os
import threading
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any, Callable, Mapping, Protocol

import yaml
from fastapi import FastAPI, Request, Response
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from tailguard.core.errors import FieldError, InputError, SpecError

log = logging.getLogger("tailguard.trigger")

# Header names and signature version: mlflow/webhooks/constants.py (MLflow 3.17).
SIGNATURE_HEADER = "X-MLflow-Signature"
TIMESTAMP_HEADER = "X-MLflow-Timestamp"
DELIVERY_ID_HEADER = "X-MLflow-Delivery-Id"
SIGNATURE_VERSION = "v1"
EVENT = ("model_version", "created")
KFP_HOST_ENV = "TAILGUARD_KFP_HOST"  # read by tailguard.runner.launch_run

# Label values of tailguard_trigger_webhooks_total{outcome} (a contract with the PrometheusRule and dashboard).
OUTCOMES: tuple[str, ...] = ("accepted", "bad_signature", "stale", "replayed", "unknown_model", "ignored_event",
                             "bad_payload", "launch_failed", "too_large")
# `reason` codes of the answers (finer than the outcome; stable strings, no exception text).
REASONS: tuple[str, ...] = ("run_started", "already_launched", "missing_headers", "signature_mismatch",
                            "timestamp_invalid", "timestamp_skew", "delivery_replayed", "not_a_webhook",
                            "name_or_version_invalid", "event_ignored", "model_not_configured", "spec_unreadable",
                            "launcher_error", "content_length_invalid", "content_length_over_limit",
                            "body_over_limit")
REPLAY_FILE = "replay.json"  # under $TAILGUARD_HOME/trigger
# What a local run started by the trigger inherits (`run_environment`): these names, names with these prefixes,
# and TriggerConfig.run_env; never the webhook secret's variable.
RUN_ENV_NAMES = frozenset({
    "PATH", "HOME", "USER", "LOGNAME", "SHELL", "LANG", "LANGUAGE", "TZ", "TMPDIR", "VIRTUAL_ENV", "LD_LIBRARY_PATH",
    "SSL_CERT_FILE", "SSL_CERT_DIR", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE", "HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY",
    "http_proxy", "https_proxy", "no_proxy", "KUBECONFIG", "DO_NOT_TRACK", "KF_PIPELINES_SA_TOKEN_PATH"})
RUN_ENV_PREFIXES = ("TAILGUARD_", "MLFLOW_", "AWS_", "KFP_", "LC_", "PYTHON", "CUDA_", "NVIDIA_", "OMP_", "MKL_",
                    "HF_", "TRANSFORMERS_", "TOKENIZERS_", "GX_", "ORT_")
WEBHOOKS_METRIC = "tailguard_trigger_webhooks_total"
RUNS_METRIC = "tailguard_trigger_runs_started_total"
METRIC_NAMES: tuple[str, ...] = (WEBHOOKS_METRIC, RUNS_METRIC)


class Launcher(Protocol):
    """Starts one pipeline run and returns its id (a KFP run id, or a local run id)."""

    def __call__(self, spec_path: str, model_name: str, version: str) -> str: ...


class TriggerConfig(BaseModel):
    """The trigger's YAML config (`tailguard trigger serve --config trigger.yaml`).

    The webhook secret itself never appears in the file: `secret_env` names the environment variable holding it
    (in Kubernetes, filled from a Secret by `secretKeyRef`).
    """

    model_config = ConfigDict(extra="forbid")

    secret_env: str = Field("TAILGUARD_WEBHOOK_SECRET", pattern=r"^[A-Za-z_][A-Za-z0-9_]*$", description=(
        "Name of the environment variable holding the webhook secret (the `secret` given to MLflow's "
        "create_webhook). The receiver refuses to start when it is unset or empty."))
    models: dict[str, str] = Field(min_length=1, description=(
        "Registered model name -> spec file path (relative paths are relative to this config file). Only these "
        "models start runs; webhooks for any other model are counted as unknown_model and ignored."))
    max_clock_skew_s: float = Field(300.0, gt=0, le=3600, description=(
        "Reject deliveries whose X-MLflow-Timestamp differs from the receiver's clock by more than this (s), in "
        "either direction. 300 s is the Standard Webhooks recommendation."))
    kfp_host: str | None = Field(None, description=(
        "Kubeflow Pipelines API URL (e.g. http://ml-pipeline.kubeflow:8888). Unset: runs start on the local runner."))
    replay_cache_size: int = Field(10_000, ge=1, description=(
        "Delivery ids remembered for replay detection (each for 2 x max_clock_skew_s; older ones are stale anyway)."))
    check_specs: bool = Field(True, description=(
        "At start-up, load every spec and require spec.model.registered_name to equal its key in `models`."))
    max_body_bytes: int = Field(1 << 20, ge=1024, le=64 << 20, description=(
        "Largest webhook body accepted (bytes); larger ones are answered 413 (outcome too_large) before the body "
        "is read (Content-Length) or as soon as the limit is passed (chunked). MLflow's model_version.created "
        "payload is a few KiB (name, version, source, run_id, tags, description)."))
    run_env: list[str] = Field(default_factory=list, description=(
        "Extra environment variable names a local run started by the trigger inherits, beyond the built-in "
        "allowlist (PATH, HOME, locale, proxies and CA bundles, TAILGUARD_*, MLFLOW_*, AWS_*, KFP_*, PYTHON*, "
        "CUDA_*, ...). The webhook secret's variable is never passed."))

    @field_validator("models")
    @classmethod
    def _names(cls, v: dict[str, str]) -> dict[str, str]:
        for name, path in v.items():
            if not name.strip() or not str(path).strip():
                raise ValueError("model names and spec paths must be non-empty")
        return v

    @classmethod
    def load(cls, path: str | Path) -> "TriggerConfig":
        """Read and validate a trigger config YAML; relative spec paths become absolute (config folder).

        Raises:
            SpecError: the file is missing, not YAML, or invalid (every problem with its field path).
        """
        p = Path(path)
        if not p.is_file():
            raise SpecError([FieldError("", f"file not found: {p}")], source=str(p),
                            hint="pass --config with the path of the trigger YAML (see docs/deploy.md)")
        try:
            data = yaml.safe_load(p.read_text())
        except yaml.YAMLError as exc:
            raise SpecError([FieldError("", f"not valid YAML: {exc}")], source=str(p)) from None
        if not isinstance(data, dict):
            raise SpecError([FieldError("", "expected a mapping at the top level")], source=str(p))
        try:
            cfg = cls.model_validate(data)
        except ValidationError as exc:
            raise SpecError(_field_errors(exc), source=str(p),
                            hint="fix the fields above; see docs/deploy.md#trigger-config") from None
        base = p.resolve().parent
        cfg.models = {k: str(v if Path(v).is_absolute() else (base / v).resolve()) for k, v in cfg.models.items()}
        return cfg


def _field_errors(exc: ValidationError) -> list[FieldError]:
    """The spec's field_errors, with the trigger config's wording for an unknown field."""
    from tailguard.core.spec import field_errors

    return field_errors(exc, unknown="unknown field (check the spelling)")


def sign(secret: str, delivery_id: str, timestamp: str, body: bytes | str) -> str:
    """The `X-MLflow-Signature` value MLflow sends: "v1," + base64(HMAC-SHA256(secret, id.timestamp.body)).

    Source: mlflow/webhooks/delivery.py `_generate_hmac_signature` (MLflow 3.17).

    Args:
        secret: the webhook secret (UTF-8).
        delivery_id: X-MLflow-Delivery-Id.
        timestamp: X-MLflow-Timestamp, Unix seconds as a decimal string.
        body: the raw request body, exactly as sent.
    """
    payload = body.decode("utf-8") if isinstance(body, bytes) else body
    mac = hmac.new(secret.encode("utf-8"), f"{delivery_id}.{timestamp}.{payload}".encode("utf-8"), hashlib.sha256)
    return f"{SIGNATURE_VERSION},{base64.b64encode(mac.digest()).decode('ascii')}"


def verify_signature(secret: str, delivery_id: str, timestamp: str, body: bytes, header: str) -> bool:
    """True when any `v1,<sig>` entry of the (space-separated) signature header matches, compared in constant time."""
    try:
        expected = sign(secret, delivery_id, timestamp, body)
    except UnicodeDecodeError:
        return False
    return any(hmac.compare_digest(expected.encode(), part.encode()) for part in header.split() if part)


class _ReplayCache:
    """Delivery ids seen recently (bounded, oldest evicted), each kept for `ttl_s` seconds of `clock` (Unix s),
    persisted in `path` (JSON {delivery id: accepted at}) so that a restarted receiver still refuses replays.

    The file is rewritten atomically (temporary file + os.replace) on every add; an unreadable or malformed file
    is logged and started afresh (the timestamp check still refuses deliveries older than the skew window).
    """

    def __init__(self, size: int, ttl_s: float, *, path: Path | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        self._seen: OrderedDict[str, float] = OrderedDict()
        self._size, self._ttl, self._path, self._clock = size, ttl_s, path, clock
        if path is not None and path.is_file():
            try:
                saved = json.loads(path.read_text())
                items = sorted(((str(k), float(v)) for k, v in saved.items()), key=lambda kv: kv[1])
            except (OSError, ValueError, TypeError, AttributeError) as exc:
                log.warning("replay cache %s unreadable (%s); starting empty", path, type(exc).__name__)
                items = []
            self._seen.update(items[-size:])
            self._expire()

    def __contains__(self, key: str) -> bool:
        self._expire()
        return key in self._seen

    def add(self, key: str) -> None:
        self._seen[key] = self._clock()
        self._seen.move_to_end(key)
        while len(self._seen) > self._size:
            self._seen.popitem(last=False)
        self._save()

    def _expire(self) -> None:
        now = self._clock()
        while self._seen and now - next(iter(self._seen.values())) > self._ttl:
            self._seen.popitem(last=False)

    def _save(self) -> None:
        if self._path is None:
            return
        self._path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self._path.with_name(f".{self._path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(self._seen))
        os.replace(tmp, self._path)


def run_environment(config: TriggerConfig, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment a local run started by the trigger gets: the allowlist (RUN_ENV_NAMES, RUN_ENV_PREFIXES)
    and `config.run_env`, never `config.secret_env` (the webhook secret).

    Args:
        config: the trigger config.
        environ: the receiver's environment (default os.environ).

    Returns:
        {name: value} of the variables passed on.
    """
    environ = os.environ if environ is None else environ
    extra = set(config.run_env)
    return {k: v for k, v in environ.items()
            if k != config.secret_env and (k in RUN_ENV_NAMES or k in extra or k.startswith(RUN_ENV_PREFIXES))}


def spec_hash(spec_path: str | Path) -> str:
    """sha256 hex digest of a spec file's bytes (part of the idempotency key)."""
    return hashlib.sha256(Path(spec_path).read_bytes()).hexdigest()


def default_launcher(config: TriggerConfig) -> Launcher:
    """The production launcher: `tailguard.runner.launch_run`, imported on first use.

    The trigger config decides where runs go: `kfp_host` is handed to launch_run as its `host` keyword when it
    takes one, else through $TAILGUARD_KFP_HOST (which launch_run reads); with no `kfp_host` the variable is
    removed, so the run starts on the local runner.
    """

    def launch(spec_path: str, model_name: str, version: str) -> str:
        from tailguard.runner import launch_run  # lazy: pulls kfp / the local runner

        params = inspect.signature(launch_run).parameters
        kwargs: dict[str, Any] = {}
        if "env" in params:  # a local run inherits only what it needs (never the webhook secret)
            kwargs["env"] = run_environment(config)
        if "host" in params:
            return launch_run(spec_path, model_name, version, host=config.kfp_host, **kwargs)
        if config.kfp_host:
            os.environ[KFP_HOST_ENV] = config.kfp_host
        else:
            os.environ.pop(KFP_HOST_ENV, None)
        return launch_run(spec_path, model_name, version, **kwargs)

    return launch


def _check_specs(config: TriggerConfig) -> None:
    from tailguard.core.spec import load_spec

    errors = []
    for name, path in config.models.items():
        try:
            spec = load_spec(path, resolve_paths=False)
        except SpecError as exc:
            errors.append(FieldError(f"models.{name}", f"spec {path} is invalid: {exc.message}"))
            continue
        if spec.model.registered_name != name:
            errors.append(FieldError(f"models.{name}", f"spec {path} has model.registered_name "
                                                       f"{spec.model.registered_name!r}, not {name!r}"))
    if errors:
        raise SpecError(errors, source="trigger config",
                        hint="map each registered model name to the spec that optimizes it")


class TriggerState:
    """What one receiver holds: its config, secret, launcher, replay cache, launched runs and counters.

    Attributes:
        registry: the prometheus_client CollectorRegistry exposed on /metrics.
        webhooks: Counter `tailguard_trigger_webhooks_total{outcome}` (every outcome pre-set to 0).
        runs_started: Counter `tailguard_trigger_runs_started_total`.
        launched: {(model, version, spec sha256): run id}.
    """

    def __init__(self, config: TriggerConfig, secret: str, launch: Launcher,
                 clock: Callable[[], float] = time.time, state_dir: Path | None = None) -> None:
        from prometheus_client import CollectorRegistry, Counter

        self.config, self._secret, self.launch, self.clock = config, secret, launch, clock
        self.registry = CollectorRegistry()
        self.webhooks = Counter("tailguard_trigger_webhooks", "MLflow webhook deliveries by outcome.",
                                ["outcome"], registry=self.registry)
        for o in OUTCOMES:
            self.webhooks.labels(outcome=o)
        self.runs_started = Counter("tailguard_trigger_runs_started", "Pipeline runs started by the trigger.",
                                    registry=self.registry)
        self.replays = _ReplayCache(config.replay_cache_size, 2 * config.max_clock_skew_s, clock=clock,
                                    path=None if state_dir is None else Path(state_dir) / REPLAY_FILE)
        self.launched: dict[tuple[str, str, str], str] = {}
        self._lock = threading.Lock()

    def count(self, outcome: str, status: int, reason: str, detail: str, **fields: Any) -> tuple[int, dict[str, Any]]:
        """Count and log one outcome; returns (HTTP status, response body with outcome, reason code, detail).

        `detail` is a fixed sentence of this module (never exception text: that is logged by the caller)."""
        self.webhooks.labels(outcome=outcome).inc()
        level = logging.INFO if outcome in ("accepted", "ignored_event") else logging.WARNING
        log.log(level, "webhook %s (%s): %s %s", outcome, reason, detail,
                json.dumps(fields, sort_keys=True, default=str))
        return status, {"outcome": outcome, "reason": reason, "detail": detail, **fields}

    def handle(self, headers: dict[str, str], body: bytes) -> tuple[int, dict[str, Any]]:
        """Check one delivery and start a run when it is valid (see the module docstring for the order).

        Args:
            headers: request headers, lower-cased names.
            body: raw request body.

        Returns:
            (HTTP status, JSON response body with `outcome`, `detail` and, when accepted, `run_id`).
        """
        delivery = headers.get(DELIVERY_ID_HEADER.lower(), "")
        ts = headers.get(TIMESTAMP_HEADER.lower(), "")
        sig = headers.get(SIGNATURE_HEADER.lower(), "")
        if not (delivery and ts and sig):
            return self.count("bad_signature", 401, "missing_headers",
                              "missing X-MLflow-Delivery-Id/Timestamp/Signature header", delivery=delivery)
        if not verify_signature(self._secret, delivery, ts, body, sig):
            return self.count("bad_signature", 401, "signature_mismatch", "signature does not match", delivery=delivery)
        try:
            skew = abs(self.clock() - int(ts))
        except ValueError:
            return self.count("stale", 401, "timestamp_invalid", "timestamp is not Unix seconds", delivery=delivery)
        if skew > self.config.max_clock_skew_s:
            return self.count("stale", 401, "timestamp_skew",
                              f"timestamp off by {skew:.0f} s (max {self.config.max_clock_skew_s:g})",
                              delivery=delivery)
        with self._lock:
            if delivery in self.replays:
                return self.count("replayed", 409, "delivery_replayed", "delivery id already accepted",
                                  delivery=delivery)
            try:
                msg = json.loads(body)
                event = (msg["entity"], msg["action"])
                data = msg["data"]
            except (ValueError, KeyError, TypeError):
                return self.count("bad_payload", 400, "not_a_webhook", "body is not an MLflow webhook JSON object",
                                  delivery=delivery)
            if event != EVENT:
                self.replays.add(delivery)
                return self.count("ignored_event", 200, "event_ignored", f"event {'.'.join(map(str, event))} is not "
                                                        f"{'.'.join(EVENT)}", delivery=delivery)
            name, version = (data.get("name"), data.get("version")) if isinstance(data, dict) else (None, None)
            if not isinstance(name, str) or not isinstance(version, (str, int)) or not str(version).isdigit():
                return self.count("bad_payload", 400, "name_or_version_invalid",
                                  "data.name / data.version missing or invalid", delivery=delivery)
            version = str(version)
            if name not in self.config.models:
                self.replays.add(delivery)
                return self.count("unknown_model", 200, "model_not_configured",
                                  f"registered model {name!r} is not configured", delivery=delivery, model=name,
                                  version=version)
            spec_path = self.config.models[name]
            try:
                key = (name, version, spec_hash(spec_path))
            except OSError:
                log.exception("cannot read spec %s for %s v%s", spec_path, name, version)
                return self.count("launch_failed", 500, "spec_unreadable", "the configured spec cannot be read; "
                                  "see the trigger's log", delivery=delivery, model=name, version=version)
            if key in self.launched:
                self.replays.add(delivery)
                return self.count("accepted", 200, "already_launched",
                                  "already launched for this model version and spec", delivery=delivery, model=name,
                                  version=version, run_id=self.launched[key], started=False)
            try:
                run_id = self.launch(spec_path, name, version)
            except Exception:  # noqa: BLE001 - any launcher failure is a 500 so MLflow retries
                log.exception("launch failed for %s v%s", name, version)
                return self.count("launch_failed", 500, "launcher_error", "starting the run failed; see the "
                                  "trigger's log", delivery=delivery, model=name, version=version)
            self.launched[key] = str(run_id)
            self.replays.add(delivery)
            self.runs_started.inc()
            return self.count("accepted", 202, "run_started", "run started", delivery=delivery, model=name,
                              version=version, run_id=str(run_id), started=True)


def create_app(config: TriggerConfig, *, launch: Launcher | None = None,
               clock: Callable[[], float] = time.time, secret: str | None = None,
               state_dir: str | Path | None = None) -> FastAPI:
    """The receiver as a FastAPI app: POST /webhook, GET /metrics, /healthz, /readyz.

    Args:
        config: the trigger config.
        launch: starts a run (default `default_launcher(config)`, i.e. tailguard.runner.launch_run).
        clock: current Unix time in s (injectable for tests).
        secret: the webhook secret; default read from the environment variable `config.secret_env`.
        state_dir: folder of the persisted replay cache (REPLAY_FILE); default $TAILGUARD_HOME/trigger.

    Returns:
        A `fastapi.FastAPI`; its `state.trigger` is the `TriggerState` (counters, launched runs).

    Raises:
        InputError: the secret environment variable is unset or empty.
        SpecError: a configured spec is invalid or names another registered model (when `check_specs`).
    """
    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

    secret = secret if secret is not None else os.environ.get(config.secret_env, "")
    if not secret:
        raise InputError(f"the webhook secret environment variable {config.secret_env} is unset or empty",
                         hint=f"export {config.secret_env}=<the secret given to MLflow create_webhook>")
    if config.check_specs:
        _check_specs(config)
    if state_dir is None:
        from tailguard.core.home import home

        state_dir = home() / "trigger"
    state = TriggerState(config, secret, launch or default_launcher(config), clock, state_dir=Path(state_dir))
    app = FastAPI(title="tailguard trigger", version="1")
    app.state.trigger = state

    limit = config.max_body_bytes

    @app.post("/webhook")
    async def webhook(request: Request) -> JSONResponse:
        declared = request.headers.get("content-length")
        if declared is not None:  # checked before a byte of the body is read
            if not declared.strip().isdigit():
                status, payload = state.count("bad_payload", 400, "content_length_invalid",
                                              "Content-Length is not a byte count")
                return JSONResponse(payload, status_code=status)
            if int(declared) > limit:
                status, payload = state.count("too_large", 413, "content_length_over_limit",
                                              f"body over max_body_bytes ({limit} bytes)", declared=int(declared))
                return JSONResponse(payload, status_code=status, headers={"Connection": "close"})
        chunks, size = [], 0
        async for chunk in request.stream():  # chunked bodies: counted while read, abandoned at the limit
            size += len(chunk)
            if size > limit:
                status, payload = state.count("too_large", 413, "body_over_limit",
                                              f"body over max_body_bytes ({limit} bytes)")
                return JSONResponse(payload, status_code=status, headers={"Connection": "close"})
            chunks.append(chunk)
        body = b"".join(chunks)
        headers = {k.lower(): v for k, v in request.headers.items()}
        status, payload = await run_in_threadpool(state.handle, headers, body)
        return JSONResponse(payload, status_code=status)

    @app.get("/metrics")
    def metrics() -> Response:
        return Response(generate_latest(state.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/healthz")
    def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/readyz")
    def readyz() -> dict[str, Any]:
        return {"status": "ready", "models": sorted(config.models), "kfp_host": config.kfp_host}

    return app


def serve(config_path: str | Path, host: str = "0.0.0.0", port: int = 8080) -> None:  # noqa: S104
    """Run the receiver with uvicorn until interrupted (`tailguard trigger serve`).

    Raises:
        SpecError: invalid config or spec.
        InputError: the webhook secret is not set.
    """
    import uvicorn

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    app = create_app(TriggerConfig.load(config_path))
    uvicorn.run(app, host=host, port=port, log_level="info")
