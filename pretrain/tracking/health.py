"""Is the campaign's MLflow server answering now? One quick request, no retries.

MLflow's client retries a request that cannot connect 7 times over about four minutes before it
raises. Training never waits on that: before the campaign's runs are opened, and before each try
of the metrics forwarder during an outage, one ``GET /health`` with a short timeout says whether
MLflow is there; while it is not, training goes on and the runs are opened (and caught up) once
it answers. Only HTTP(S) servers are asked: a local store (``sqlite:///``, a directory) is always
there, and its errors are real ones.
"""

from __future__ import annotations

from mlflow.tracking import MlflowClient
from mlflow.utils.rest_utils import http_request

from pretrain.redact import redact

HEALTH_TIMEOUT_S = 5.0


class MlflowAway(ConnectionError):
    """The campaign's MLflow server does not answer now (transient: an ``OSError``, retried)."""


def mlflow_away(tracking_uri: str | None, client: MlflowClient, timeout_s: float = HEALTH_TIMEOUT_S) -> str | None:
    """Why the MLflow server of ``tracking_uri`` cannot be used now (one line), or None: it
    answered (any answer below 500: a proxy without ``/health`` still answered), or it is not a
    server. Uses the client's own connection settings (TLS, credentials, headers)."""
    if not (tracking_uri or "").lower().startswith(("http://", "https://")):
        return None
    store = client._tracking_client.store  # the REST store: its host, TLS and auth settings
    try:
        response = http_request(
            store.get_host_creds(), "/health", "GET", max_retries=0, timeout=timeout_s, raise_on_status=False
        )
    except Exception as err:  # noqa: BLE001 - cannot connect, timed out, refused by TLS: all say "away"
        return _reason(err)
    if response.status_code >= 500:
        return f"it answers HTTP {response.status_code}"
    return None


def _reason(err: BaseException) -> str:
    text = str(err)
    for cause, words in (
        ("connection refused", "Connection refused"),
        ("timed out", "timed out"),
        ("name not resolved", "Name or service not known"),
        ("TLS failed", "SSL"),
    ):
        if words in text:
            return cause
    return redact((text.strip().splitlines() or [type(err).__name__])[0])[:200]
