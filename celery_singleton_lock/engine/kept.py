"""A script call sent twice answers as the first did: its reply is kept under the call's request id.

The rule for every call to the lock Redis: it is safe to send twice, or it is never sent again.
A connection can break after Redis ran a script and before its reply came back (a reset, a proxy
or sidecar restart, ``CLIENT KILL``). The client then sends the call once more on a new connection,
and that second send must not be read as a new call: a claim would find its own token and answer
"entry gone", a publish would find its own mark, a sweep would find nothing left to expire.

So each script that changes the line is wrapped by :func:`kept`. The client gives every call a
request id, passed as one more key (``layout.reply``, in the lock's hash slot). The wrapper first
looks for a reply kept under that id: there is one only when this is a second send, and it is
returned as it is. Otherwise the script runs, and its reply is kept for :data:`KEEP_MS`, long
enough for the client's second send, which follows at once on a new connection.

The scripts that are safe to send twice as they are (:data:`AS_IS`) are not wrapped: the renewal
only extends a TTL its token still holds; marking a hand-off sent finds its mark made. A wrapped
script may run a fast path ``ahead`` of the lookup: ACQUIRE and RELEASE do for a fresh lock
(:mod:`.fresh`). A fresh acquire sent twice finds the key held by its own token and answers "taken";
a fresh release is never sent twice by the client (``once``): the task's release tries again with
``again``, a whole RELEASE that knows its first try (see releasing). So an uncontended task leaves
nothing behind, and pays nothing for the rule.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable
from typing import TypeVar

from ..exceptions import LockBackendUnavailable

T = TypeVar("T")

KEEP_MS = 30_000
"""How long a reply is kept (ms): the client's second send comes within its connect timeout."""

_WRAP = """%s
-- The last key is this call's reply, kept for a second send of the same call (engine/kept.py).
local KEPT_REPLY = KEYS[#KEYS]
local kept_reply = redis.call('GET', KEPT_REPLY)
if kept_reply then return cmsgpack.unpack(kept_reply) end
local function body()
%s
end
local reply = body()
redis.call('SET', KEPT_REPLY, cmsgpack.pack(reply), 'PX', %d)
return reply
"""

KEPT: set[str] = set()
"""Every wrapped script's text: the client adds a request id to these, and may send them twice."""

AS_IS: set[str] = set()
"""Scripts safe to send twice unwrapped (see the module doc): the client may send them twice."""


def kept(script: str, ahead: str = "") -> str:
    """``script`` wrapped so that a second send of one call returns the first send's reply. ``ahead``
    runs first, unwrapped: a fast path that returns only for calls it answers whole, each safe to send
    twice as it is or never sent twice (:mod:`.fresh`)."""
    wrapped = _WRAP % (ahead, script, KEEP_MS)
    KEPT.add(wrapped)
    return wrapped


def as_is(script: str) -> str:
    """``script``, declared safe to send twice as it is."""
    AS_IS.add(script)
    return script


def may_resend(script: str) -> bool:
    """Whether the client may send ``script`` again after its connection broke mid-call."""
    return script in KEPT or script in AS_IS


def tried(call: Callable[[str], T], tries: int = 3) -> T:
    """``call(request_id)``, sent again while the connection is broken (LockBackendUnavailable), up to
    ``tries`` times, 0.25 s then twice as long apart, always with one request id: a try that ran and
    whose reply was lost answers the next as it did, with what it carried (the hand-offs it made). For
    a call whose failing would strand something; the last error is raised."""
    request_id = secrets.token_hex(8)
    for attempt in range(tries - 1):
        try:
            return call(request_id)
        except LockBackendUnavailable:
            time.sleep(0.25 * 2 ** attempt)
    return call(request_id)
