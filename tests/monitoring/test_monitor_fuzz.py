"""Bounded property-based fuzzing (hypothesis) of what a client controls: OIP request bodies, JSON and binary tensor
data extension (`monitoring.oip.parse_request`), and the slice keys made from request parameters
(`MonitorConfig.slice_keys` + `clean_label`). Derandomized (a fixed sequence of examples) and without a deadline, so
the run does not depend on the machine's speed."""

import json
import math
import tempfile
from types import SimpleNamespace

import numpy as np
import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from hypothesis.configuration import set_hypothesis_home_dir  # noqa: E402

from tailguard.core.spec import parse_spec  # noqa: E402
from tailguard.monitoring import testing as T  # noqa: E402
from tailguard.monitoring.config import MAX_LABEL_CHARS, clean_label, resolve_config  # noqa: E402
from tailguard.monitoring.ingest import REDACTED, redact_params, redacted_config  # noqa: E402
from tailguard.monitoring.oip import (  # noqa: E402
    MAX_BATCH_ROWS,
    MAX_JSON_DEPTH,
    MAX_PARAMETERS,
    OIP_ITEMSIZE,
    OIP_TO_NUMPY,
    OipError,
    parse_request,
)

set_hypothesis_home_dir(tempfile.mkdtemp(prefix="tg-hypothesis-"))  # its caches stay out of the work tree

FUZZ = settings(max_examples=200, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
SPECS = {"float": [SimpleNamespace(name="x", dtype="float32", shape=["batch", 4])],
         "tokens": [SimpleNamespace(name="ids", dtype="int64", shape=["batch", "seq"]),
                    SimpleNamespace(name="mask", dtype="int64", shape=["batch", "seq"])]}

# text with lone surrogates (JSON escapes them as \udXXX; json.loads gives them back unpaired)
TEXT = st.one_of(st.text(max_size=80), st.text(st.characters(categories=["Cs", "Lu", "Nd", "Po"]), max_size=80),
                 st.sampled_from(["x", "ids", "mask", "domain", "_tg_weight", "", "[[", "\\"]))
NUMBER = st.one_of(st.integers(), st.integers(-(2**80), 2**80), st.floats(allow_nan=True, allow_infinity=True),
                   st.integers(2**1020, 2**1100).map(lambda v: v if v % 2 else -v),  # past float's range
                   st.booleans())
SCALAR = st.one_of(st.none(), NUMBER, TEXT)
JSON = st.recursive(SCALAR, lambda inner: st.one_of(st.lists(inner, max_size=6),
                                                    st.dictionaries(TEXT, inner, max_size=6)), max_leaves=30)
DIM = st.one_of(st.integers(0, 6), st.integers(-2, 2**70), st.sampled_from([2**31, 2**32, 2**62, 2**63, 2**64]))


@st.composite
def tensors(draw):
    """An OIP tensor that is often almost right: a known name, a plausible shape, data of about that size."""
    shape = draw(st.lists(DIM, min_size=0, max_size=4))
    n = math.prod(shape) if shape and all(isinstance(d, int) and 0 <= d <= 64 for d in shape) else draw(
        st.integers(0, 8))
    values = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(-(2**70), 2**70),
                       st.integers(-5, 5), st.booleans(), TEXT)
    flat = draw(st.lists(values, min_size=min(n, 64), max_size=min(n, 64)))
    data = draw(st.sampled_from(["flat", "nested", "json"]))
    if data == "nested" and len(shape) == 2 and all(isinstance(d, int) and 0 < d <= 64 for d in shape):
        flat = [flat[i * shape[1]:(i + 1) * shape[1]] for i in range(shape[0])]
    elif data == "json":
        flat = draw(JSON)
    t = {"name": draw(st.one_of(st.sampled_from(["x", "ids", "mask"]), TEXT)),
         "shape": draw(st.one_of(st.just(shape), JSON)),
         "datatype": draw(st.one_of(st.sampled_from(sorted(OIP_TO_NUMPY)), TEXT)), "data": flat}
    for k in draw(st.lists(st.sampled_from(sorted(t)), max_size=1)):
        del t[k]
    return t


