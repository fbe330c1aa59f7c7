"""A LockedTask duplicate scenario with RabbitMQ as the broker (results and locks on the
private Redis). Skipped when nothing accepts connections on 127.0.0.1:5672. Uses a queue of
its own, deleted at the end."""

from __future__ import annotations

import gc
import uuid

import pytest
from _task_support import TIMEOUT, Gates, Runs, TaskEvents, assert_no_overlap, locked, rabbit_up
from celery import Celery
from celery.exceptions import TaskRevokedError

pytestmark = [pytest.mark.timeout(90), pytest.mark.usefixtures("collect_results")]

AMQP_URL = "amqp://guest:guest@127.0.0.1:5672//"


@pytest.mark.skipif(not rabbit_up(), reason="RabbitMQ: nothing accepts connections on 127.0.0.1:5672")
def test_duplicates_over_rabbitmq(redis_server, run_worker):
    queue = f"csl-test-{uuid.uuid4().hex[:10]}"
    app = Celery(f"amqp{uuid.uuid4().hex[:6]}", broker=AMQP_URL, backend=redis_server.url(1), set_as_current=False)
    app.conf.update(
        singleton_lock_url=redis_server.url(2), singleton_lock_retry_backoff=0.05,
        singleton_lock_retry_backoff_max=0.2, task_default_queue=queue, worker_hijack_root_logger=False,
        broker_connection_retry_on_startup=True, result_expires=None,
        broker_heartbeat=0,  # else the in-process worker's shutdown waits ~10 s on the heartbeat
    )
    runs, gates = Runs(), Gates()

    @locked(app, lock_key=["k"], on_duplicate="skip")
    def skip_job(self, k, tag):
        return runs.gated(k, self.request.id, tag, gates)

    @locked(app, lock_key=["k"], on_duplicate="retry", lock_max_retries=10_000)
    def retry_job(self, k, tag):
        return runs.gated(k, self.request.id, tag, gates)

    try:
        with TaskEvents(app) as rec, run_worker(app, pool="threads", concurrency=4):
            # skip: REVOKED at once, naming the key and the holder
            k = f"amqp-{uuid.uuid4().hex[:8]}"
            holder = skip_job.delay(k, "holder")
            runs.wait_started(k)
            dup = skip_job.delay(k, "dup")
            with pytest.raises(TaskRevokedError) as info:
                dup.get(timeout=TIMEOUT)
            assert holder.id in str(info.value) and skip_job.lock_key_for((k, ""), {}) in str(info.value)
            assert not holder.ready()
            gates.open(k)
            assert holder.get(timeout=TIMEOUT) == "holder"
            assert [r.task_id for r in runs.of(k)] == [holder.id]
            # retry: runs after the holder, not beside it
            k2 = f"amqp-{uuid.uuid4().hex[:8]}"
            holder2 = retry_job.delay(k2, "holder")
            runs.wait_started(k2)
            dups = [retry_job.delay(k2, f"d{i}") for i in range(2)]
            rec.wait_for("duplicate_skipped", task_id=dups[0].id)
            gates.open(k2)
            assert holder2.get(timeout=TIMEOUT) == "holder"
            assert sorted(d.get(timeout=TIMEOUT) for d in dups) == ["d0", "d1"]
            assert len(runs.of(k2)) == 3
            assert_no_overlap([(r.start, r.end) for r in runs.of(k2)])
    finally:
        gates.open_all()
        with app.connection_for_write() as conn:
            conn.default_channel.queue_delete(queue)
        gc.collect()
