"""Open Inference Protocol over gRPC (`inference.GRPCInferenceService`), beside the HTTP service.

`tailguard monitor serve --grpc-port N` starts it. The messages are the protocol's published ones, as the maintained
package `tritonclient` ships them (`tritonclient.grpc.service_pb2` / `service_pb2_grpc`, KServe's
grpc_predict_v2.proto plus Triton's extensions); nothing here writes the wire format.

RPCs:
    ModelInfer      a request with `raw_input_contents` (one entry per input, in order, the binary tensor data
                    extension's layout: little-endian, BOOL one byte, BF16 widened to float32, BYTES 4-byte
                    length-prefixed) or typed `contents` (FP16/BF16 have none: raw only); the request
                    `parameters` map is the slice metadata (like the JSON request's `parameters`). It goes the
                    /infer way (`MonitorService.ingest_decoded`: the same OIP checks and limits, sampling, queue,
                    metrics with endpoint="grpc") and answers at once with no outputs and the parameter
                    `tailguard.sampled`.
    ServerLive      live: true while the process serves.
    ServerReady     ready: what GET /readyz says (false, not an error, while a model is missing or failing).
    ModelReady      ready: the same, for the monitored model name (false for any other name).
    ServerMetadata, ModelMetadata   name/version; the monitored model's inputs and compared output (NOT_FOUND for
                    another model). Every other RPC answers UNIMPLEMENTED.

Errors map to status codes: a malformed request INVALID_ARGUMENT, an unknown model NOT_FOUND, a message over
monitoring.max_body_bytes or a batch over max_batch_rows RESOURCE_EXHAUSTED; each is counted in
`tailguard_monitor_invalid_requests_total{reason}` as over HTTP. Messages over max_body_bytes are refused by gRPC
itself from the message's length prefix (`grpc.max_receive_message_length`), before they are read; ModelInfer is
served as a client-streaming method (the same bytes on the wire as a unary call) so that the monitor learns of
such a refusal and counts it as `body_too_large` (gRPC does not tell it apart from a client that cancels before
its message arrived, which is counted the same way). The read of that one message can end with "no message"
before gRPC has ended the call: the handler then waits for the call's end (TERMINATION_GRACE_S) before it takes
the stream for one closed without a message (`bad_data`), so the refusal is always counted (issue 36 item 7).
A call whose message does not arrive within monitoring.body_read_timeout_s is cancelled and counted
`body_read_timeout`; at most INGEST_SLOTS ModelInfer calls are served at once (more: RESOURCE_EXHAUSTED,
`too_many_requests`), so stalled streams never take the threads that answer ServerLive / ServerReady (issue 36
item 5). Memory is bounded by max_concurrent_rpcs x max_body_bytes: calls past max_concurrent_rpcs are refused by
gRPC with RESOURCE_EXHAUSTED (not counted by the monitor).
With a bearer token (monitoring.auth_token_env / auth_token_file), every RPC but ServerLive needs the metadata
`authorization: Bearer <token>` (ServerReady / ModelReady only with monitoring.auth_readyz), else UNAUTHENTICATED
(AuthInterceptor).
"""

from __future__ import annotations

import concurrent.futures as cf
import heapq
import itertools
import math
import threading
import time
from typing import Any, Callable, Iterator, Sequence

import grpc
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc as pb_grpc

from tailguard.core.errors import InputError
from tailguard.monitoring.oip import (
    OIP_ITEMSIZE,
    SPEC_TO_OIP,
    OipError,
    _binary_shape,
    check_tensors,
    decode_binary,
    utf8_text,
)

SERVICE_NAME: str = pb.DESCRIPTOR.services_by_name["GRPCInferenceService"].full_name  # inference.GRPCInferenceService
MAX_WORKERS = 16  # threads serving RPCs (ingest never waits for a model: a few are enough)
# ModelInfer calls served at once (each holds a worker thread while its message arrives); more are refused at once
# with RESOURCE_EXHAUSTED (counted too_many_requests), so the other MAX_WORKERS - INGEST_SLOTS threads always serve
# ServerLive / ServerReady / ModelReady / metadata (issue 36 item 5: eight stalled streams took every worker)
INGEST_SLOTS = 12
# After a ModelInfer stream ends without a message: how long to wait for gRPC's own end of the call (a message over
# max_receive_message_length, refused from its length prefix, ends the call a moment later) before taking it for a
# client that closed its stream without sending one (issue 36 item 7: deciding at once miscounted the refusal)
TERMINATION_GRACE_S = 5.0
MAX_CONCURRENT_RPCS = 64  # calls in flight at once; each holds at most max_body_bytes
# The typed `contents` field of each datatype (grpc_predict_v2.proto InferTensorContents); FP16/BF16 have none.
CONTENTS_FIELD: dict[str, str] = {"BOOL": "bool_contents", "INT8": "int_contents", "INT16": "int_contents",
                                  "INT32": "int_contents", "INT64": "int64_contents", "UINT8": "uint_contents",
                                  "UINT16": "uint_contents", "UINT32": "uint_contents", "UINT64": "uint64_contents",
                                  "FP32": "fp32_contents", "FP64": "fp64_contents", "BYTES": "bytes_contents"}