@st.composite
def near_valid(draw):
    """A valid request for one of SPECS with one thing changed (a value, a dimension, the id, a parameter)."""
    which = draw(st.sampled_from(sorted(SPECS)))
    batch, seq = draw(st.integers(1, 3)), draw(st.integers(0, 3))
    inputs = []
    for s in SPECS[which]:
        shape = [batch, 4 if s.dtype == "float32" else seq]
        values = st.floats(-1e3, 1e3) if s.dtype == "float32" else st.integers(0, 1000)
        flat = draw(st.lists(values, min_size=math.prod(shape), max_size=math.prod(shape)))
        inputs.append({"name": s.name, "shape": shape, "datatype": "FP32" if s.dtype == "float32" else "INT64",
                       "data": flat})
    body = {"inputs": inputs, "parameters": {"domain": "web"}, "id": "r1"}
    change = draw(st.sampled_from(["none", "value", "dim", "id", "parameter", "nest"]))
    t = inputs[draw(st.integers(0, len(inputs) - 1))]
    if change == "value" and t["data"]:
        t["data"][draw(st.integers(0, len(t["data"]) - 1))] = draw(st.one_of(SCALAR, JSON))
    elif change == "dim":
        t["shape"][draw(st.integers(0, 1))] = draw(DIM)
        if draw(st.booleans()):
            t["data"] = []
    elif change == "id":
        body["id"] = draw(st.one_of(TEXT, JSON))
    elif change == "parameter":
        body["parameters"][draw(TEXT)] = draw(st.one_of(SCALAR, JSON))
    elif change == "nest" and t["data"]:
        t["data"] = [t["data"]] if draw(st.booleans()) else [[v] for v in t["data"]]
    return which, body


@st.composite
def requests(draw):
    if draw(st.booleans()):
        return draw(near_valid())[1]
    body = {"inputs": draw(st.one_of(st.lists(tensors(), max_size=3), JSON))}
    if draw(st.booleans()):
        body["parameters"] = draw(st.one_of(st.dictionaries(TEXT, SCALAR, max_size=8), JSON))
    if draw(st.booleans()):
        body["id"] = draw(JSON)
    return body


