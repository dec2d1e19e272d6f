"""Parsing of the HTTP ingest bodies, where it cannot stall the process (issue 36 item 2).

The service's event loop serves /healthz and only reads bodies; each body is parsed on a parse thread
(`MonitorService.parse_pool`). A thread alone does not keep /healthz prompt for large bodies: `json.loads` and the
list-to-array conversion hold the GIL for their whole call (an 8 MiB JSON body of zeros: 0.38 s + 0.21 s on the
2-core AMD EPYC test machine, measured with time.perf_counter), and no other thread of the process runs meanwhile.
So `BodyParser` parses a body of at least `process_bytes` (PROCESS_PARSE_BYTES) in a worker process
(`concurrent.futures.ProcessPoolExecutor`, spawn start method: no fork of a threaded process), and smaller ones in
the calling thread (their GIL holds are short; a child would cost more than it saves). What comes back is arrays,
copied once; the child's temporaries stay in the child.

The parse functions (`parse_body`, `parse_half`) are pure functions of the body and a `ParseLimits`: they run the
same in a thread or a child, and raise only OipError (picklable).
"""

from __future__ import annotations

import concurrent.futures as cf
import multiprocessing
import threading
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

from tailguard.monitoring.oip import (
    InferRequest,
    OipError,
    attach_binary,
    check_tensors,
    load_json,
    parse_request,
    parse_response_output,
    split_binary,
)

# Bodies of at least this many bytes are parsed in a worker process: the largest GIL hold of a parse is about
# 70 ms per MiB on the test machine (an all-zeros JSON body, json.loads + numpy conversion), so a body under
# 512 KiB holds it well under the 100 ms /healthz budget (issue 36 item 2).
PROCESS_PARSE_BYTES = 512 * 1024
PARSE_PROCESSES = 2  # worker processes (started on the first large body)


@dataclass(frozen=True)
class ParseLimits:
    """What a parse checks a body against (picklable: it travels to the worker processes once).

    Attributes:
        inputs: the spec's model.inputs (name, dtype, shape).
        output: the spec's model.outputs[0] (the compared output).
        max_bytes: monitoring.max_body_bytes.
        max_batch_rows: monitoring.max_batch_rows.
    """

    inputs: tuple
    output: Any
    max_bytes: int
    max_batch_rows: int


def parse_body(endpoint: str, body: bytes, header: str | None, limits: ParseLimits
               ) -> tuple[InferRequest, np.ndarray | None]:
    """Parse an /infer or /pairs body.

    Args:
        endpoint: "infer" or "pairs".
        body: the raw body (JSON, or with `header` the binary tensor data extension).
        header: the `Inference-Header-Content-Length` value (None: JSON).
        limits: what to check it against.

    Returns:
        (request, None) for /infer; (request, the live response's compared output, (batch, ...) float) for /pairs.

    Raises:
        OipError: parse_request's and parse_response_output's reasons; `not_an_object` for a pairs body that is
            not {"request": {...}, "response": ...}. Binary sections of request inputs are decoded only after the
            inputs' names and datatypes are checked (`check_tensors`, issue 36 item 10).
    """
    if endpoint != "pairs":
        return _request(body, header, limits), None
    if header is None:
        doc, tail = load_json(body, max_bytes=limits.max_bytes, what="pairs body"), None
    else:
        doc, tail = split_binary(body, header, max_bytes=limits.max_bytes, what="pairs body")
    if not isinstance(doc, dict) or "request" not in doc or "response" not in doc:
        raise OipError("not_an_object", "pairs body must be {\"request\": ..., \"response\": ...}", status=400)
    if not isinstance(doc["request"], dict):
        raise OipError("not_an_object", "pairs body: 'request' must be a JSON object with 'inputs'", status=400)
    response = doc["response"]
    if tail is not None:  # sections: the request's inputs, then the response's outputs
        check_tensors(doc["request"].get("inputs"), limits.inputs)
        outputs = response.get("outputs") if isinstance(response, dict) else None
        attach_binary([doc["request"].get("inputs"), outputs], tail, ["request input", "response output"],
                      decode=[None, _compared(outputs, limits)])
    req = parse_request(doc["request"], limits.inputs, max_bytes=limits.max_bytes,
                        max_batch_rows=limits.max_batch_rows)
    return req, parse_response_output(response, limits.output, req.batch)


