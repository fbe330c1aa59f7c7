"""Locks on a real local Redis Cluster: 3 masters with a replica each, built by the test from
private redis-servers (CLUSTER ADDSLOTS / MEET / REPLICATE), stopped by PID.

What it proves: the lock engine routes each script to the master of its slot in one round trip;
the watchdog's batched renewal sends one pipeline per node, one EVALSHA per slot; the waiting
line (with the sweeper's own ``{waiting}`` slot, and plain waiters' wake-up lists) works across
nodes; a slot migration (ASK, TRYAGAIN, then MOVED) and a node failover (MOVED) in the middle of
held locks lose nothing; and the whole task contract passes with a real worker.
"""

from __future__ import annotations

import threading
import time
import uuid

import pytest
from _apps import make_app
from _deployments import RedisClusterDeployment
from _topology_support import check_contract

from celery_singleton_lock.engine import line as queue
from celery_singleton_lock.engine import sweeper as sweeping
from celery_singleton_lock.engine.lock import Holder, Lock, Release
from celery_singleton_lock.exceptions import LockError
from celery_singleton_lock.testing.servers import wait_until
from celery_singleton_lock.topologies import servers
from celery_singleton_lock.topologies.servers import ClusterLockServer
from celery_singleton_lock.watchdog.renewer import Watchdog

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120), pytest.mark.usefixtures("collect_results")]


@pytest.fixture(scope="module")
def cluster():
    with RedisClusterDeployment(masters=3, replicas=1) as deployment:
        yield deployment


@pytest.fixture
def server(cluster):
    srv = servers.from_settings(cluster.url())
    yield srv
    srv.close()


def evalshas(cluster) -> dict[int, int]:
    """EVALSHA calls so far, per node port."""
    return {s.port: s.commandstats().get("evalsha", 0) for s in cluster.servers}


def test_the_url_picks_the_cluster_client_and_one_round_trip_per_operation(cluster, server):
    assert isinstance(server, ClusterLockServer)
    names = [f"op-{i}-{uuid.uuid4().hex[:6]}" for i in range(12)]
    nodes = {cluster.node_for_key("{" + n + "}").port for n in names}
    assert len(nodes) > 1, "the names spread over several masters"
    warm = server.acquire(f"warm-{uuid.uuid4().hex[:6]}", 10)  # its first NOSCRIPT loads the script on every master
    assert isinstance(warm, Lock) and server.renew(warm) and server.release(warm).status is Release.DELETED
    before = evalshas(cluster)
    locks = []
    for name in names:
        lock = server.acquire(name, 10, owner_id=name)
        assert isinstance(lock, Lock)
        locks.append(lock)
    after = evalshas(cluster)
    assert sum(after.values()) - sum(before.values()) == len(names), "one EVALSHA per acquire, on its node"
    other = servers.from_settings(cluster.url())
    held = other.acquire(names[0], 10, owner_id="other")
    assert isinstance(held, Holder) and held.owner_id == names[0]
    assert locks[1].fencing_token > locks[0].fencing_token > 0
    for lock in locks:
        assert server.renew(lock)
        assert server.release(lock).status is Release.DELETED
    assert all(server.holder(n) is None for n in names)
    other.close()


def test_a_new_process_whose_scripts_are_loaded_sends_no_script_load(cluster, server):
    """A prefork child on a Cluster: its first acquire, renewal, batched renewal and release are
    EVALSHAs alone, with no SCRIPT LOAD on any master (the SHA is computed in the process)."""
    names = [f"sha-{i}-{uuid.uuid4().hex[:6]}" for i in range(6)]
    for name in names:  # the scripts loaded, as by an earlier process (NOSCRIPT loads them everywhere)
        lock = server.acquire(name, 10)
        assert isinstance(lock, Lock) and server.renew(lock) and server.renew_many([lock]) == [True]
        assert server.release(lock).status is Release.DELETED
    loads = lambda: sum(s.commandstats().get("script|load", 0) for s in cluster.servers)  # noqa: E731
    before_loads, before = loads(), sum(evalshas(cluster).values())
    new = servers.from_settings(cluster.url())
    assert new is not server
    locks = [new.acquire(name, 10) for name in names]
    assert all(isinstance(lock, Lock) for lock in locks)
    assert all(new.renew(lock) for lock in locks) and all(new.renew_many(locks))
    assert all(new.release(lock).status is Release.DELETED for lock in locks)
    assert sum(evalshas(cluster).values()) - before >= 3 * len(names), "the calls ran"
    assert loads() == before_loads, "no SCRIPT LOAD"
    new.close()