def status_code(http_status: int) -> grpc.StatusCode:
    """The gRPC status code of an ingest refusal's HTTP status: 413 RESOURCE_EXHAUSTED (body or batch over the
    limits), 404 NOT_FOUND (unknown model), any other 4xx INVALID_ARGUMENT."""
    return {413: grpc.StatusCode.RESOURCE_EXHAUSTED, 404: grpc.StatusCode.NOT_FOUND}.get(
        http_status, grpc.StatusCode.INVALID_ARGUMENT)


def _parameter(p: pb.InferParameter) -> Any:
    which = p.WhichOneof("parameter_choice")
    return None if which is None else getattr(p, which)


def request_body(request: pb.ModelInferRequest, input_specs: Sequence | None = None) -> dict[str, Any]:
    """A ModelInferRequest as the OIP request dict `parse_request` checks (tensors' `data` decoded).

    Args:
        request: the decoded message.
        input_specs: the spec's model.inputs: every input's name and datatype are checked against them before any
            tensor is decoded (`check_tensors`, issue 36 item 10); None: not checked here.

    Returns:
        {"id", "inputs": [{"name", "shape", "datatype", "data"}], "parameters": {name: scalar}}.

    Raises:
        OipError: binary_size_mismatch (raw_input_contents not one per input, both raw and typed contents, or a raw
            entry whose size is not shape x element size), bad_bytes_prefix, bad_shape (a negative dimension, or
            typed contents whose count is not the shape's product), bad_datatype, bad_data (FP16/BF16 without
            raw contents), unknown_input; sizes, names and datatypes are checked before anything is decoded.
    """
    raw = request.raw_input_contents
    if raw and len(raw) != len(request.inputs):
        raise OipError("binary_size_mismatch", f"raw_input_contents has {len(raw)} entries for "
                                               f"{len(request.inputs)} inputs; send one per input, in order",
                       status=400)
    if input_specs is not None:
        check_tensors([{"name": utf8_text(t.name), "datatype": t.datatype} for t in request.inputs], input_specs)
    inputs = []
    for i, t in enumerate(request.inputs):
        name = utf8_text(t.name)
        if any(d < 0 for d in t.shape):
            raise OipError("bad_shape", f"input {name!r}: shape {list(t.shape)} has a negative dimension")
        tensor: dict[str, Any] = {"name": name, "shape": [int(d) for d in t.shape], "datatype": t.datatype}
        if raw:
            if t.HasField("contents"):
                raise OipError("binary_size_mismatch", f"input {name!r}: has both contents and raw_input_contents; "
                                                       "send one of them", status=400)
            _, shape, dt = _binary_shape(tensor, "input")
            tensor["data"] = decode_binary(memoryview(raw[i]), name, shape, dt, "input")
        else:
            field = CONTENTS_FIELD.get(t.datatype)
            if field is None:
                if t.datatype in OIP_ITEMSIZE:  # FP16 / BF16
                    raise OipError("bad_data", f"input {name!r}: {t.datatype} has no typed contents in the "
                                               "protocol; send it in raw_input_contents")
                raise OipError("bad_datatype", f"input {name!r}: datatype {utf8_text(t.datatype)[:60]!r} is not an "
                                               f"OIP datatype; the model takes {sorted(set(SPEC_TO_OIP.values()))}")
            values = getattr(t.contents, field)
            n = math.prod(tensor["shape"])
            if len(values) != n:
                raise OipError("bad_shape", f"input {name!r}: shape {tensor['shape']} needs {n} values, "
                                            f"contents.{field} has {len(values)}")
            tensor["data"] = list(values)
        inputs.append(tensor)
    return {"id": utf8_text(request.id), "inputs": inputs,
            "parameters": {utf8_text(k): _parameter(v) for k, v in request.parameters.items()}}


