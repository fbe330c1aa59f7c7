"""etcd's txn pieces for the lock backend (the gateway's JSON), and the acquires in doubt.

An acquire whose reply never came (a timeout; a member paused with the request in hand) may still be
applied later, after its caller has moved on: a retry took the key under another token, ran and
released, and then the late put takes the key on a lease this process keeps alive for its other
locks, where it would stay. Two guards, as the quorum of Redis masters has its tombstones:

* every acquire compares that no tombstone of its own token exists (``not_tombed``), and a retry that
  names the lost attempt's token (``retake``) writes that tombstone in the same txn;
* this process remembers its acquires in doubt (:class:`Doubts`) and settles each soon after (the
  next acquire or renewal round): one txn writes its tombstone and deletes the key if the late put
  did land (only while the value is that attempt's own).

A tombstone lives LATE seconds, on a shared lease (``DoneLeases``).
"""

from __future__ import annotations

import threading
from typing import Any

from ..engine import layout, wire
from ..exceptions import LockError
from .etcd_session import DoneLeases, Transport, b64

LATE = 300.0
"""Seconds a tombstone lives: an acquire applied later than this after it was sent is not guarded."""


def _value(token: str, lease_seconds: float, owner_id: str | None) -> str:
    """The lock key's value: ``"<token> <lease ms> <json: owner, host, pid>"`` (the same bytes again for
    the same token, owner and process: what a release compares)."""
    return f"{token} {int(lease_seconds * 1000)} {wire.meta(owner_id)}"


def _compare_value(key: str, value: str) -> dict[str, Any]:
    return {"key": b64(key), "target": "VALUE", "result": "EQUAL", "value": b64(value)}


def _compare_create(key: str, revision: int) -> dict[str, Any]:
    return {"key": b64(key), "target": "CREATE", "result": "EQUAL", "create_revision": str(revision)}


def _put(key: str, value: str | bytes, lease: int) -> dict[str, Any]:
    return {"request_put": {"key": b64(key), "value": b64(value), "lease": str(lease)}}


def _range(key: str) -> dict[str, Any]:
    return {"request_range": {"key": b64(key)}}


def _kvs(response: dict[str, Any]) -> list[dict[str, Any]]:
    kvs: list[dict[str, Any]] = (response.get("response_range") or {}).get("kvs") or []
    return kvs


def tomb(key: str, token: str) -> str:
    return layout.etcd_tomb(key, token)


def not_tombed(key: str, token: str) -> dict[str, Any]:
    """The compare that makes an acquire a no-op once its token was tombed (see the module doc)."""
    return {"key": b64(tomb(key, token)), "target": "VERSION", "result": "EQUAL", "version": "0"}


class Doubts:
    """This process's acquires whose reply never came: (key, token) -> the value they would have put."""

    def __init__(self) -> None:
        self._items: dict[tuple[str, str], str] = {}
        self._guard = threading.Lock()

    def __bool__(self) -> bool:
        return bool(self._items)

    def add(self, key: str, token: str, value: str) -> None:
        with self._guard:
            self._items[(key, token)] = value

    def forget(self, key: str, token: str) -> None:
        """The attempt's outcome is known after all (a take-back found it)."""
        with self._guard:
            self._items.pop((key, token), None)

    def settle(self, transport: Transport, leases: DoneLeases) -> None:
        """Tomb each attempt in doubt and delete its key where its late put landed: one txn each (a txn
        writes a key once). What fails stays in doubt, for the next call."""
        with self._guard:
            items = list(self._items.items())
        for (key, token), value in items:
            lock_key = layout.etcd_lock(key)
            delete = {"request_delete_range": {"key": b64(lock_key)}}
            try:
                lease = leases.lease_for(transport, LATE)
                landed = {"request_txn": {"compare": [_compare_value(lock_key, value)], "success": [delete]}}
                transport.txn([], [_put(tomb(key, token), b"", lease), landed], [], key)
            except LockError:
                continue
            self.forget(key, token)


def prefix_range(prefix: str, *, limit: int = 0, keys_only: bool = False, count_only: bool = False,
                  by_revision: bool = False) -> dict[str, Any]:
    """A txn's range read of every key under ``prefix`` (the first ``limit``; keys only; a count only;
    oldest created first)."""
    body: dict[str, Any] = {"key": b64(prefix), "range_end": b64(layout.prefix_end(prefix))}
    if limit:
        body["limit"] = str(limit)
    if keys_only:
        body["keys_only"] = True
    if count_only:
        body["count_only"] = True
    if by_revision:
        body.update(sort_order="ASCEND", sort_target="CREATE")
    return {"request_range": body}
