"""Re-sends keep their identity: each budget has its own counter (our back-off re-sends, the task's own
retries), and a re-send after a lost acquire reply retakes its own orphan lock.

Against a real redis-server and a real Celery worker; the lock Redis stalls by SIGSTOP. Timing bounds
are deadlines for "does not hang", never benchmarks.
"""

from __future__ import annotations

import threading
import time
import uuid

import pytest
from _apps import make_app
from _task_support import TIMEOUT, Gates, Runs, locked
from celery.signals import before_task_publish, task_prerun

from celery_singleton_lock.delivery.headers import described
from celery_singleton_lock.testing.servers import Monitor, wait_until

pytestmark = [pytest.mark.timeout(60), pytest.mark.usefixtures("collect_results")]


# -- helpers for the worker tests ---------------------------------------------------------------


class Published:
    """The headers of every message our app publishes (before_task_publish), per task id; ours flattened
    by field (``singleton_lock_backoff``, ``singleton_lock_token``, ...), see :func:`ours`."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.sent: list[dict] = []
        self._lock = threading.Lock()

    def __enter__(self) -> Published:
        before_task_publish.connect(self._on_publish, weak=False)
        return self

    def __exit__(self, *exc) -> None:
        before_task_publish.disconnect(self._on_publish)

    def _on_publish(self, sender=None, headers=None, **_):
        if isinstance(sender, str) and sender.startswith(self.prefix) and headers:
            with self._lock:
                self.sent.append({**headers, **ours(headers)})

    def of(self, task_id: str) -> list[dict]:
        with self._lock:
            return [h for h in self.sent if h.get("id") == task_id]


def ours(headers: dict) -> dict:
    return {f"singleton_lock_{k}": v for k, v in described(headers).items()}  # (one flat dict, by field)


# -- a counter per budget: our back-off re-sends, the task's own retries -------------------------


@pytest.mark.timeout(60)
def test_own_retry_after_backoff_resends_starts_afresh_and_counters_are_separate(redis_server, run_worker):
    """A "backoff" duplicate is re-sent twice while the holder runs, then runs and calls
    self.retry(): the retry message carries no singleton_lock_* header (Celery 5.7 copies custom
    headers into retries), so the retried run starts every budget at 0 (Celery's own retries = 1).
    The back-off counter is its own header: a message that already carries
    singleton_lock_unreachable=49 (of 50) still gets its back-off re-sends, and that header is
    carried along untouched, never counted up by a back-off."""
    queue = f"q-{uuid.uuid4().hex[:8]}"
    app = make_app(redis_server, task_default_queue=queue)
    app.conf.update(singleton_lock_retry_backoff=0.3, singleton_lock_retry_backoff_max=0.6)
    gates, runs = Gates(), Runs()
    prefix = f"identity_counters_{uuid.uuid4().hex[:6]}"

    @locked(app, lock_key=["k"], on_duplicate="backoff", lock_max_retries=50, name=f"{prefix}.job")
    def job(self, k, mode):
        headers = dict(self.request.headers or {})
        run = runs.begin(k, self.request.id, mode=mode, retries=self.request.retries, ours=ours(headers))
        try:
            if mode == "hold":
                gates.wait(k)
            elif self.request.retries == 0:
                raise self.retry(countdown=0.1, max_retries=3)
            return mode
        finally:
            runs.end(run)

    k = f"k-{uuid.uuid4().hex[:8]}"
    with Published(prefix) as published, run_worker(app, pool="threads", concurrency=3):
        holder = job.delay(k, "hold")
        runs.wait_started(k)
        dup = job.apply_async((k, "retry-once"), headers={"singleton_lock_unreachable": 49})
        wait_until(lambda: any(h.get("singleton_lock_backoff") == 2 for h in published.of(dup.id)), TIMEOUT,
                   what="the duplicate's second back-off re-send")
        gates.open(k)
        assert dup.get(timeout=TIMEOUT) == "retry-once"
        assert holder.get(timeout=TIMEOUT) == "hold"

    sends = published.of(dup.id)
    resends = [h for h in sends if h.get("retries", 0) == 0 and "singleton_lock_backoff" in h]
    assert [h["singleton_lock_backoff"] for h in resends] == list(range(1, len(resends) + 1))
    assert len(resends) >= 2
    assert all(h.get("singleton_lock_unreachable") == 49 for h in resends)  # carried, never counted up
    retry = [h for h in sends if h.get("retries") == 1]
    assert len(retry) == 1, sends
    assert not [h for h in retry[0] if h.startswith("singleton_lock_")], f"the retry carries lock headers: {retry[0]}"
    dup_runs = runs.of(k, dup.id)
    assert [(r.info["mode"], r.info["retries"]) for r in dup_runs] == [("retry-once", 0), ("retry-once", 1)]
    first, retried = dup_runs
    assert first.info["ours"].get("singleton_lock_backoff") == len(resends)  # it did come through back-offs
    assert retried.info["ours"] == {}  # every lock budget starts at 0 again


# -- a reply lost on a socket timeout: the re-send retakes its own orphan lock ---------------------


@pytest.mark.timeout(60)
def test_resend_after_a_lost_acquire_reply_retakes_its_orphan_lock(fresh_redis, redis_server, run_worker):
    """The lock Redis (not the broker's) stalls right as a task's acquire is sent: the client
    times out (socket_timeout 0.3 s, no client retries), then Redis wakes and runs the acquire
    late, leaving a lock under the task's own id that nobody holds. The re-sent copy carries that
    attempt's token (header singleton_lock_token) and retakes it: it runs once, at once, far
    sooner than the orphan's lock_ttl of 30 s."""
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    queue = f"q-{uuid.uuid4().hex[:8]}"
    app = make_app(redis_server, task_default_queue=queue)
    app.conf.singleton_lock_url = fresh_redis.url(2)
    app.conf.singleton_lock_redis_options = {"socket_timeout": 0.3, "retry": Retry(NoBackoff(), 0)}
    runs = Runs()
    prefix = f"identity_orphan_{uuid.uuid4().hex[:6]}"

    @locked(app, lock_key=["k"], lock_ttl=30, name=f"{prefix}.job")
    def job(self, k):
        runs.begin(k, self.request.id, token=self.lock.token)
        return k

    target = str(uuid.uuid4())
    stalled = threading.Event()

    def stall_lock_redis(task_id=None, **_):
        if task_id == target and not stalled.is_set():
            stalled.set()
            fresh_redis.pause()  # the acquire is sent right after this, into a frozen server
            threading.Timer(0.6, fresh_redis.resume).start()

    task_prerun.connect(stall_lock_redis, weak=False)
    try:
        with Published(prefix) as published, run_worker(app, pool="threads", concurrency=2):
            assert job.delay("warm").get(timeout=TIMEOUT) == "warm"  # connections and scripts in place
            with Monitor(fresh_redis, db=2) as mon:
                started = time.monotonic()
                result = job.apply_async(("k",), task_id=target)
                assert result.get(timeout=TIMEOUT) == "k"
                took = time.monotonic() - started
                mon.sync()
                sent = mon.commands()
    finally:
        task_prerun.disconnect(stall_lock_redis)
        if fresh_redis.paused:
            fresh_redis.resume()
    assert stalled.is_set()
    assert [r.task_id for r in runs.of("k")] == [target]  # once
    assert took < 10.0  # at once: not after the orphan's 30 s ttl ran out
    resends = [h for h in published.of(target) if "singleton_lock_token" in h]
    assert resends, "the acquire never timed out: the scenario did not run"
    [lost] = {h["singleton_lock_token"] for h in resends}  # the lost attempt's token, carried
    assert all(h.get("singleton_lock_unreachable", 0) >= 1 for h in resends)
    acquires = [w for w in sent if w[0].upper() in ("EVALSHA", "SET") and any(word.startswith(lost) for word in w)]
    assert len(acquires) >= 2, "the timed-out acquire never ran late on Redis: no orphan to retake"
    # taken back under a new token: no second message carrying the old one can take it back too
    assert runs.of("k")[0].info["token"] != lost