class InferenceServicer(pb_grpc.GRPCInferenceServiceServicer):
    """The monitor's GRPCInferenceService (RPCs: module docstring). Thread-safe: admission is serialized by the
    service.

    Args:
        service: the MonitorService the HTTP app serves (tailguard.monitoring.service).
    """

    def __init__(self, service: Any, *, ingest_slots: int = INGEST_SLOTS) -> None:
        self.service = service
        self.model = service.cfg.model_name
        self.read_timeout_s = float(service.cfg.mon.body_read_timeout_s)
        self._slots = threading.BoundedSemaphore(ingest_slots)
        self._deadlines = Deadlines()
        self.active = 0  # ModelInfer calls holding an ingest slot (tests; read without a lock)
        self._active_lock = threading.Lock()

    def ServerLive(self, request: pb.ServerLiveRequest, context: grpc.ServicerContext) -> pb.ServerLiveResponse:
        """Live while the process serves."""
        return pb.ServerLiveResponse(live=True)

    def ServerReady(self, request: pb.ServerReadyRequest, context: grpc.ServicerContext) -> pb.ServerReadyResponse:
        """Ready as GET /readyz: the models loaded and answering."""
        return pb.ServerReadyResponse(ready=self.service.readiness()[0])

    def ModelReady(self, request: pb.ModelReadyRequest, context: grpc.ServicerContext) -> pb.ModelReadyResponse:
        """Ready for the monitored model name when the server is ready; false for any other name."""
        return pb.ModelReadyResponse(ready=request.name == self.model and self.service.readiness()[0])

    def ServerMetadata(self, request: pb.ServerMetadataRequest, context: grpc.ServicerContext
                       ) -> pb.ServerMetadataResponse:
        """The server's name and version."""
        from importlib import metadata

        try:
            version = metadata.version("tailguard")
        except metadata.PackageNotFoundError:
            version = "unknown"
        return pb.ServerMetadataResponse(name="tailguard-monitor", version=version)

    def ModelMetadata(self, request: pb.ModelMetadataRequest, context: grpc.ServicerContext
                      ) -> pb.ModelMetadataResponse:
        """The monitored model's inputs and compared output (symbolic dimensions as -1); NOT_FOUND for others."""
        if request.name != self.model:
            context.abort(grpc.StatusCode.NOT_FOUND, f"model {utf8_text(request.name)[:200]!r} is not monitored "
                                                     f"here; use {self.model!r}")
        cfg = self.service.cfg

        def meta(s: Any, datatype: str) -> pb.ModelMetadataResponse.TensorMetadata:
            return pb.ModelMetadataResponse.TensorMetadata(
                name=s.name, datatype=datatype, shape=[d if isinstance(d, int) else -1 for d in s.shape])

        out = cfg.output
        return pb.ModelMetadataResponse(
            name=self.model, platform="tailguard-shadow-monitor",
            inputs=[meta(s, SPEC_TO_OIP[s.dtype]) for s in cfg.inputs],
            outputs=[meta(out, SPEC_TO_OIP.get(getattr(out, "dtype", "float32"), "FP32"))])

    def ModelInfer(self, request_iterator: Iterator[pb.ModelInferRequest], context: grpc.ServicerContext
                   ) -> pb.ModelInferResponse:
        """Ingest one request the /infer way (module docstring); served client-streaming, one message read within
        monitoring.body_read_timeout_s, at most `ingest_slots` calls at once (more: RESOURCE_EXHAUSTED, counted)."""
        if not self._slots.acquire(blocking=False):
            self.service.refuse_body("grpc", "too_many_requests")
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "too_many_requests: every ingest slot is taken; retry")
        with self._active_lock:
            self.active += 1
        try:
            request = self._read_one(request_iterator, context)
            if request is None:  # refused and counted; the call is over
                return pb.ModelInferResponse()
            status, doc = self.service.ingest_decoded("grpc", request.model_name,
                                                      lambda: request_body(request, self.service.cfg.inputs),
                                                      context.invocation_metadata())
        finally:
            with self._active_lock:
                self.active -= 1
            self._slots.release()
        if status != 200:
            context.abort(status_code(status), f"{doc['reason']}: {doc['error']}")
        sampled = bool(doc["parameters"]["tailguard.sampled"])
        return pb.ModelInferResponse(model_name=self.model, id=doc["id"],
                                     parameters={"tailguard.sampled": pb.InferParameter(bool_param=sampled)})

    def _read_one(self, request_iterator: Iterator[pb.ModelInferRequest], context: grpc.ServicerContext
                  ) -> pb.ModelInferRequest | None:
        """The call's one message, or None when it was refused (and counted): a message over max_body_bytes (gRPC
        refuses it from its length prefix and ends the call: body_too_large), no message within
        body_read_timeout_s (the call is cancelled: body_read_timeout). A stream closed without a message is
        answered INVALID_ARGUMENT (bad_data)."""
        expired = threading.Event()

        def expire() -> None:
            expired.set()
            context.cancel()

        deadline = self._deadlines.add(self.read_timeout_s, expire)
        try:
            return next(request_iterator)
        except StopIteration:
            # gRPC ends a call whose message is over max_receive_message_length a moment after the read returned
            # nothing; a client that closed its stream without a message leaves it open until we answer
            if expired.is_set():
                self.service.refuse_body("grpc", "body_read_timeout")
                return None
            if _ends(context, TERMINATION_GRACE_S):
                self.service.refuse_oversized("grpc")
                return None
            self.service.ingest_decoded("grpc", self.model, _no_message)
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "ModelInfer needs one ModelInferRequest message")
        except grpc.RpcError:  # the call ended before a message: over max_receive_message_length, our deadline,
            if expired.is_set():  # or the client cancelled (counted as too large: gRPC does not tell them apart)
                self.service.refuse_body("grpc", "body_read_timeout")
                return None
            remaining = context.time_remaining()
            if remaining is None or remaining > 0:
                self.service.refuse_oversized("grpc")
            return None  # the call is over: gRPC already sent its status
        finally:
            self._deadlines.cancel(deadline)
        return None


