"""Conditional writes and the lease built on them, on a local directory and on real S3 servers
(SeaweedFS, moto) on 127.0.0.1. Races start together at a barrier; expiry is judged on clocks the
tests set (a contender whose clock is past the holder's expiry), so no test sleeps out a TTL.
"""

from __future__ import annotations

import multiprocessing
import threading
import uuid

import pytest

from pretrain.state.lease import Lease, LeaseDamaged, LeaseHeld, LeaseLost, current_generation
from support import s3_servers
from support.campaigns import wait_for
from support.s3_servers import ACCESS_KEY, BUCKET, SECRET_KEY
from trainer.storage import LocalStorage, PreconditionFailed, StorageError
from trainer.storage.s3 import S3Storage

seaweed, moto, moto_factory = s3_servers.seaweed, s3_servers.moto, s3_servers.moto_factory

KEY = "campaign/lease.json"
TTL, MARGIN = 30.0, 5.0


def s3_storage(endpoint: str, **kw) -> S3Storage:
    return S3Storage(
        BUCKET,
        f"lease/{uuid.uuid4().hex[:12]}",
        endpoint_url=endpoint,
        region="us-east-1",
        access_key=ACCESS_KEY,
        secret_key=SECRET_KEY,
        **kw,
    )


@pytest.fixture(params=["local", "seaweed", "moto"])
def store(request, tmp_path):
    return _store(request, tmp_path, request.param)


@pytest.fixture(params=["local", "seaweed"])
def atomic_store(request, tmp_path):
    """Stores whose conditional writes are atomic under concurrent requests, as S3's are.
    moto_server is not: its If-Match / If-None-Match check reads the object and the write follows
    with no lock between them (moto 5.2 ``S3Response.put_object``, served by a threaded werkzeug),
    so two racing writes can both pass; races are tested where the check is real."""
    return _store(request, tmp_path, request.param)


def _store(request, tmp_path, kind: str):
    if kind == "local":
        return LocalStorage(tmp_path / "root")
    return s3_storage(request.getfixturevalue(kind).endpoint)