def test_batched_renewal_is_one_pipeline_per_node_and_one_script_per_slot(cluster, server):
    tags = [uuid.uuid4().hex[:6] for _ in range(9)]
    # three locks per hash tag: same slot, so one EVALSHA renews the three
    locks = [server.acquire(f"{{{t}}}:{i}", 10) for t in tags for i in range(3)]
    assert all(isinstance(lock, Lock) for lock in locks)
    slots_per_node: dict[int, set[int]] = {}
    for t in tags:
        slots_per_node.setdefault(cluster.node_for_key("{" + t + "}").port, set()).add(cluster.slot_of("{" + t + "}"))
    twin = server.with_timeout(0.5)
    twin.renew_many(locks)  # loads nothing new: warm
    before = evalshas(cluster)
    assert twin.renew_many(locks) == [True] * len(locks)
    after = evalshas(cluster)
    for port, slots in slots_per_node.items():
        assert after[port] - before[port] == len(slots), f"node {port}: one EVALSHA per slot"
    assert sum(after.values()) - sum(before.values()) == len(tags)
    for lock in locks:
        server.release(lock)
    twin.close()


def test_the_waiting_line_and_the_sweeper_work_across_nodes(cluster, server):
    index = queue.index_key(f"p{uuid.uuid4().hex[:6]}")
    name = f"line-{uuid.uuid4().hex[:6]}"
    assert cluster.slot_of(index) != cluster.slot_of("{" + name + "}")
    holder = server.acquire(name, 1.0, owner_id="holder")
    assert isinstance(holder, Lock)
    entry = queue.new_entry()
    assert queue.park(server, name, entry, kind="t", wait=30, ttl=5, owner_id="waiter", message=b"msg").place == 1
    queue.announce(server, index, name)
    assert queue.line(server, name) == ["waiter"]
    # the holder dies (its lock expires): the sweeper passes the key on
    sweeper = sweeping.Sweeper()
    wait_until(lambda: server.holder(name) is None or server.holder(name).reserved, 10, 0.1, "the lock to expire")
    wait_until(lambda: sweeper.sweep_once(server, index) or server.holder(name).reserved, 10, 0.2, "a hand-off")
    reserved = server.holder(name)
    assert reserved is not None and reserved.reserved and reserved.owner_id == "waiter"
    sweeper.remember(server, name, entry, "waiter", 5, b"msg")  # what a parking process keeps
    claimed = server.acquire(name, 5, owner_id="waiter", entry=entry)
    assert isinstance(claimed, Lock)
    sweeper._prune()  # a pipeline over the cluster: the entry left its line, so it is forgotten
    assert sweeper.parked_count() == 0
    sweeper.stop()
    # a plain waiter blocks on its wake-up list (same slot) and is woken by the release
    got: list[object] = []
    waiter = threading.Thread(target=lambda: got.append(queue.wait_turn(server, name, 5, owner_id="plain", wait=20)))
    waiter.start()
    wait_until(lambda: queue.line(server, name) == ["plain"], 10, 0.02, "the plain waiter to park")
    server.release(claimed)
    waiter.join(20)
    assert isinstance(got[0], Lock) and got[0].owner_id == "plain"
    server.release(got[0])
    assert server.holder(name) is None and queue.line(server, name) == []


