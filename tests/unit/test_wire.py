"""The bytes the hot path sends: wire.pack against redis-py's own packer. Pure functions: no Redis here."""

from __future__ import annotations

import pytest
from redis.connection import Connection

from celery_singleton_lock.engine import wire

pytestmark = pytest.mark.timeout(30)

SHA = "0123456789abcdef0123456789abcdef01234567"


@pytest.mark.parametrize("keys, args", [
    (("k", "k:q", "k:w", "k:d"), ("tok", '{"owner":"x"}', 30000, "x", "", "", "")),  # an acquire: all str and int
    (("k", "k:q", "k:w", "k:d"), ("tok ", "x", "1", "0", "", "0", "0")),  # a release with nothing to keep
    (("k",), ("tok ", "x", "1", "60000", b"application/json\nutf-8\n[1]", "0", "0")),  # bytes: the other way
    (("ключ",), ("значение", 0, -1, "")),  # non-ASCII: lengths in bytes, not characters
    ((), ()),
])
def test_pack_is_what_redis_py_sends(keys, args):
    expected = b"".join(Connection().pack_command("EVALSHA", SHA, len(keys), *keys, *args))
    assert wire.pack(SHA, keys, args) == expected