class Clock:
    """A wall clock a test moves by hand (one per contender: their clocks may differ)."""

    def __init__(self, t: float = 1_000_000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


def acquire(store, holder: str, clock: Clock | None = None, **kw) -> Lease:
    return Lease.acquire(store, KEY, holder, ttl_s=TTL, margin_s=MARGIN, clock=clock or Clock(), **kw)


# --- conditional writes ------------------------------------------------------------------


def test_put_if_absent_creates_once_and_never_overwrites(store):
    etag = store.put_if_absent("a/k", b"first")
    with pytest.raises(PreconditionFailed):
        store.put_if_absent("a/k", b"second")
    assert store.get_versioned("a/k") == (b"first", etag)
    assert store.list("a") == ["a/k"]  # no temporary or lock file shows


def test_put_if_match_replaces_only_the_version_read(store):
    store.put_if_absent("k", b"v1")
    _, v1 = store.get_versioned("k")
    v2 = store.put_if_match("k", b"v2", v1)
    assert store.get_versioned("k") == (b"v2", v2) and v2 != v1
    with pytest.raises(PreconditionFailed):  # a writer still holding v1 lost the race
        store.put_if_match("k", b"stale", v1)
    with pytest.raises(PreconditionFailed):  # a key that is gone counts as changed
        store.put_if_match("missing", b"x", v1)
    assert store.get_bytes("k") == b"v2" and not store.exists("missing")
    assert store.list() == ["k"]


# --- the lease ---------------------------------------------------------------------------


def test_two_contenders_one_holder_and_the_refusal_names_it(store):
    first = acquire(store, "orchestrator A")
    with pytest.raises(LeaseHeld, match=r"held by orchestrator A \(generation 1.*wait for that run"):
        acquire(store, "orchestrator B")
    assert first.generation == 1 and first.valid() and current_generation(store, KEY) == 1


def test_renew_keeps_the_lease_past_its_first_expiry(store):
    clock_a = Clock()
    lease = acquire(store, "A", clock_a)
    clock_a.t += TTL - 1
    lease.renew()
    later = Clock(clock_a.t + 2)  # past the first expiry (+ margin), before the renewed one
    with pytest.raises(LeaseHeld, match="held by A"):
        acquire(store, "B", later)
    assert lease.generation == 1 and current_generation(store, KEY) == 1


def test_expiry_lets_another_take_over_and_the_old_holder_learns_it_lost(store):
    old = acquire(store, "A", Clock())
    with pytest.raises(LeaseHeld):  # expired, but within the clock-skew margin: not yet
        acquire(store, "B", Clock(old.record.expires_at + MARGIN - 0.5))
    new = acquire(store, "B", Clock(old.record.expires_at + MARGIN + 1))
    assert new.generation == old.generation + 1 == 2
    assert current_generation(store, KEY) == 2
    with pytest.raises(LeaseLost, match=r"lost the lease .*generation 1.*held by B \(generation 2"):
        old.renew()
    with pytest.raises(LeaseLost, match=r"lost the lease .*generation 1.*held by B \(generation 2.*must not write"):
        old.check()  # what a commit of the old holder runs first
    new.check()
    assert old.release() is False  # releasing a lost lease must not free the new holder's
    with pytest.raises(LeaseHeld, match="held by B"):
        acquire(store, "C", Clock(old.record.expires_at + MARGIN + 1))


def test_release_frees_the_lease_and_the_generation_still_grows(store):
    lease = acquire(store, "A")
    assert lease.release() is True and not lease.valid()
    successor = acquire(store, "B")  # same clock: released, not expired
    assert successor.generation == 2
    with pytest.raises(LeaseLost, match="released"):
        lease.renew()


@pytest.mark.parametrize(
    "content, why",
    [
        (b"\x00\xffgarbage", "not JSON"),
        (b"[1, 2]\n", "not a pretrain-lease/1 record"),
        (b'{"format": "other/1"}', "not a pretrain-lease/1 record"),
        (b'{"format": "pretrain-lease/1", "holder": "A"}', "missing field"),
        (
            b'{"format": "pretrain-lease/1", "holder": "A", "generation": 0, "token": "t", "expires_at": 1, "ttl_s": '
            b"1}",
            "generation 0",
        ),
        (
            b'{"format": "pretrain-lease/1", "holder": "A", "generation": "2", "token": "t", "expires_at": 1, '
            b'"ttl_s": 1}',
            "generation as a string",
        ),
    ],
)
def test_a_damaged_lease_is_refused_by_name_and_left_alone(store, content, why):
    store.put_if_absent(KEY, content)
    with pytest.raises(LeaseDamaged) as err:
        acquire(store, "A")
    message = str(err.value)
    assert f"{store.url}/{KEY} is damaged" in message, why
    assert "no run of this campaign is still running" in message and f"delete {store.url}/{KEY}" in message
    assert store.get_bytes(KEY) == content  # nobody took it over


def _contend(store, holder: str, barrier, clock: Clock) -> Lease | LeaseHeld:
    barrier.wait()
    try:
        return acquire(store, holder, clock)
    except LeaseHeld as exc:
        return exc


@pytest.mark.parametrize("expired_lease_first", [False, True], ids=["create", "takeover"])
def test_threads_racing_for_the_lease_leave_exactly_one_holder(atomic_store, expired_lease_first):
    store = atomic_store
    n = 8
    clock = Clock()
    if expired_lease_first:
        old = acquire(store, "dead orchestrator", Clock())
        clock = Clock(old.record.expires_at + MARGIN + 1)
    barrier, results = threading.Barrier(n), [None] * n

    def run(i):
        results[i] = _contend(store, f"contender {i}", barrier, clock)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    winners = [r for r in results if isinstance(r, Lease)]
    assert len(winners) == 1, results
    assert all(isinstance(r, LeaseHeld) for r in results if r is not winners[0])
    assert current_generation(store, KEY) == winners[0].generation == (2 if expired_lease_first else 1)
    winners[0].renew()  # the winner really holds it


def _process_contender(root, i, barrier, queue):
    result = _contend(LocalStorage(root), f"process {i}", barrier, Clock())
    queue.put((i, result.generation if isinstance(result, Lease) else None))


def test_processes_racing_on_a_local_directory_leave_exactly_one_holder(tmp_path):
    n, ctx = 6, multiprocessing.get_context("fork")
    barrier, queue = ctx.Barrier(n), ctx.Queue()
    procs = [ctx.Process(target=_process_contender, args=(tmp_path, i, barrier, queue)) for i in range(n)]
    for p in procs:
        p.start()
    results = dict(queue.get(timeout=60) for _ in procs)
    for p in procs:
        p.join(30)
    assert sorted(results.values(), key=str) == [1] + [None] * (n - 1), results
    assert current_generation(LocalStorage(tmp_path), KEY) == 1


# --- keeping a lease in the background ---------------------------------------------------


def test_the_keeper_renews_and_reports_a_takeover_once(store):
    clock = Clock()
    lease = acquire(store, "A", clock)
    lost: list[LeaseLost] = []
    with lease.keep(lost.append, interval_s=0.05) as keeper:
        wait_for(lambda: keeper.renewals >= 2, 30, "two renewals")
        clock.t += 10  # renewals now write a later expiry
        wait_for(lambda: current_expiry(store) == clock.t + TTL, 30, "a renewal at the new time")
        # B's clock says A's lease expired (as if A's renewals stopped reaching the storage); a
        # renewal landing between B's read and B's write makes B lose that try, so B tries again
        wait_for(lambda: try_acquire(store, "B", Clock(clock.t + TTL + MARGIN + 1)), 30, "B to take over")
        wait_for(lambda: lost, 30, "the keeper to notice the takeover")
    assert len(lost) == 1 and "held by B (generation 2" in str(lost[0]) and keeper.lost is lost[0]
    assert current_generation(store, KEY) == 2


def try_acquire(store, holder: str, clock: Clock) -> Lease | None:
    try:
        return acquire(store, holder, clock)
    except LeaseHeld:
        return None


def current_expiry(store) -> float:
    import json

    return json.loads(store.get_bytes(KEY))["expires_at"]


def test_the_keeper_gives_the_lease_up_when_storage_stays_away_past_its_expiry(moto_factory):
    server = moto_factory()
    store = s3_storage(server.endpoint, max_attempts=1, connect_timeout=0.5, read_timeout=0.5)
    lease = Lease.acquire(store, KEY, "A", ttl_s=1.0, margin_s=0.5)
    lost: list[LeaseLost] = []
    with lease.keep(lost.append, interval_s=0.1):
        server.kill()
        wait_for(lambda: lost, 30, "the keeper to give up")
    assert "could not renew the lease" in str(lost[0]) and "must stop" in str(lost[0])
    assert not lease.valid()
    with pytest.raises(StorageError, match=f"check that the S3 endpoint {server.endpoint} is up"):
        Lease.acquire(store, KEY, "B", ttl_s=1.0)  # nobody can take a lease it cannot read


@pytest.mark.parametrize("server", ["seaweed", "moto"])
def test_a_write_that_landed_but_whose_answer_was_lost_is_still_the_holders(request, server):
    """S3 clients retry a PUT whose answer did not arrive; the retry of a conditional PUT that had
    landed gets 412. The lease reads the record back and knows its own write by its token."""
    store = s3_storage(request.getfixturevalue(server).endpoint)
    retried: list[str] = []

    def lose_first_answer(attempts, response, **_):  # after a PUT that succeeded: retry it once
        if attempts == 1 and response is not None and response[0].status_code == 200:
            retried.append(response[0].status_code)
            return 0  # botocore: retry after 0 s
        return None

    store.client.meta.events.register("needs-retry.s3.PutObject", lose_first_answer)
    lease = acquire(store, "A")  # If-None-Match: *, then its retry: 412
    lease.renew()  # If-Match, then its retry: 412 (the ETag moved on to our own write)
    assert len(retried) == 2 and lease.valid() and current_generation(store, KEY) == 1
    with pytest.raises(LeaseHeld, match="held by A"):
        acquire(store, "B")