def _ends(context: grpc.ServicerContext, within_s: float) -> bool:
    """Whether the call ends (gRPC ended it, or the client cancelled) within `within_s` seconds."""
    ended = threading.Event()
    if not context.add_callback(ended.set):  # already over
        return True
    return ended.wait(within_s)


class Deadlines:
    """Calls functions at monotonic deadlines, from one daemon thread (a thread per call would cost more than the
    call). Thread-safe. A cancelled deadline leaves its heap entry until its time or the next compaction."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int]] = []
        self._live: dict[int, tuple[float, Callable[[], None]]] = {}
        self._cond = threading.Condition()
        self._seq = itertools.count()
        self._thread: threading.Thread | None = None

    def add(self, delay_s: float, fn: Callable[[], None]) -> int:
        """Call `fn` in `delay_s` seconds; returns a handle for `cancel`."""
        handle = next(self._seq)
        when = time.monotonic() + delay_s
        with self._cond:
            self._live[handle] = (when, fn)
            heapq.heappush(self._heap, (when, handle))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="tg-grpc-deadlines", daemon=True)
                self._thread.start()
            self._cond.notify()
        return handle

    def cancel(self, handle: int) -> None:
        """Do not call the function of `handle` (no effect once it was called)."""
        with self._cond:
            self._live.pop(handle, None)
            if len(self._heap) > 2 * len(self._live) + 1024:  # mostly cancelled entries: rebuild from the live ones
                self._heap = [(when, h) for h, (when, _) in self._live.items()]
                heapq.heapify(self._heap)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._heap:
                    self._cond.wait()
                when, handle = self._heap[0]
                now = time.monotonic()
                if when > now:
                    self._cond.wait(when - now)
                    continue
                heapq.heappop(self._heap)
                entry = self._live.pop(handle, None)
            if entry is not None:
                try:
                    entry[1]()
                except Exception:  # noqa: BLE001 - a failed cancel must not stop the other deadlines
                    pass


def _no_message() -> dict[str, Any]:
    raise OipError("bad_data", "ModelInfer needs one ModelInferRequest message", status=400)


def handlers(servicer: InferenceServicer) -> grpc.GenericRpcHandler:
    """The service's method handlers (request/response classes from service_pb2); ModelInfer client-streaming."""
    def unary(method: str, request: Any, response: Any) -> grpc.RpcMethodHandler:
        return grpc.unary_unary_rpc_method_handler(getattr(servicer, method), request_deserializer=request.FromString,
                                                   response_serializer=response.SerializeToString)

    table = {
        "ServerLive": unary("ServerLive", pb.ServerLiveRequest, pb.ServerLiveResponse),
        "ServerReady": unary("ServerReady", pb.ServerReadyRequest, pb.ServerReadyResponse),
        "ModelReady": unary("ModelReady", pb.ModelReadyRequest, pb.ModelReadyResponse),
        "ServerMetadata": unary("ServerMetadata", pb.ServerMetadataRequest, pb.ServerMetadataResponse),
        "ModelMetadata": unary("ModelMetadata", pb.ModelMetadataRequest, pb.ModelMetadataResponse),
        "ModelInfer": grpc.stream_unary_rpc_method_handler(
            servicer.ModelInfer, request_deserializer=pb.ModelInferRequest.FromString,
            response_serializer=pb.ModelInferResponse.SerializeToString),
    }
    return grpc.method_handlers_generic_handler(SERVICE_NAME, table)


