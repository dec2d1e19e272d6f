"""A variant's stored measurements (the local cache's measurements.npz, issue 36 item 6) carry a digest of their
content, checked on load: an entry changed after it was stored is never decided on (the gate-only re-run falls
back to a full run, a validation measures again) and the run says so. Real cache on disk, real npz files; the
end-to-end re-run is in tests/integration/test_redecide_local.py."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace as NS

import numpy as np
import pytest

from tailguard.components.validate.measurements import MEASUREMENTS_NPZ, Measurements, load_measurements
from tailguard.core.spec import parse_spec
from tailguard.monitoring import testing as T


@pytest.fixture
def stored(tmp_path, monkeypatch):
    """A spec, variant and model file whose measurements were stored in a fresh cache."""
    monkeypatch.setenv("TAILGUARD_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("TAILGUARD_CACHE", "1")
    T.requests_frame(40).to_parquet(tmp_path / "data.parquet")
    spec = parse_spec(T.spec_dict(data_uri=str(tmp_path / "data.parquet")))
    variant = spec.variants[0]
    model = T.linear_classifier(tmp_path / "m.onnx")
    m, save = load_measurements(spec, variant, model, None)
    assert m is not None and m.order is None  # a miss
    outputs = np.arange(40 * 3, dtype=np.float32).reshape(40, 3)
    save(Measurements(order=np.arange(40), block_sizes=[20, 20], outputs=outputs,
                      timing={"variant": {1: {"samples_ms": [1.0, 2.0]}}}, changed=True))
    return NS(spec=spec, variant=variant, model=model, outputs=outputs, home=tmp_path / "home")


def _npz(home: Path) -> Path:
    (found,) = list((home / "cache" / "entries").glob(f"*/files/{MEASUREMENTS_NPZ}"))
    return found


def test_load_measurements_reads_back_what_was_stored_when_the_entry_is_unchanged(stored):
    m, _ = load_measurements(stored.spec, stored.variant, stored.model, None)
    assert m.discarded is None and m.block_sizes == [20, 20]
    np.testing.assert_array_equal(m.outputs, stored.outputs)
    assert m.timing == {"variant": {1: {"samples_ms": [1.0, 2.0]}}}


def test_load_measurements_discards_and_says_so_when_the_outputs_array_was_rolled(stored, capsys):
    npz = _npz(stored.home)
    with np.load(npz) as z:
        arrays = {k: z[k] for k in z.files}
    arrays["outputs"] = np.roll(arrays["outputs"], 1, axis=0)  # the tampering of issue 36 item 6
    np.savez(npz, **arrays)
    m, save = load_measurements(stored.spec, stored.variant, stored.model, None)
    assert m.order is None and m.outputs is None  # nothing of the changed entry is used
    assert "do not match the digest" in m.discarded
    err = capsys.readouterr().err
    assert "measuring again" in err and stored.variant.name in err
    # the fresh measurement replaces it, and is read back
    save(Measurements(order=np.arange(40), block_sizes=[40], outputs=stored.outputs, timing={}, changed=True))
    again, _ = load_measurements(stored.spec, stored.variant, stored.model, None)
    assert again.discarded is None
    np.testing.assert_array_equal(again.outputs, stored.outputs)


def test_redecide_raises_not_decidable_naming_the_digest_when_the_stored_measurements_changed(stored, tmp_path):
    from tailguard.components.redecide.logic import NotDecidable
    from tailguard.components.redecide.task import decide_variant
    from tailguard.core.contract import REFERENCE_FILE

    npz = _npz(stored.home)
    data = bytearray(npz.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one byte changed
    npz.write_bytes(bytes(data))
    (tmp_path / "ref").mkdir()
    (tmp_path / "ref" / REFERENCE_FILE).write_bytes(b"")
    record = {"build": {"status": "ok", "artifact": stored.model.name}, "status": "ok", "model_uri": "models:/m/1",
              "variant_dir": str(stored.model.parent), "reference_dir": str(tmp_path / "ref")}
    with pytest.raises(NotDecidable, match="do not match the digest stored with them"):
        decide_variant(stored.spec, stored.variant, record, tmp_path / "work")
