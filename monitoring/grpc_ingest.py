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
its message arrived, which is counted the same way). Memory is bounded by max_concurrent_rpcs x max_body_bytes:
calls past max_concurrent_rpcs are refused by gRPC with RESOURCE_EXHAUSTED (not counted by the monitor).
With a bearer token (monitoring.auth_token_env / auth_token_file), every RPC but ServerLive needs the metadata
`authorization: Bearer <token>` (ServerReady / ModelReady only with monitoring.auth_readyz), else UNAUTHENTICATED
(AuthInterceptor).
"""

from __future__ import annotations

import concurrent.futures as cf
import math
from typing import Any, Iterator, Sequence

import grpc
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc as pb_grpc

from tailguard.core.errors import InputError
from tailguard.monitoring.oip import (OIP_ITEMSIZE, SPEC_TO_OIP, OipError, _binary_shape, check_tensors,
                                      decode_binary, utf8_text)

SERVICE_NAME: str = pb.DESCRIPTOR.services_by_name["GRPCInferenceService"].full_name  # inference.GRPCInferenceService
MAX_WORKERS = 8  # threads serving RPCs (ingest never waits for a model: a few are enough)
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

    def __init__(self, service: Any) -> None:
        self.service = service
        self.model = service.cfg.model_name

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
        """Ingest one request the /infer way (module docstring); served client-streaming, one message read."""
        try:
            request = next(request_iterator)
        except StopIteration:  # a raw client that closed its stream without a message
            self.service.ingest_decoded("grpc", self.model, _no_message)
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "ModelInfer needs one ModelInferRequest message")
        except grpc.RpcError:  # gRPC refused a message over max_receive_message_length (or the client cancelled)
            remaining = context.time_remaining()
            if remaining is None or remaining > 0:
                self.service.refuse_oversized("grpc")
            return pb.ModelInferResponse()  # the call is over: gRPC already sent its status
        status, doc = self.service.ingest_decoded("grpc", request.model_name, lambda: request_body(request, self.service.cfg.inputs))
        if status != 200:
            context.abort(status_code(status), f"{doc['reason']}: {doc['error']}")
        sampled = bool(doc["parameters"]["tailguard.sampled"])
        return pb.ModelInferResponse(model_name=self.model, id=doc["id"],
                                     parameters={"tailguard.sampled": pb.InferParameter(bool_param=sampled)})


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
               max_concurrent_rpcs: int = MAX_CONCURRENT_RPCS) -> tuple[grpc.Server, int]:
    """Start the OIP gRPC server for `service` (plaintext; put TLS in front, as for the HTTP port), with the
    service's bearer token required (AuthInterceptor) when it has one.

    Args:
        service: the MonitorService.
        host: bind address.
        port: TCP port (0: any free port).
        max_workers: threads serving RPCs.
        max_concurrent_rpcs: calls in flight at once (memory bound: this x monitoring.max_body_bytes).

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
    server.add_generic_rpc_handlers((handlers(InferenceServicer(service)),))
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
