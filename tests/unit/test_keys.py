"""Key derivation: (task, args, kwargs) -> lock key. Pure functions: no Redis, no Celery here.

Here: binding (one call, however it was spelled), canonical values, lock_key, and the KeyMaker. A
value's class and the process's settings are in test_keys_values.py; the golden values in
test_keys_golden.py.
"""

from __future__ import annotations

import inspect
import json
import re
import uuid
from collections import defaultdict
from datetime import date, datetime, time, timedelta, timezone
from decimal import Decimal

import pytest
from _keys_support import (
    PREFIX,
    SIG,
    TASK,
    f,
    key,
    one,
    var_key,
)

from celery_singleton_lock.delivery import keys
from celery_singleton_lock.exceptions import LockError, LockKeyError

pytestmark = pytest.mark.timeout(60)


# -- binding: one call, however it was spelled -------------------------------


def test_positional_keyword_and_default_are_one_call():
    k = key(1)
    assert k == key(a=1) == key(1, b=2) == key(1, 2) == key(b=2, a=1)
    assert re.fullmatch(r"csl:shop\.deduct:\{[0-9a-f]{32}\}", k), k


def test_different_calls_differ():
    seen = {key(1), key(2), key(1, b=3), key("1"), key(1.0), key(True), key(None), key(1, task="other")}
    assert len(seen) == 8
    assert keys.derive("other", TASK, SIG, (1,), {}) != key(1)


def test_var_positional_and_var_keyword_arguments_are_part_of_the_call():
    def g(a, *rest, **kw):
        pass

    sig = inspect.signature(g)
    assert key(1, x=2, sig=sig) == key(a=1, x=2, sig=sig)
    assert key(1, x=2, y=3, sig=sig) == key(1, y=3, x=2, sig=sig)
    assert key(1, x=2, sig=sig) != key(1, x=3, sig=sig)
    assert key(1, 5, 6, sig=sig) != key(1, 6, 5, sig=sig)
    assert key(1, sig=sig) != key(1, x=None, sig=sig)


def test_var_keyword_cannot_pose_as_var_positional():
    """f(1) and f(args=[1]) are different calls: the first fills *args, the second **kwargs."""

    def f(*args, **kwargs):
        pass

    sig = inspect.signature(f)
    assert var_key((1,), sig=sig) != var_key((), {"args": [1]}, sig=sig)
    assert var_key((1,), {"args": [2]}, sig=sig) != var_key((2,), sig=sig)
    assert var_key((), {"kwargs": {"x": 1}}, sig=sig) != var_key((), {"x": 1}, sig=sig)


def test_var_keyword_cannot_pose_as_a_positional_only_parameter():
    def h(a, /, **kw):  # h(1, a=2) is legal: a=1, kw={"a": 2}
        pass

    sig = inspect.signature(h)
    assert var_key((1,), {"a": 2}, sig=sig) != var_key((2,), sig=sig)
    assert var_key((1,), {"a": 2}, sig=sig) != var_key((1,), sig=sig)


