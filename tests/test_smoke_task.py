
from celery_singleton_lock import LockedTask


def test_locked_task_runs_and_releases(app, run_worker, redis_server):
    ran = []

    @app.task(base=LockedTask, bind=True, lock_ttl=5)
    def add(self, x, y=2):
        ran.append(self.lock.fencing_token)
        return x + y

    with run_worker(app):
        assert add.delay(1).get(timeout=10) == 3
    assert ran and ran[0] > 0
    key = add.lock_key_for((1,), {})
    assert redis_server.client(2).exists(key) == 0
    assert add.lock_key_for((1,), {}) == add.lock_key_for((), {"x": 1, "y": 2})
