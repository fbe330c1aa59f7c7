"""Plain code's line (section 6 of the hand-off tests): ``held(server, name, ttl, wait=...)`` goes in
FIFO order, woken by the release; a waiter whose wait runs out raises and leaves the line; a SIGKILLed
holder lets the waiters in within its TTL.

Against a real redis-server; the hand-off latencies are printed, not asserted.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import uuid

import pytest
from _handoff_support import note, report
from _task_support import ROOT, TIMEOUT

from celery_singleton_lock import LockContended, LockServer, held
from celery_singleton_lock.engine.line import LONGEST_BLOCK
from celery_singleton_lock.engine.lock import slot_safe
from celery_singleton_lock.testing.servers import wait_until

pytestmark = [pytest.mark.timeout(150), pytest.mark.usefixtures("collect_results")]


# -- 6. plain code: held(server, name, ttl, wait=...) -------------------------------------------------


def start_waiters(server: LockServer, name: str, count: int, *, wait: float, hold: float, out: list):
    """``count`` threads waiting on ``name``, started one at a time (each once the previous one is in
    line); each appends (tag, entered, leaving, fencing token) to ``out`` or (tag, the exception)."""
    key = slot_safe(name)
    client = server.client
    threads = []
    for i in range(count):
        tag = f"w{i}"

        def body(tag=tag):
            try:
                with held(server, name, ttl=30, wait=wait) as lock:
                    entered = time.monotonic()
                    time.sleep(hold)
                    out.append((tag, entered, time.monotonic(), lock.fencing_token))
            except Exception as exc:
                out.append((tag, exc))

        t = threading.Thread(target=body, daemon=True, name=f"waiter-{tag}")
        t.start()
        threads.append(t)
        wait_until(lambda: client.llen(key + ":q") >= len(threads), TIMEOUT, 0.002, f"{tag} to be in line")
    return threads


@pytest.mark.timeout(60)
def test_plain_waiters_go_in_fifo_order_woken_by_the_release(plain_server, capsys):
    """Threads waiting on one key get it in the order they started waiting, each woken by the release
    that hands it the key: much sooner than the holder's 30 s TTL, and than LONGEST_BLOCK (the
    longest a waiter sleeps between two looks of its own)."""
    name = f"plain-fifo-{uuid.uuid4().hex[:8]}"
    key = slot_safe(name)
    out: list = []
    with held(plain_server, name, ttl=30) as first:
        first_fence = first.fencing_token  # (read while held: a fresh lock's token is drawn on first read)
        threads = start_waiters(plain_server, name, 20, wait=30, hold=0.01, out=out)
        released_at = time.monotonic()
    for t in threads:
        t.join(TIMEOUT)
    assert all(len(x) == 4 for x in out), out
    assert [x[0] for x in out] == [f"w{i}" for i in range(20)]  # first come, first served
    fences = [first_fence, *(x[3] for x in out)]
    assert fences == sorted(fences) and len(set(fences)) == len(fences)
    gaps = [out[0][1] - released_at] + [nxt[1] - prev[2] for prev, nxt in zip(out, out[1:], strict=False)]
    assert max(gaps) < LONGEST_BLOCK / 2, f"a waiter was not woken by the release: gaps {gaps}"
    assert not plain_server.client.exists(key, key + ":q", key + ":w")
    assert not list(plain_server.client.scan_iter(match=key + ":wake:*"))
    report(capsys, "plain held() threads, one process", gaps)


@pytest.mark.timeout(60)
def test_plain_waiter_whose_wait_runs_out_raises_and_leaves_the_line(plain_server):
    name = f"plain-timeout-{uuid.uuid4().hex[:8]}"
    key = slot_safe(name)
    client = plain_server.client
    out: list = []
    with held(plain_server, name, ttl=30):
        [patient] = start_waiters(plain_server, name, 1, wait=30, hold=0.0, out=out)
        started = time.monotonic()
        with pytest.raises(LockContended) as info:
            with held(plain_server, name, ttl=30, wait=0.5):
                pytest.fail("the body ran while the key was held")
        assert time.monotonic() - started >= 0.5
        assert info.value.key == key
        # it left the line: only the patient waiter is still in it, and no wake-up list is left
        assert client.llen(key + ":q") == 1 and client.hlen(key + ":w") == 1
        assert not list(client.scan_iter(match=key + ":wake:*"))
    patient.join(TIMEOUT)
    assert [x[0] for x in out] == ["w0"] and len(out[0]) == 4  # the patient one got it after the release
    assert not client.exists(key, key + ":q", key + ":w")


PLAIN_HOLDER = """
import sys, time
from celery_singleton_lock import LockServer, held
with held(LockServer.from_url(sys.argv[1]), sys.argv[2], ttl=float(sys.argv[3])):
    print("held", flush=True)
    time.sleep(120)
"""


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_plain_holder_killed_lets_the_waiters_in_within_its_ttl(plain_server, redis_server, capsys):
    """A process SIGKILLed while it holds the key through held(): nobody releases, so the waiters
    look again when its lock would expire, and go in, in order, within its TTL (plus a little)."""
    name = f"plain-dead-{uuid.uuid4().hex[:8]}"
    key = slot_safe(name)
    client = plain_server.client
    ttl = 3.0
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen([sys.executable, "-c", PLAIN_HOLDER, redis_server.url(2), name, str(ttl)],
                            stdout=subprocess.PIPE, env=env, text=True)
    out: list = []
    try:
        assert proc.stdout.readline().strip() == "held"
        threads = start_waiters(plain_server, name, 3, wait=30, hold=0.05, out=out)
        time.sleep(ttl / 2)  # let the holder's watchdog renew at least once: it must not matter
        os.kill(proc.pid, signal.SIGKILL)  # our own subprocess, by PID
        proc.wait(10)
        killed_at = time.monotonic()  # also before the PTTL: a stall after its reply must not move the expiry later
        pttl = client.pttl(key)
        assert 0 < pttl <= ttl * 1000
        expires_at = killed_at + pttl / 1000
        for t in threads:
            t.join(TIMEOUT)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert [x[0] for x in out] == ["w0", "w1", "w2"] and all(len(x) == 4 for x in out), out
    assert out[0][1] >= expires_at - 0.25  # not while the dead holder's lock lived
    assert out[-1][1] - killed_at <= ttl + 2.0  # within its TTL, plus a little
    assert not client.exists(key, key + ":q", key + ":w")
    note(capsys, f"plain holder SIGKILLed: its lock expired -> first waiter in {out[0][1] - expires_at:.3f} s")