def test_a_slot_migration_with_locks_held_loses_nothing(cluster, server):
    """MIGRATING/IMPORTING + MIGRATE + SETSLOT NODE while locks of the slot are held and renewed,
    and new locks of that slot are taken and released: ASK, TRYAGAIN, then MOVED are followed."""
    tag = uuid.uuid4().hex[:6]
    slot = cluster.slot_of("{" + tag + "}")
    source = cluster.node_for_slot(slot)
    target = next(m for m in cluster.masters if m.port != source.port)
    held = [server.acquire(f"{{{tag}}}:held{i}", 3.0, owner_id=f"held{i}") for i in range(5)]
    assert all(isinstance(lock, Lock) for lock in held)
    dog = Watchdog()
    for lock in held:
        dog.track(lock)
    mover = threading.Thread(target=cluster.migrate_slot, args=(slot, target), kwargs={"pause": 0.3, "batch": 3})
    mover.start()
    done, errors = 0, []
    try:
        while mover.is_alive():
            name = f"{{{tag}}}:new{done}"
            try:
                # a new lock's script names keys that do not exist yet: in a MIGRATING slot Redis answers
                # TRYAGAIN until the slot has moved, so it waits out the migration (its TTL allows for it)
                lock = server.acquire(name, 10.0, owner_id=name)
                assert isinstance(lock, Lock)
                assert server.release(lock).status is Release.DELETED
                done += 1
            except LockError as exc:
                errors.append(exc)
            time.sleep(0.02)
        mover.join()
        assert cluster.node_for_slot(slot).port == target.port
        for lock in held:
            assert not lock.lost, lock.lost_reason
            current = server.holder(lock.key)
            assert current is not None and current.owner_id == lock.owner_id
        assert done > 0 and not errors, errors
        renewed_by = [lock.confirmed_at for lock in held]
        wait_until(lambda: all(lk.confirmed_at > t for lk, t in zip(held, renewed_by, strict=True)), 5, 0.05,
                   "a renewal of every lock on the new node")
        assert all(not lock.lost for lock in held)
    finally:
        for lock in held:
            dog.forget(lock)
        dog.shutdown()
    assert all(server.release(lock).status is Release.DELETED for lock in held), "released on the new node"


def test_a_node_failover_with_locks_held_loses_nothing(cluster, server):
    tag = uuid.uuid4().hex[:6]
    master = cluster.node_for_key("{" + tag + "}")
    held = [server.acquire(f"{{{tag}}}:{i}", 3.0, owner_id=f"o{i}") for i in range(3)]
    dog = Watchdog()
    for lock in held:
        assert isinstance(lock, Lock)
        dog.track(lock)
    try:
        promoted = cluster.failover(master)
        assert cluster.node_for_key("{" + tag + "}").port == promoted.port
        renewed_by = [lock.confirmed_at for lock in held]
        wait_until(lambda: all(lk.confirmed_at > t for lk, t in zip(held, renewed_by, strict=True)), 5, 0.05,
                   "a renewal of every lock on the promoted replica (after MOVED)")
        assert all(not lock.lost for lock in held), [lock.lost_reason for lock in held]
        fresh = server.acquire(f"{{{tag}}}:fresh", 3.0)
        assert isinstance(fresh, Lock) and fresh.fencing_token > held[-1].fencing_token
        assert server.release(fresh).status is Release.DELETED
    finally:
        for lock in held:
            dog.forget(lock)
        dog.shutdown()
    assert all(server.release(lock).status is Release.DELETED for lock in held)


def test_the_task_contract_on_a_cluster(cluster, redis_server):
    app = make_app(redis_server, task_default_queue=f"q-{uuid.uuid4().hex[:8]}")
    app.conf.singleton_lock_url = cluster.url()  # broker and results stay on the plain private Redis
    check_contract(app)


def test_parks_lost_with_a_shard_are_sent_again_though_the_index_epoch_did_not_change(cluster, server):
    """The lock's shard loses its data (its master's keys are gone: a shard restarted empty) while the
    sweeper's index, and its epoch, live on another shard and keep theirs. The parking process's
    sweeper still sends the lost park again, marked recovered, within a few of its looks: it does not
    go by the epoch alone, nor prune its backup copy on the epoch's word (the task would stay WAITING)."""
    index = queue.index_key(f"p{uuid.uuid4().hex[:6]}")
    name = next(n for n in (f"shard-{uuid.uuid4().hex[:6]}" for _ in range(100))
                if cluster.node_for_key("{" + n + "}").port != cluster.node_for_key(index).port)
    shard = cluster.node_for_key("{" + name + "}")
    holder = server.acquire(name, 30, owner_id="holder")
    assert isinstance(holder, Lock)
    entry = queue.new_entry()
    assert queue.park(server, name, entry, kind="t", wait=60, ttl=5, owner_id="waiter", message=b"msg").place == 1
    queue.announce(server, index, name)
    sent: list = []
    before = server.send_handoff
    server.send_handoff = lambda srv, handoff: sent.append(handoff) or True
    sweeper = sweeping.Sweeper(interval=0.2)
    try:
        sweeper.remember(server, name, entry, "waiter", 5, b"msg")
        sweeper.watch(server, index)
        wait_until(lambda: sweeper._watched.get((server, index)), 10, 0.05, "the sweeper to learn the epoch")
        epoch = cluster.node_for_key(index).client().get(index + ":epoch")
        shard.client().flushall()  # that shard's data only
        lost_at = time.monotonic()
        wait_until(lambda: [h for h in sent if h.entry == entry], 10, 0.02, "the lost park to be sent again")
        took = time.monotonic() - lost_at
        [again] = [h for h in sent if h.entry == entry]
        assert again.what == "recovered" and again.owner_id == "waiter" and again.message == b"msg"
        assert cluster.node_for_key(index).client().get(index + ":epoch") == epoch  # the epoch saw nothing
        assert took < 0.2 * 1.25 + 2.0
        assert sweeper.parked_count() == 0
    finally:
        sweeper.stop()
        server.send_handoff = before


