"""Key derivation: (task, args, kwargs) -> lock key. Pure functions: no Redis, no Celery here."""

from __future__ import annotations

import hashlib
import inspect
import json
import os
import re
import subprocess
import sys
import uuid
from datetime import date, datetime, time, timedelta, timezone
from decimal import Decimal
from pathlib import Path

import pytest

from celery_singleton_lock import keys
from celery_singleton_lock.exceptions import LockError, LockKeyError

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parent.parent
PREFIX = "csl"
TASK = "shop.deduct"


def f(a, b=2):  # the task signature most tests use
    pass


SIG = inspect.signature(f)


def key(*args, sig=SIG, task=TASK, lock_key=None, **kwargs) -> str:
    return keys.derive(PREFIX, task, sig, args, kwargs, lock_key)


def one(value) -> str:
    """The key of a call whose only argument is ``value``."""
    return key(value)


# -- binding: one call, however it was spelled -------------------------------


def test_positional_keyword_and_default_are_one_call():
    k = key(1)
    assert k == key(a=1) == key(1, b=2) == key(1, 2) == key(b=2, a=1)
    assert re.fullmatch(r"csl:shop\.deduct:\{[0-9a-f]{32}\}", k), k


def test_different_calls_differ():
    seen = {key(1), key(2), key(1, b=3), key("1"), key(1.0), key(True), key(None), key(1, task="other")}
    assert len(seen) == 8
    assert keys.derive("other", TASK, SIG, (1,), {}) != key(1)


def test_var_keyword_is_flattened_and_var_positional_kept():
    def g(a, *rest, **kw):
        pass

    sig = inspect.signature(g)
    assert key(1, x=2, sig=sig) == key(a=1, x=2, sig=sig)
    assert key(1, x=2, y=3, sig=sig) == key(1, y=3, x=2, sig=sig)
    assert key(1, x=2, sig=sig) != key(1, x=3, sig=sig)
    assert key(1, 5, 6, sig=sig) != key(1, 6, 5, sig=sig)


def test_arguments_that_do_not_fit_raise():
    with pytest.raises(LockKeyError, match="do not fit"):
        key(1, 2, 3)
    with pytest.raises(LockKeyError, match="do not fit"):
        key(c=1)


# -- canonical values ----------------------------------------------------------


def test_tuple_equals_list_and_nested():
    assert one((1, 2)) == one([1, 2])
    assert one({"x": (1, (2, 3))}) == one({"x": [1, [2, 3]]})
    assert one([1, 2]) != one([2, 1])


def test_dict_order_does_not_matter():
    assert one({"x": 1, "y": {"p": 1, "q": 2}}) == one({"y": {"q": 2, "p": 1}, "x": 1})
    assert one({"x": 1}) != one({"x": 2})


def test_dict_keys_become_strings_the_way_json_does():
    # what a JSON round trip does to dict keys, so the sender's and the worker's views agree
    assert one({1: "a"}) == one({"1": "a"}) == one(json.loads(json.dumps({1: "a"})))
    assert one({True: 1}) == one({"true": 1})
    assert one({None: 1}) == one({"null": 1})
    assert one({1.5: 1}) == one({"1.5": 1})


def test_scalars_keep_their_type():
    assert len({one(1), one(1.0), one(True), one("1"), one(None)}) == 5
    assert one(0) != one(False)
    assert one(2**70) != one(float(2**70))  # no float precision loss for big ints
    assert one(2**70) != one(2**70 + 1)


def test_uuid():
    u = uuid.UUID("12345678-1234-5678-1234-567812345678")
    assert one(u) == one(uuid.UUID(str(u))) == one(uuid.UUID(bytes=u.bytes))
    assert one(u) != one(str(u))  # tagged: a uuid is not its string
    assert one(u) != one(uuid.UUID(int=u.int + 1))