def test_no_two_calls_share_a_key_and_every_spelling_of_one_call_does():
    """Keys are equal exactly when Python binds the two calls to the same arguments."""

    def g(a, /, b=0, *args, c=0, **kwargs):
        pass

    sig = inspect.signature(g)
    calls = [
        ((1,), {}), ((1, 0), {}), ((1,), {"b": 0}), ((1,), {"c": 0}), ((1,), {"b": 0, "c": 0}),
        ((2,), {}), ((1, 2), {}), ((1,), {"b": 2}),
        ((1,), {"a": 1}), ((1,), {"a": 2}), ((2,), {"a": 1}),
        ((1, 0, 1), {}), ((1, 0), {"args": [1]}), ((1, 0), {"args": (1,)}), ((1, 0, [1]), {}),
        ((1, 0, 1, 2), {}), ((1, 0, 2, 1), {}), ((1, 0, 1), {"args": [2]}), ((1, 0, 2), {"args": [1]}),
        ((1,), {"kwargs": {"x": 1}}), ((1,), {"x": 1}), ((1,), {"x": 1, "kwargs": {}}),
        ((1, 0, {"x": 1}), {}), ((1,), {"c": {"x": 1}}), ((1,), {"x": None}), ((1,), {"y": 1}),
        ((1,), {"args": [], "kwargs": {}}), ((1,), {"args": None}), ((1,), {"kwargs": None}),
    ]

    def bound(args, kwargs) -> str:
        arguments = sig.bind(*args, **kwargs)
        arguments.apply_defaults()
        return json.dumps(arguments.arguments, sort_keys=True)  # a tuple and a list are one value here too

    by_call: dict[str, set[str]] = defaultdict(set)
    for args, kwargs in calls:
        by_call[bound(args, kwargs)].add(var_key(args, kwargs, sig=sig))
    for call, found in by_call.items():
        assert len(found) == 1, f"one call, several keys: {call}"
    all_keys = [k for found in by_call.values() for k in found]
    assert len(set(all_keys)) == len(by_call), "two different calls share a key"


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


def test_lock_key_names_may_come_through_var_keyword():
    def loose(a, **kw):
        pass

    sig = inspect.signature(loose)
    assert var_key((1,), {"x": 5}, sig=sig, lock_key=["x"]) == var_key((2,), {"x": 5, "y": 0}, sig=sig, lock_key=["x"])
    assert var_key((1,), {"x": 5}, sig=sig, lock_key=["x"]) != var_key((1,), {"x": 6}, sig=sig, lock_key=["x"])
    assert var_key((1,), {"x": None}, sig=sig, lock_key=["x"]) != var_key((1,), {"x": 0}, sig=sig, lock_key=["x"])


def test_lock_key_name_missing_from_the_call_is_an_error_never_none():
    """Keyed as None, every call without the argument would share one key (under "skip": vanish)."""

    def loose(a, **kw):
        pass

    sig = inspect.signature(loose)
    for kwargs in ({}, {"y": 1}):
        with pytest.raises(LockKeyError) as info:
            var_key((1,), kwargs, sig=sig, lock_key=["x"])
        text = str(info.value)
        assert repr(TASK) in text and "lock_key" in text and "'x'" in text, text
    # passed as None is a value like any other
    assert var_key((1,), {"x": None}, sig=sig, lock_key=["x"])


def test_lock_key_naming_the_var_parameters_themselves_is_an_error():
    from celery_singleton_lock.delivery.config import check_lock_key  # not at the top: GOLDEN_SCRIPT has no redis

    def loose(a, *rest, **kw):
        pass

    sig = inspect.signature(loose)
    for name in ("rest", "kw"):
        # at definition time (what the task checks when it binds) ...
        with pytest.raises(ValueError) as info:
            check_lock_key("task 'shop.loose'", [name], sig)
        text = str(info.value)
        assert "task 'shop.loose'" in text and "lock_key" in text and repr(name) in text, text
        # ... and derive() never keys it as None either
        with pytest.raises(LockKeyError) as raised:
            var_key((1,), {}, sig=sig, lock_key=[name])
        assert "lock_key" in str(raised.value) and repr(name) in str(raised.value)


def test_lock_key_check_still_allows_names_that_may_come_through_var_keyword():
    from celery_singleton_lock.delivery.config import check_lock_key

    def loose(a, /, **kw):
        pass

    check_lock_key("task 't'", ["a", "anything"], inspect.signature(loose))
    with pytest.raises(ValueError, match=r"task 't': lock_key names 'nope'"):
        check_lock_key("task 't'", ["nope"], SIG)