@st.composite
def raw_bodies(draw):
    kind = draw(st.sampled_from(["request", "bytes", "nested", "mutated"]))
    if kind == "bytes":
        return draw(st.binary(max_size=400))
    if kind == "nested":  # deep or almost too deep nesting, brackets inside strings, unbalanced text
        depth = draw(st.sampled_from([MAX_JSON_DEPTH - 3, MAX_JSON_DEPTH, MAX_JSON_DEPTH + 1, 3000]))
        opener = draw(st.sampled_from(['[', '{"a":', '["[", ', '{"inputs": [']))
        closer = {"[": "]", '{"a":': "}", '["[", ': "]", '{"inputs": [': "]}"}[opener]
        return (opener * depth + "1" + closer * draw(st.sampled_from([depth, 0, depth // 2]))).encode()
    text = json.dumps(draw(requests()), allow_nan=True)  # NaN/Infinity literals, \ud800 escapes
    raw = text.encode()
    if kind == "mutated" and raw:
        i = draw(st.integers(0, len(raw) - 1))
        raw = raw[:i] + draw(st.binary(min_size=0, max_size=4)) + raw[i + draw(st.integers(0, 3)):]
    return raw


def _check_accepted(req, specs):
    req.id.encode("utf-8")  # the answer can be encoded
    assert 1 <= req.batch <= MAX_BATCH_ROWS
    assert len(req.parameters) <= MAX_PARAMETERS
    assert set(req.feeds) == {s.name for s in specs}
    for arr in req.feeds.values():
        assert arr.shape[0] == req.batch
        if arr.dtype.kind == "f":
            assert np.isfinite(arr).all()


@FUZZ
@given(body=raw_bodies(), which=st.sampled_from(sorted(SPECS)))
def test_parse_request_raises_only_oip_error_when_raw_body_is_arbitrary(body, which):
    try:
        req = parse_request(body, SPECS[which])
    except OipError as exc:
        assert 400 <= exc.status < 500
        exc.message.encode("utf-8")
        return
    _check_accepted(req, SPECS[which])


@FUZZ
@given(body=requests(), which=st.sampled_from(sorted(SPECS)))
def test_parse_request_raises_only_oip_error_when_decoded_body_is_arbitrary(body, which):
    try:
        req = parse_request(body, SPECS[which], max_batch_rows=8)
    except OipError as exc:
        assert 400 <= exc.status < 500
        exc.message.encode("utf-8")
        return
    _check_accepted(req, SPECS[which])
    assert req.batch <= 8


SLICES = [{"name": "domain", "column": "domain"}, {"name": "len", "column": "n_tokens", "bins": [0, 16, 64, 512]},
          {"name": "tier", "column": "tier", "values": ["gold", "silver", 3]}]
CFG = resolve_config(parse_spec(T.spec_dict({"sample_rate": 0.5, "slice_pairs": True,  # metadata slices only
                                             "slice_columns": ["domain", "len", "tier"]}, slices=SLICES)
                                | {"promotion": {"enabled": False}}))
REDACTED_CFG = redacted_config(CFG, {"domain", "n_tokens"})
PART_MAX = max(len(r.name) for r in CFG.rules) + 1 + MAX_LABEL_CHARS


@FUZZ
@given(params=st.dictionaries(st.one_of(st.sampled_from(["domain", "n_tokens", "tier"]), TEXT), SCALAR,
                              max_size=6))
def test_slice_keys_encode_and_stay_bounded_when_parameters_arbitrary(params):
    body = {"inputs": [{"name": "x", "shape": [1, 4], "datatype": "FP32", "data": [1, 2, 3, 4]}],
            "parameters": params}
    try:  # the live path: only parameters parse_request accepts reach the slice keys
        meta = parse_request(json.dumps(body).encode(), SPECS["float"]).parameters
    except OipError as exc:
        assert exc.reason == "bad_parameters"
        return
    for cfg in (CFG, REDACTED_CFG):
        m = redact_params(meta, frozenset({"domain", "n_tokens"})) if cfg is REDACTED_CFG else meta
        keys, cut = cfg.slice_keys(m)
        assert len(keys) == cfg.keys_per_request and keys[0] == "all" and 0 <= cut <= len(cfg.rules)
        for key in keys:
            key.encode("utf-8")
            assert len(key) <= 2 * PART_MAX + 1
        for key in keys[1:1 + len(cfg.rules)]:
            assert len(key) <= PART_MAX
    assert keys[1] == ("domain=" + REDACTED if meta.get("domain") is not None else "domain=missing")


@FUZZ
@given(text=TEXT | st.text(min_size=60, max_size=300))
def test_clean_label_gives_bounded_utf8_when_text_arbitrary(text):
    clean, changed = clean_label(text)
    clean.encode("utf-8")
    assert len(clean) <= MAX_LABEL_CHARS and changed == (clean != text)
    assert clean_label(clean) == (clean, False)


BINARY_TYPES = sorted(OIP_ITEMSIZE) + ["BYTES"]


@st.composite
def binary_bodies(draw):
    """A binary-extension body (JSON part, then sections) that is often almost right: sections sized from the
    shape and datatype, or a few bytes off; BYTES with well-formed or broken length prefixes; a header length that
    is right, off by a few, past the body or not a number."""
    specs = SPECS[draw(st.sampled_from(sorted(SPECS)))]
    inputs, sections = [], []
    for s in specs:
        shape = draw(st.one_of(st.just([draw(st.integers(0, 3)), 4]), st.lists(DIM, max_size=3)))
        right = "FP32" if s.dtype == "float32" else "INT64"
        dt = right if draw(st.integers(0, 3)) else draw(st.one_of(st.sampled_from(BINARY_TYPES), TEXT))
        n = math.prod(shape) if all(isinstance(d, int) and 0 <= d <= 64 for d in shape) else 0
        if dt == "BYTES":
            raw = b"".join(len(e).to_bytes(4, "little") + e for e in draw(st.lists(st.binary(max_size=6),
                                                                                  min_size=n, max_size=n)))
        else:
            raw = draw(st.binary(min_size=n * OIP_ITEMSIZE.get(dt, 4), max_size=n * OIP_ITEMSIZE.get(dt, 4)))
        if not draw(st.integers(0, 3)):  # a section a byte off, or a BYTES prefix that lies
            raw = draw(st.sampled_from([raw[:-1], raw + b"\0", raw[:3] + b"\xff\xff\xff\x7f" + raw[7:]]))
        size = len(raw) if draw(st.integers(0, 3)) else draw(st.one_of(st.integers(-2, 2**70), JSON))
        t = {"name": s.name, "shape": shape, "datatype": dt, "parameters": {"binary_data_size": size}}
        if draw(st.integers(0, 9)) == 0:
            t["data"] = [0]
        inputs.append(t)
        sections.append(raw)
    text = json.dumps({"inputs": inputs, "parameters": {"domain": "web"}}).encode()
    tail = b"".join(sections) + (b"\0" if not draw(st.integers(0, 7)) else b"")
    header = str(len(text)) if draw(st.integers(0, 3)) else draw(st.one_of(
        st.integers(-3, len(text) + len(tail) + 3).map(str),
        st.sampled_from(["", "abc", "1e3", " 12 ", "99999999999999999999999"])))
    return specs, text + tail, header


@FUZZ
@given(case=binary_bodies())
def test_parse_request_raises_only_oip_error_when_binary_body_is_arbitrary(case):
    specs, body, header = case
    try:
        req = parse_request(body, specs, header=header, max_batch_rows=8)
    except OipError as exc:
        assert 400 <= exc.status < 500
        exc.message.encode("utf-8")
        return
    _check_accepted(req, specs)
    assert req.batch <= 8