# RPCs that never need the token (like HTTP /healthz), and those that follow monitoring.auth_readyz (/readyz)
OPEN_METHODS = frozenset({"ServerLive"})
READY_METHODS = frozenset({"ServerReady", "ModelReady"})


class AuthInterceptor(grpc.ServerInterceptor):
    """Requires the monitor's bearer token in the metadata `authorization: Bearer <token>` (checked in constant
    time, monitoring/config.py BearerAuth) on every RPC but ServerLive (ServerReady / ModelReady only with
    monitoring.auth_readyz); a call without it is aborted UNAUTHENTICATED before its message is read, and counted
    in invalid_requests_total{reason="unauthenticated"} like HTTP's 401.

    Args:
        service: the MonitorService (its `auth` and metrics).
    """

    def __init__(self, service: Any) -> None:
        self.service = service

    def intercept_service(self, continuation: Any, details: grpc.HandlerCallDetails) -> Any:
        """The RPC's handler, or one that aborts UNAUTHENTICATED when the token is missing or wrong."""
        handler = continuation(details)
        auth = self.service.auth
        method = str(details.method or "").rsplit("/", 1)[-1]
        if handler is None or auth is None or method in OPEN_METHODS or (
                method in READY_METHODS and not self.service.cfg.mon.auth_readyz):
            return handler
        given = next((v for k, v in details.invocation_metadata or () if k == "authorization"), None)
        if auth.check(given):
            return handler
        service = self.service

        def deny(_request: Any, context: grpc.ServicerContext) -> Any:
            service.metrics.invalid_requests.labels("unauthenticated").inc()
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "unauthenticated: missing or wrong bearer token; send "
                                                           "metadata 'authorization: Bearer <token>'")

        if handler.request_streaming:
            return grpc.stream_unary_rpc_method_handler(deny)
        return grpc.unary_unary_rpc_method_handler(deny)


def start_grpc(service: Any, host: str, port: int, *, max_workers: int = MAX_WORKERS,
               max_concurrent_rpcs: int = MAX_CONCURRENT_RPCS, servicer: InferenceServicer | None = None
               ) -> tuple[grpc.Server, int]:
    """Start the OIP gRPC server for `service` (plaintext; put TLS in front, as for the HTTP port), with the
    service's bearer token required (AuthInterceptor) when it has one.

    Args:
        service: the MonitorService.
        host: bind address.
        port: TCP port (0: any free port).
        max_workers: threads serving RPCs.
        max_concurrent_rpcs: calls in flight at once (memory bound: this x monitoring.max_body_bytes).
        servicer: the InferenceServicer to serve (default: a new one for `service`).

    Returns:
        (the started grpc.Server, the bound port). Stop it with `server.stop(grace)`.

    Raises:
        InputError: the address cannot be bound (exit 2).
    """
    limit = service.max_body_bytes
    server = grpc.server(cf.ThreadPoolExecutor(max_workers, thread_name_prefix="tg-grpc"),
                         interceptors=[AuthInterceptor(service)] if getattr(service, "auth", None) else None,
                         maximum_concurrent_rpcs=max_concurrent_rpcs,
                         options=[("grpc.max_receive_message_length", limit),
                                  ("grpc.max_send_message_length", 1 << 20)])
    server.add_generic_rpc_handlers((handlers(servicer or InferenceServicer(service)),))
    try:
        bound = server.add_insecure_port(f"{host}:{port}")
    except RuntimeError as exc:
        bound, reason = 0, str(exc)
    else:
        reason = "address in use or not available"
    if not bound:
        raise InputError(f"--grpc-port {port}: cannot listen on {host}:{port} ({reason[:200]})",
                         hint="choose a free port, or another --host")
    server.start()
    return server, bound
