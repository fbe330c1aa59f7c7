"""Plain code waiting for a lock on etcd (``held(..., wait=...)``): it watches the lock key and tries
again when it changes, instead of trying again every 20 ms to 0.5 s.

Against the session's private etcd member; the waiter reaches it through the fault proxy, which
counts the waiter's requests (its holder reaches etcd directly).
"""

from __future__ import annotations

import re
import threading
import urllib.request
import uuid

import pytest
from _fault_proxy import FaultProxy

from celery_singleton_lock import held
from celery_singleton_lock.engine.lock import Lock
from celery_singleton_lock.testing.servers import wait_until
from celery_singleton_lock.topologies.etcd import EtcdLockServer

pytestmark = pytest.mark.timeout(60)

TXN, WATCH = b"POST /v3/kv/txn", b"POST /v3/watch"
DEADLINE = 20.0


def new_name() -> str:
    return f"etcd-wait:{uuid.uuid4().hex[:12]}"


def watchers(etcd_server) -> int:
    """The watches the etcd member keeps open now (its own gauge)."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{etcd_server.members[0].client_port}/metrics").read()
    found = re.search(rb"^etcd_debugging_mvcc_watcher_total (\S+)", text, re.M)
    assert found, "the etcd member no longer reports its watchers"
    return int(float(found.group(1)))


@pytest.fixture
def through_proxy(etcd_server):
    proxy = FaultProxy(etcd_server.members[0].client_port)
    server = EtcdLockServer.from_url(f"etcd://127.0.0.1:{proxy.port}")
    try:
        yield proxy, server
    finally:
        server.close()
        proxy.close()


def test_a_waiter_tries_again_once_the_holder_releases_and_not_before(etcd_server, through_proxy):
    """While the key is held, the waiter sends one acquire, then watches; the holder's release wakes it,
    and its second acquire takes the key. Polling sent an acquire every 20 ms doubling to 0.5 s: about
    seven while the holder below keeps the key for 1.5 s after the waiter began to watch."""
    proxy, waiter_server = through_proxy
    holder_server = EtcdLockServer.from_url(etcd_server.url())
    name, got = new_name(), threading.Event()
    first = holder_server.acquire(name, 10, owner_id="holder")
    assert isinstance(first, Lock)
    proxy.count(TXN)
    proxy.count(WATCH)
    fences: list[int] = []

    def wait_for_it() -> None:
        with held(waiter_server, name, 10, wait=DEADLINE, owner_id="waiter") as lock:
            fences.append(lock.fencing_token)
            got.set()

    thread = threading.Thread(target=wait_for_it, daemon=True)
    thread.start()
    try:
        assert not got.wait(1.5), "the waiter took a key that was held"
        assert proxy.seen(WATCH) >= 1, "the waiter never watched the key"
    finally:
        holder_server.release(first)
    assert got.wait(DEADLINE), "the waiter never took the key once it was released"
    thread.join(DEADLINE)
    assert fences and fences[0] > first.fencing_token
    # its failed acquire, its acquire after the release, and at most one more (a watch that ended as
    # the key changed): never one per back-off step
    assert proxy.seen(TXN) <= 3, f"the waiter sent {proxy.seen(TXN)} acquires while it waited"
    holder_server.close()


def test_waiters_woken_together_take_the_key_one_at_a_time(etcd_server, through_proxy):
    """Four plain waiters wake at each release and race for the key: each runs its block once, no two
    blocks overlap, and no watch is left open on etcd."""
    _, server = through_proxy
    name, inside, overlaps, ran = new_name(), [0], [0], []
    guard = threading.Lock()

    def body(i: int) -> None:
        with held(server, name, 10, wait=DEADLINE, owner_id=f"w{i}"):
            with guard:
                inside[0] += 1
                overlaps[0] += inside[0] > 1
            threading.Event().wait(0.05)  # a short hold, so that the others wait in turn
            with guard:
                inside[0] -= 1
                ran.append(i)

    before = watchers(etcd_server)
    threads = [threading.Thread(target=body, args=(i,), daemon=True) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(DEADLINE)
    assert sorted(ran) == [0, 1, 2, 3], f"blocks that ran: {ran}"
    assert overlaps[0] == 0
    # each watch ends with its wait: etcd keeps none of them open
    wait_until(lambda: watchers(etcd_server) <= before, DEADLINE, what="the waiters' watches to end")