def test_decimal_is_by_value():
    assert one(Decimal("1.0")) == one(Decimal("1.00")) == one(Decimal("1")) == one(Decimal("0.1E1"))
    assert one(Decimal("10")) == one(Decimal("1E+1"))
    assert one(Decimal("1.5")) != one(Decimal("1.05"))
    assert one(Decimal("1")) != one(1) and one(Decimal("1")) != one(1.0)
    assert one(Decimal("NaN")) == one(Decimal("NaN")) and one(Decimal("Infinity")) != one(Decimal("-Infinity"))


def test_aware_datetime_is_the_instant():
    utc_noon = datetime(2024, 3, 1, 12, 0, tzinfo=timezone.utc)
    paris = datetime(2024, 3, 1, 13, 0, tzinfo=timezone(timedelta(hours=1)))
    new_york = datetime(2024, 3, 1, 7, 0, tzinfo=timezone(timedelta(hours=-5)))
    assert one(utc_noon) == one(paris) == one(new_york)
    assert one(utc_noon) != one(utc_noon + timedelta(microseconds=1))
    naive = datetime(2024, 3, 1, 12, 0)
    assert one(naive) == one(datetime(2024, 3, 1, 12, 0)) != one(utc_noon)


def test_date_time_and_bytes():
    assert one(date(2024, 3, 1)) == one(date(2024, 3, 1)) != one(date(2024, 3, 2))
    assert one(date(2024, 3, 1)) != one(datetime(2024, 3, 1))  # a datetime is a date subclass
    assert one(date(2024, 3, 1)) != one("2024-03-01")
    assert one(time(8, 30)) == one(time(8, 30, 0)) != one(time(8, 31))
    assert one(b"ab\x00") == one(bytearray(b"ab\x00")) == one(memoryview(b"ab\x00"))
    assert one(b"ab") != one("ab") and one(b"ab") != one(b"ba")


def test_sets_are_unordered():
    assert one({3, 1, 2}) == one({1, 2, 3}) == one(frozenset([2, 3, 1]))
    assert one({"pear", "apple", 1, None}) == one({None, 1, "apple", "pear"})
    assert one({1, 2, 3}) != one([1, 2, 3])
    assert one({1, 2}) != one({1, 2, 3})


@pytest.mark.parametrize(
    ("call", "path", "type_name"),
    [
        (lambda: key(object()), "a", "builtins.object"),
        (lambda: key({"items": [1, 2, object()]}), "a['items'][2]", "builtins.object"),
        (lambda: key(1, b=[{"when": lambda: 0}]), "b[0]['when']", "function"),
        (lambda: key({1 + 2j}), "a{...}", "builtins.complex"),
    ],
)
def test_unkeyable_argument_names_its_path_and_type(call, path, type_name):
    with pytest.raises(LockKeyError) as info:
        call()
    text = str(info.value)
    assert f"argument {path} " in text, text
    assert type_name in text, text
    assert "lock_key" in text  # says what to do about it
    assert isinstance(info.value, LockError) and isinstance(info.value, TypeError)


def test_unkeyable_dict_key_names_its_path_and_type():
    with pytest.raises(LockKeyError) as info:
        key({"x": {(1, 2): "pair"}})
    text = str(info.value)
    assert "a['x']" in text and "(1, 2)" in text and "tuple" in text, text


def test_lock_key_names_pick_arguments():
    assert key(1, b=2, lock_key=["a"]) == key(1, b=3, lock_key=["a"]) == key(a=1, lock_key=["a"])
    assert key(1, lock_key=["a"]) != key(2, lock_key=["a"])
    assert key(1, lock_key=["a"]) != key(1)
    # the argument left out may be anything, even something that has no key
    assert key(1, b=object(), lock_key=["a"]) == key(1, lock_key=["a"])
    # the order the names are given in is part of the identity, and stable
    assert key(1, 5, lock_key=["a", "b"]) == key(b=5, a=1, lock_key=["a", "b"])


def test_callable_lock_key():
    def by_a(a, b=2):
        return f"a={a}"

    assert key(1, lock_key=by_a) == key(1, b=99, lock_key=by_a) == key(a=1, lock_key=by_a)
    assert key(1, lock_key=by_a) != key(2, lock_key=by_a)
    assert key(1, lock_key=by_a) != key(1)
    with pytest.raises(LockKeyError, match="must return a str, got int"):
        key(1, lock_key=lambda a, b=2: 7)