def test_callable_lock_key_that_raises_names_the_task_and_the_option():
    class Boom(RuntimeError):
        pass

    def by_sku(a, b=2):
        raise Boom("no sku today")

    with pytest.raises(LockKeyError) as info:
        key(1, lock_key=by_sku)
    text = str(info.value)
    assert repr(TASK) in text and "lock_key" in text and "Boom" in text and "no sku today" in text, text
    assert isinstance(info.value.__cause__, Boom)
    assert all(isinstance(arg, str) for arg in info.value.args)  # survives a JSON result backend
    with pytest.raises(LockKeyError, match="lock_key.*TypeError"):
        key(1, lock_key=lambda: "no parameters")


def test_callable_lock_key():
    def by_a(a, b=2):
        return f"a={a}"

    assert key(1, lock_key=by_a) == key(1, b=99, lock_key=by_a) == key(a=1, lock_key=by_a)
    assert key(1, lock_key=by_a) != key(2, lock_key=by_a)
    assert key(1, lock_key=by_a) != key(1)
    with pytest.raises(LockKeyError, match="must return a str, got int"):
        key(1, lock_key=lambda a, b=2: 7)


def test_negative_zero_is_zero():
    """-0.0 == 0.0 and Decimal("-0") == Decimal("0.00") in Python: one key each."""
    assert keys.canonical(-0.0) == keys.canonical(0.0)
    assert keys.canonical(Decimal("-0")) == keys.canonical(Decimal("0")) == keys.canonical(Decimal("0.00"))
    assert keys.canonical(Decimal("1.0")) != keys.canonical(Decimal("0"))


def _plain(a, b=2, c="x"):
    pass


def _star(a, *rest, **extra):
    pass


def _kwonly(a, *, b=1):
    pass


@pytest.mark.parametrize("sig_of", [_plain, _star, _kwonly, f])
@pytest.mark.parametrize("lock_key", [None, ["a"], ["b", "a"], ["c"], ["extra"], lambda *a, **k: "fixed"])
@pytest.mark.parametrize("call", [((), {}), ((1,), {}), ((1, 2), {}), ((1, 2, "y"), {}), ((1, 2, 3, 4), {}),
                                  ((1,), {"b": 5}), ((), {"a": [1, {"z": 2}]}), ((2.5, None), {}),
                                  (('q"\\é\u2028', True), {}), ((10**700, -0.0, b"x"), {})])
def test_key_maker_gives_what_derive_gives(sig_of, lock_key, call):
    """KeyMaker (derive with the per-task part done once, what before_start uses) keys and fails exactly like derive."""
    sig = inspect.signature(sig_of)
    args, kwargs = call

    def outcome(fn):
        try:
            return fn()
        except (LockKeyError, TypeError) as exc:
            return type(exc), str(exc)

    maker = keys.KeyMaker(PREFIX, TASK, sig, lock_key)
    derived = outcome(lambda: keys.derive(PREFIX, TASK, sig, args, kwargs, lock_key))
    assert outcome(lambda: maker(args, kwargs)) == derived


def test_the_lock_key_arguments_alone_derive_the_key_an_operator_asks_for():
    """``celery locks key deduct --args '["sku-1"]'`` with ``lock_key=["sku"]``: the same key as the
    call ``deduct("sku-1", 5)``; keyed on every argument, a missing one is still an error naming it."""
    import inspect

    from celery_singleton_lock.delivery.keys import derive
    from celery_singleton_lock.exceptions import LockKeyError

    def deduct(sku, qty):
        return sku, qty

    sig = inspect.signature(deduct)
    full = derive("p", "t.deduct", sig, ("sku-1", 5), {}, ["sku"])
    assert derive("p", "t.deduct", sig, ("sku-1",), {}, ["sku"], partial=True) == full
    assert derive("p", "t.deduct", sig, (), {"sku": "sku-1"}, ["sku"], partial=True) == full
    with pytest.raises(LockKeyError, match="qty"):
        derive("p", "t.deduct", sig, ("sku-1",), {}, None, partial=True)
    with pytest.raises(LockKeyError, match="qty"):
        derive("p", "t.deduct", sig, ("sku-1",), {}, ["sku"])  # a real call still needs every argument