def test_celery_locks_list_show_and_release_see_every_master(cluster, server, redis_server):
    """A SCAN of one node sees only its keys: ``celery locks`` scans every master, and
    reads and releases each key on the master of its slot."""
    import json

    from celery.bin.base import CLIContext
    from click.testing import CliRunner

    from celery_singleton_lock import LockedTask
    from celery_singleton_lock.ops.cli import locks

    app = make_app(redis_server, singleton_lock_prefix=f"ops{uuid.uuid4().hex[:6]}")
    app.conf.singleton_lock_url = cluster.url()

    @app.task(base=LockedTask, shared=False, name="t.cluster_job")
    def job(n):
        return n

    keys: dict[int, str] = {}  # master port -> a key on it
    args: dict[str, int] = {}
    for n in range(200):
        key = job.lock_key_for([n])
        if cluster.node_for_key(key).port not in keys:
            keys[cluster.node_for_key(key).port] = key
            args[key] = n
        if len(keys) == 3:
            break
    assert len(keys) == 3  # one key on each master
    held_locks = [server.acquire(key, 30.0, owner_id=f"owner-{port}") for port, key in keys.items()]
    assert all(isinstance(lk, Lock) for lk in held_locks)
    runner = CliRunner()
    obj = CLIContext(app=app, no_color=True, workdir=None)
    out = runner.invoke(locks, ["list", "--json"], obj=obj)
    assert out.exit_code == 0, out.output
    assert {row["key"] for row in json.loads(out.output)} == set(keys.values())
    for port, key in keys.items():
        out = runner.invoke(locks, ["show", key], obj=obj)
        assert out.exit_code == 0 and f"held by task owner-{port}" in out.output, out.output
        out = runner.invoke(locks, ["key", "t.cluster_job", "--args", json.dumps([args[key]])], obj=obj)
        assert out.exit_code == 0 and f"held by task owner-{port}" in out.output, out.output
    for key in keys.values():
        out = runner.invoke(locks, ["release", key, "--yes"], obj=obj)
        assert out.exit_code == 0 and "force-released" in out.output, out.output
        assert server.holder(key) is None
    out = runner.invoke(locks, ["list"], obj=obj)
    assert out.exit_code == 0 and "no locks held" in out.output
    for lk in held_locks:
        assert lk.renew() is False


def test_plain_commands_on_a_cluster_that_cannot_be_reached_raise_a_lock_error():
    """redis-py raises RedisClusterException, which is not a RedisError, once no node covers a slot: the
    plain commands beside the scripts (the sweepers' index add, the line's read, a holder's read) say it
    as a LockError (LockBackendUnavailable), which their callers catch, and not as redis-py's own."""
    from celery_singleton_lock.exceptions import LockBackendUnavailable

    with RedisClusterDeployment(masters=3, replicas=0) as cluster:
        server = servers.from_settings(cluster.url())
        key = f"t:{{{uuid.uuid4().hex}}}"
        try:
            queue.announce(server, "idx:{waiting}", key)  # reachable: no error
            for node in cluster.servers:
                node.stop()
            for call in (lambda: queue.announce(server, "idx:{waiting}", key), lambda: queue.line(server, key),
                         lambda: server.holder(key)):
                with pytest.raises(LockBackendUnavailable):
                    call()
        finally:
            server.close()