# -- golden values: these strings must never change ---------------------------

AWARE = datetime(2024, 3, 1, 13, 0, 0, 250000, tzinfo=timezone(timedelta(hours=1)))
GOLDEN_CALLS = {
    "int": ((1,), {}),
    "kwargs": ((), {"a": "sku-42", "b": 3}),
    "nested": (({"qty": [1, 2.5, None, True], "meta": {2: "x"}},), {}),
    "types": (
        (
            uuid.UUID("12345678-1234-5678-1234-567812345678"),
            [Decimal("1.10"), AWARE, date(2024, 3, 1), time(8, 30), b"\x00\xff"],
        ),
        {},
    ),
    "set": (({"pear", "apple", "fig", 3},), {}),
    "unicode": (("Grüße, 世界",), {}),
}
GOLDEN = {
    "int": "csl:shop.deduct:{925077f9c6e8bbb1c0b624a376343990}",
    "kwargs": "csl:shop.deduct:{77045bd7beae2c00bac2c263d18f2497}",
    "nested": "csl:shop.deduct:{76da33b4e62ba4b1c5b3b112b5e8aaa0}",
    "types": "csl:shop.deduct:{eff5770a7e0c74e9fd96921cc8de8a72}",
    "set": "csl:shop.deduct:{69caf4c24874249b18109a66d683815a}",
    "unicode": "csl:shop.deduct:{86c73a96ebbd3dbf3333d8bbd4b6072e}",
    "lock_key_names": "csl:shop.deduct:{b9b4bcbc4568432a7fec88248e697936}",
    "lock_key_callable": "csl:shop.deduct:{da123c6207a69b2aea16401d26676540}",
}


def golden_keys() -> dict[str, str]:
    out = {name: keys.derive(PREFIX, TASK, SIG, args, kwargs) for name, (args, kwargs) in GOLDEN_CALLS.items()}
    out["lock_key_names"] = keys.derive(PREFIX, TASK, SIG, ("sku-42",), {"b": object()}, ["a"])
    out["lock_key_callable"] = keys.derive(PREFIX, TASK, SIG, ("sku-42",), {}, lambda a, b=2: f"sku:{a}")
    return out


def test_golden_values():
    assert golden_keys() == GOLDEN


def test_golden_value_by_hand():
    """The documented recipe: sha256("<task>\\n<compact JSON of the tagged arguments>"), 32 hex digits."""
    blob = '[["a",["int","1"]],["b",["int","2"]]]'
    digest = hashlib.sha256(f"{TASK}\n{blob}".encode()).hexdigest()[:32]
    assert key(1) == f"csl:shop.deduct:{{{digest}}}" == GOLDEN["int"]


@pytest.mark.timeout(60)
def test_keys_equal_in_processes_with_other_hash_seeds():
    """String hashing (and so set order) changes with PYTHONHASHSEED; the keys must not."""
    script = (
        "import json, sys; sys.path.insert(0, sys.argv[1]); import test_keys; "
        "print(json.dumps(test_keys.golden_keys()))"
    )
    here = golden_keys()
    assert here == GOLDEN
    for seed in ("0", "4242"):
        env = dict(os.environ, PYTHONHASHSEED=seed, PYTHONPATH=str(ROOT))
        out = subprocess.run(
            [sys.executable, "-c", script, str(ROOT / "tests")],
            env=env, capture_output=True, text=True, timeout=50, check=True,
        )
        assert json.loads(out.stdout) == here, f"PYTHONHASHSEED={seed}"


def test_negative_zero_is_zero():
    """-0.0 == 0.0 and Decimal("-0") == Decimal("0.00") in Python: one key each."""
    assert keys.canonical(-0.0) == keys.canonical(0.0)
    assert keys.canonical(Decimal("-0")) == keys.canonical(Decimal("0")) == keys.canonical(Decimal("0.00"))
    assert keys.canonical(Decimal("1.0")) != keys.canonical(Decimal("0"))