def parse_half(half: str, body: bytes, header: str | None, limits: ParseLimits) -> InferRequest | np.ndarray:
    """Parse one payload-logger half: the request as an InferRequest, the response as its compared output.

    Args:
        half: "request" or "response".
        body: the raw half (JSON, or with `header` the binary tensor data extension).
        header: its JSON length (None: JSON).
        limits: what to check it against.

    Returns:
        The InferRequest, or the response's compared output ((rows, ...) float; its rows are checked against the
        request's batch once the pair is joined).

    Raises:
        OipError: the usual ingest reasons (invalid_json, not_an_object, missing_output, the binary ones...).
    """
    if half == "request":
        return _request(body, header, limits)
    if header is None:
        value, tail = load_json(body, max_bytes=limits.max_bytes, what="response body"), None
    else:
        value, tail = split_binary(body, header, max_bytes=limits.max_bytes, what="response body")
    if not isinstance(value, dict):
        raise OipError("not_an_object", "response body must be a JSON object with 'outputs'", status=400)
    if tail is not None:
        outputs = value.get("outputs")
        attach_binary([outputs], tail, ["response output"], decode=[_compared(outputs, limits)])
    if not isinstance(value.get("outputs"), list) or not value["outputs"]:
        raise OipError("missing_output", "response has no 'outputs' list (OIP v2 response)")
    return parse_response_output(value, limits.output, None)


def _request(body: bytes, header: str | None, limits: ParseLimits) -> InferRequest:
    return parse_request(body, limits.inputs, max_bytes=limits.max_bytes, max_batch_rows=limits.max_batch_rows,
                         header=header)


def _compared(outputs: Any, limits: ParseLimits) -> Callable[[str], bool]:
    """Which response outputs' binary sections are decoded: the compared one (by name, or the only one); the
    others' sections are only measured, never decoded (a BYTES output nobody reads costs nothing)."""
    only = isinstance(outputs, list) and len(outputs) == 1
    return lambda name: only or name == limits.output.name


class BodyParser:
    """Runs a parse function on a body: in the calling thread under `process_bytes`, else in a worker process.

    Thread-safe (the parse threads share it). A worker process that dies (killed for memory) breaks the pool: the
    body is parsed in the calling thread instead, and the next large body starts a fresh pool.

    Args:
        limits: what bodies are checked against (sent to each worker process once).
        process_bytes: bodies of at least this many bytes go to a worker process; None: never (all in-thread).
        processes: worker processes.
    """

    def __init__(self, limits: ParseLimits, *, process_bytes: int | None = PROCESS_PARSE_BYTES,
                 processes: int = PARSE_PROCESSES) -> None:
        self.limits = limits
        self.process_bytes = process_bytes
        self.processes = int(processes)
        self.in_process = 0  # bodies parsed in a worker process (tests, /metrics-free accounting)
        self._pool: cf.ProcessPoolExecutor | None = None
        self._lock = threading.Lock()
        self._closed = False

    def run(self, fn: Callable[..., Any], *args: Any, size: int) -> Any:
        """`fn(*args, limits)`, for a body of `size` bytes.

        Raises:
            OipError: whatever `fn` raises.
        """
        if self.process_bytes is None or size < self.process_bytes:
            return fn(*args, self.limits)
        pool = self._get_pool()
        if pool is None:
            return fn(*args, self.limits)
        try:
            future = pool.submit(_in_child, fn, args)
        except (BrokenProcessPool, RuntimeError):  # broken, or shut down by close() meanwhile
            return self._after_break(pool, fn, args)
        with self._lock:
            self.in_process += 1
        try:
            return future.result()
        except BrokenProcessPool:
            return self._after_break(pool, fn, args)

    def _after_break(self, pool: cf.ProcessPoolExecutor, fn: Callable[..., Any], args: Sequence[Any]) -> Any:
        """A worker process died (or the pool closed): forget the pool, parse this body in the calling thread."""
        with self._lock:
            if self._pool is pool:
                self._pool = None
        return fn(*args, self.limits)

    def _get_pool(self) -> cf.ProcessPoolExecutor | None:
        with self._lock:
            if self._closed:
                return None
            if self._pool is None:
                self._pool = cf.ProcessPoolExecutor(self.processes, mp_context=multiprocessing.get_context("spawn"),
                                                    initializer=_init_child, initargs=(self.limits,))
            return self._pool

    def close(self) -> None:
        """Stop the worker processes (queued parses are cancelled)."""
        with self._lock:
            self._closed = True
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)


_CHILD_LIMITS: ParseLimits | None = None


def _init_child(limits: ParseLimits) -> None:
    global _CHILD_LIMITS
    _CHILD_LIMITS = limits


def _in_child(fn: Callable[..., Any], args: Sequence[Any]) -> Any:
    return fn(*args, _CHILD_LIMITS)
