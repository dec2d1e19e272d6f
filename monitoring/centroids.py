"""Where the monitor gets the centroids of its nearest_centroid slices (`topic`): a file (`--centroids`), else the
registered candidate version (`--candidate-version`): the validate run that version was registered from (its tag
tailguard.run_id, else the version's run) holds centroids.npz, which validation fitted on the reference outputs of
the validation set (tailguard.core.derive.fit_centroids), so the monitor's labels are validation's.
"""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path

import numpy as np

from tailguard.core.contract import RUN_ID_TAG
from tailguard.core.derive import CENTROIDS_FILE, load_centroids, monitored_default_slices
from tailguard.core.errors import InputError
from tailguard.core.spec.root import Spec
from tailguard.monitoring.node_check import read_model_version

log = logging.getLogger("tailguard.monitoring")


def needs_centroids(spec: Spec) -> bool:
    """Whether the monitor may track a nearest_centroid slice: a declared one, or the default `topic` of an
    embedding model (monitoring.slice_columns unset, or naming it)."""
    declared = any(s.derive is not None and s.derive.reduce == "nearest_centroid" for s in spec.slices)
    return declared or any(d.derive is not None and d.derive.reduce == "nearest_centroid"
                           for d in monitored_default_slices(spec))


def version_centroids(ref: str, tracking_uri: str | None = None) -> dict[str, np.ndarray]:
    """The centroids logged with the validate run of a registered version.

    Args:
        ref: NAME@ALIAS, NAME/VERSION or models:/... (as `--candidate-version`).
        tracking_uri: the MLflow registry (default: $MLFLOW_TRACKING_URI).

    Returns:
        {slice name: (k, dim) float32}; {} when that run logged none (a spec without nearest_centroid slices).

    Raises:
        InputError: the version cannot be read.
    """
    mv = read_model_version(ref, tracking_uri, hint="name a registered version of the candidate, or pass "
                            "--centroids FILE")
    run_id = (mv.tags or {}).get(RUN_ID_TAG) or mv.run_id
    return run_centroids(run_id, tracking_uri) if run_id else {}


def run_centroids(run_id: str, tracking_uri: str | None = None) -> dict[str, np.ndarray]:
    """The centroids.npz a validate run logged ({} when it logged none).

    Raises:
        InputError: the run or the file cannot be read.
    """
    import mlflow
    from mlflow.exceptions import MlflowException

    client = mlflow.MlflowClient(tracking_uri=tracking_uri, registry_uri=tracking_uri)
    try:
        if CENTROIDS_FILE not in {a.path for a in client.list_artifacts(run_id)}:
            return {}
        with tempfile.TemporaryDirectory() as tmp:
            return load_centroids(client.download_artifacts(run_id, CENTROIDS_FILE, tmp))
    except MlflowException as exc:
        raise InputError(f"run {run_id}: {CENTROIDS_FILE} cannot be read: {str(exc).splitlines()[0]}",
                         hint="pass --centroids FILE") from None


def resolve_centroids(spec: Spec, centroids_file: str | Path | None, candidate_version: str | None,
                      tracking_uri: str | None = None) -> dict[str, np.ndarray]:
    """The monitor's centroids: `centroids_file` when given, else the candidate version's (when the spec may
    need some), else {} (declared nearest_centroid slices then fail resolve_config, naming --centroids; the default
    `topic` is left out).

    Raises:
        InputError: the file or the version cannot be read.
    """
    if centroids_file is not None:
        return load_centroids(str(centroids_file))
    if candidate_version and needs_centroids(spec):
        found = version_centroids(candidate_version, tracking_uri)
        log.info("centroids from %s: %s", candidate_version, sorted(found) or "none logged")
        return found
    return {}
