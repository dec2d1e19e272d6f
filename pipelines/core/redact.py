"""Credentials out of every URI tailguard logs or compiles (issue 22 item 8).

A URI may carry a secret in two places: its userinfo (`https://alice:s3cret@mlflow.example`, `http://KEY:SECRET@minio:9000`,
`https://TOKEN@host`) and its query (`...?X-Amz-Signature=...`, `?sig=...` of an Azure SAS, `?token=...`). The
redacted form keeps the rest (scheme, host, path, the other query parameters) so a log still says where: the
password, a lone userinfo token and the values of credential-like query parameters become `***`.

Where it applies: the spec artifact and the params of the parent MLflow run (components/resolve/task.py), the
compiled KFP IR (`tailguard compile`, `tailguard.pipeline.compile_pipeline`) and the console lines that print a
tracking URI. Runs get credentials from their environment instead (MLFLOW_TRACKING_USERNAME / _PASSWORD /
_TOKEN, AWS_* or workload identity; docs/deploy.md, Trust model).
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import yaml

if TYPE_CHECKING:
    from tailguard.core.spec.root import Spec

MASK = "***"
# Query parameter names whose values are credentials (lower-cased substrings): AWS SigV4 presigned URLs
# (X-Amz-Signature / -Credential / -Security-Token), GCS (X-Goog-Signature / -Credential), Azure SAS (sig),
# and the usual token / key / password names.
_SECRET_PARAM_PARTS = ("signature", "sig", "credential", "token", "secret", "password", "passwd", "pwd", "key",
                       "auth", "session")
# A URI in free text: up to whitespace, a quote, a bracket or angle bracket; trailing punctuation is the sentence's.
_URI = re.compile(r"[A-Za-z][A-Za-z0-9+.\-]*://[^\s'\"<>()]*[^\s'\"<>().,;:]")


def _secret_param(name: str) -> bool:
    n = name.lower()
    return any(part in n for part in _SECRET_PARAM_PARTS)


def redact_uri(uri: str) -> str:
    """`uri` with its credentials replaced by `***` (userinfo password or lone token, credential-like query values).

    Args:
        uri: any string; one without "://" is returned unchanged.

    Returns:
        The redacted URI (unchanged when it carries no credentials).
    """
    if not isinstance(uri, str) or "://" not in uri:
        return uri
    try:
        parts = urlsplit(uri)
    except ValueError:  # e.g. an invalid IPv6 netloc: mask everything after the scheme
        return uri.split("://", 1)[0] + "://" + MASK
    netloc = parts.netloc
    if "@" in netloc:
        userinfo, host = netloc.rsplit("@", 1)
        user, sep, _ = userinfo.partition(":")
        netloc = f"{user}:{MASK}@{host}" if sep else f"{MASK}@{host}"
    query = parts.query
    if query:
        pairs = parse_qsl(query, keep_blank_values=True)
        if any(_secret_param(k) for k, _ in pairs):
            query = urlencode([(k, MASK if _secret_param(k) else v) for k, v in pairs], safe="*")
    if (netloc, query) == (parts.netloc, parts.query):
        return uri
    return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))


def redact_text(text: str) -> str:
    """Every URI inside free text (a log line, an error message) passed through `redact_uri`."""
    return _URI.sub(lambda m: redact_uri(m.group(0)), text) if "://" in text else text


def redact_doc(obj: Any) -> Any:
    """A copy of a JSON-like document (dicts, lists, scalars) with every string holding a URI redacted."""
    if isinstance(obj, str):
        return redact_text(obj)
    if isinstance(obj, dict):
        return {k: redact_doc(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [redact_doc(v) for v in obj]
    return obj


def redact_spec_yaml(text: str) -> str:
    """Spec YAML with every URI redacted; the text itself when nothing needed it (byte-identical then)."""
    doc = yaml.safe_load(text)
    clean = redact_doc(doc)
    return text if clean == doc else yaml.safe_dump(clean, sort_keys=False)


def redacted_spec(spec: Spec) -> Spec:
    """A copy of a validated Spec whose every URI field is redacted (the spec itself when none needed it).

    Raises:
        SpecError: never for a valid spec (redaction keeps every URI well-formed).
    """
    from tailguard.core.spec import dump_spec, spec_from_yaml

    text = dump_spec(spec)
    clean = redact_spec_yaml(text)
    return spec if clean is text else spec_from_yaml(clean)
