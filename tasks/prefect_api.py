"""Waiting for a Prefect API that is away (a server restarting, a network cut) at the points
that cannot go on without it. Tasks run with client-side orchestration and a stage's training
and checkpoint validation go on while the API is away; a flow run's end (and a subflow's start)
is a request to it, which Prefect's client retries for about a minute. Before a stage's flow run
ends, :func:`wait_for_api` waits longer than that, so that an outage that outlasts the job costs
time, not the campaign."""

from __future__ import annotations

import time

import httpx

FIRST_WAIT_S, LONGEST_WAIT_S = 1.0, 30.0


def answers(url: str) -> bool:
    """Anything answers at ``url``'s ``/health`` (an HTTP error too: a server that refuses is there)."""
    try:
        httpx.get(f"{url.rstrip('/')}/health", timeout=5.0)
    except httpx.TransportError:
        return False
    return True


def wait_for_api(logger, within_s: float, what: str) -> bool:
    """Wait (backing off from 1 s to 30 s) until the configured Prefect API answers, at most
    ``within_s``; ``what`` says what waits, in its one log line. True: it answers (or there is no
    server to ask: an in-process API)."""
    from prefect.settings import PREFECT_API_URL

    url = PREFECT_API_URL.value()
    if not url or answers(url):
        return True
    logger.warning("the Prefect API (%s) is not answering: %s waits for it, up to %.0fs", url, what, within_s)
    deadline, wait = time.monotonic() + within_s, FIRST_WAIT_S
    while (left := deadline - time.monotonic()) > 0:
        time.sleep(min(wait, left))  # backs off between probes of an API that is away
        if answers(url):
            logger.info("the Prefect API answers again")
            return True
        wait = min(2 * wait, LONGEST_WAIT_S)
    logger.warning(
        "the Prefect API did not answer within %.0fs: the run fails here; run the same command again "
        "once it answers (training resumes from the checkpoints)",
        within_s,
    )
    return False
