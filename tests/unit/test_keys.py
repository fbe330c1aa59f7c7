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
from collections import defaultdict
from datetime import date, datetime, time, timedelta, timezone
from decimal import Decimal, localcontext
from enum import Enum, IntEnum, IntFlag
from pathlib import Path

import pytest

from celery_singleton_lock.delivery import keys
from celery_singleton_lock.exceptions import LockError, LockKeyError

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parents[2]
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


def test_var_positional_and_var_keyword_arguments_are_part_of_the_call():
    def g(a, *rest, **kw):
        pass

    sig = inspect.signature(g)
    assert key(1, x=2, sig=sig) == key(a=1, x=2, sig=sig)
    assert key(1, x=2, y=3, sig=sig) == key(1, y=3, x=2, sig=sig)
    assert key(1, x=2, sig=sig) != key(1, x=3, sig=sig)
    assert key(1, 5, 6, sig=sig) != key(1, 6, 5, sig=sig)
    assert key(1, sig=sig) != key(1, x=None, sig=sig)


def var_key(args=(), kwargs=None, sig=None, lock_key=None) -> str:
    """derive() without the key() helper's own keyword names (a call may pass args=, kwargs=, sig=)."""
    return keys.derive(PREFIX, TASK, sig, tuple(args), kwargs or {}, lock_key)


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


# -- a value keys by what it is, not by its class's manners or the process's settings --------


class Cents(int):
    """An int that prints itself its own way: JSON still sends the int."""

    def __str__(self):
        return f"{int(self) / 100:.2f} EUR"

    __repr__ = __str__


class Price(float):
    def __repr__(self):
        return f"{float(self):.2f} EUR"

    __str__ = __repr__

    def __add__(self, other):
        return Price(float(self) + other + 1)


class Shouting(str):
    def __str__(self):
        return self.upper()

    def __lt__(self, other):  # reverses any order built on it
        return str.__gt__(self, other)


class Color(IntEnum):
    RED = 1
    GREEN = 2


class Perm(IntFlag):
    R = 4
    W = 2


class Size(str, Enum):  # what StrEnum is on 3.11+, spelled so 3.10 has it too
    S = "small"


class Plain(Enum):
    A = 1


class Stamp(datetime):
    def isoformat(self, *args, **kwargs):
        return "a moment"

    def __str__(self):
        return "a moment"

    def astimezone(self, tz=None):
        return datetime(1970, 1, 1, tzinfo=timezone.utc)

    def utcoffset(self):
        return None


class Day(date):
    def isoformat(self):
        return "some day"


class Clock(time):
    def isoformat(self, *args, **kwargs):
        return "some time"


class Ident(uuid.UUID):
    def __str__(self):
        return "an id"


class Blob(bytes):
    def __bytes__(self):
        return b"other"


class Money(Decimal):
    def __str__(self):
        return "lots"

    def normalize(self, context=None):
        return Decimal(0)

    def as_tuple(self):
        return Decimal(0).as_tuple()


class Loud(dict):
    """A dict subclass whose items() lies: JSON (and pickle) send what items() says."""

    def items(self):
        return [(k.upper(), v) for k, v in dict.items(self)]


class Backwards(list):
    def __iter__(self):
        return reversed(list(list.__iter__(self)))


def test_int_subclass_keys_like_the_int_json_sends():
    assert json.loads(json.dumps(Cents(150))) == 150
    assert one(Cents(150)) == one(150) == one(json.loads(json.dumps(Cents(150))))
    assert one([Cents(1), {"p": Cents(2)}]) == one([1, {"p": 2}])
    assert one({Cents(7): "x"}) == one({7: "x"}) == one({"7": "x"})


def test_float_subclass_keys_like_the_float_json_sends():
    assert one(Price(1.5)) == one(1.5) == one(json.loads(json.dumps(Price(1.5))))
    assert one(Price(-0.0)) == one(0.0)
    assert one({Price(2.5): 1}) == one({2.5: 1})


def test_str_subclass_keys_like_its_content():
    assert one(Shouting("sku")) == one("sku") == one(json.loads(json.dumps(Shouting("sku"))))
    # as a dict key too, and its own ordering does not reorder the dict
    assert one({Shouting("a"): 1, Shouting("b"): 2}) == one({"b": 2, "a": 1})
    assert one({Shouting("b"): 1, "a": 2}) == one({"a": 2, "b": 1})


def test_int_and_str_enums_key_like_their_values_on_every_version():
    """str(IntEnum member) is "Color.RED" on 3.10 and "1" on 3.11: neither may leak into the key."""
    assert one(Color.RED) == one(1) == one(json.loads(json.dumps(Color.RED)))
    assert one(Color.GREEN) != one(Color.RED)
    assert one(Perm.R | Perm.W) == one(6) == one(json.loads(json.dumps(Perm.R | Perm.W)))
    assert one(Size.S) == one("small") == one(json.loads(json.dumps(Size.S)))
    assert one({Color.RED: Size.S}) == one({"1": "small"})
    if sys.version_info >= (3, 11):
        from enum import StrEnum

        class Tier(StrEnum):
            GOLD = "gold"

        assert one(Tier.GOLD) == one("gold")


def test_plain_enum_is_no_key():
    with pytest.raises(LockKeyError, match=r"argument a of type .*Plain"):
        one(Plain.A)


DIGITS_40 = "1234567890123456789012345678901234567890.5"


def test_decimal_key_does_not_depend_on_the_decimal_context():
    """Decimal.normalize() rounds to the thread's precision; str() asks its capitals setting."""
    big = Decimal(DIGITS_40)
    default = one(big)
    with localcontext() as ctx:
        ctx.prec = 50
        assert one(big) == default
    with localcontext() as ctx:
        ctx.prec = 5
        assert one(big) == default
        assert one(Decimal("1.23456789")) != one(Decimal("1.23457"))  # not rounded to 5 digits
    assert one(big) != one(big + 1) and one(big) != one(Decimal("1234567890123456789012345678900000000000"))
    with localcontext() as ctx:
        ctx.capitals = 0
        assert one(Decimal("1E+7")) == one(Decimal("10000000"))
        assert keys.canonical(Decimal("1E+7")) == ["decimal", "1E+7"]
    with localcontext() as ctx:
        ctx.Emax = 10  # normalize() would overflow
        assert one(Decimal("1E+12")) == one(Decimal("1000000000000.000"))


def test_decimal_spelling_is_what_normalize_gave_for_ordinary_values():
    """Hand-made spelling, same as the old str(value.normalize()) wherever that was exact."""
    samples = ["1.10", "10", "1E+1", "0.000001", "0.0000001", "123.4560", "-5E-7", "-1.500", "1E+999999",
               "0.1", "100.00", "-0", "0E-5", "12345678901234567890.12345678", "NaN", "-NaN", "sNaN5",
               "NaN0012", "Infinity", "-Infinity", "7.000E-10", "42"]
    for text in samples:
        value = Decimal(text)
        old = "0" if value.is_zero() else str(value.normalize()) if value.is_finite() else str(value)
        assert keys.canonical(value) == ["decimal", old], text


def test_decimal_equal_values_one_key():
    assert one(Decimal("1.0")) == one(Decimal("1.00")) == one(Decimal("0.1E1")) == one(Decimal("100E-2"))
    assert one(Decimal("-0")) == one(Decimal("0E+5")) == one(Decimal("0.000"))
    assert one(Decimal("-1.5")) != one(Decimal("1.5"))


def test_subclasses_of_tagged_types_key_by_their_value():
    moment = datetime(2024, 3, 1, 12, 0, 0, 250000)
    assert one(Stamp(2024, 3, 1, 12, 0, 0, 250000)) == one(moment)
    aware = datetime(2024, 3, 1, 13, 0, tzinfo=timezone(timedelta(hours=1)))
    assert one(Stamp(2024, 3, 1, 13, 0, tzinfo=timezone(timedelta(hours=1)))) == one(aware)
    assert one(Day(2024, 3, 1)) == one(date(2024, 3, 1))
    assert one(Clock(8, 30)) == one(time(8, 30))
    u = uuid.UUID("12345678-1234-5678-1234-567812345678")
    assert one(Ident(str(u))) == one(u)
    assert one(Blob(b"ab")) == one(b"ab")
    assert one(Money("1.50")) == one(Decimal("1.5"))


def test_containers_key_by_what_json_sends():
    """JSON (and pickle) send a dict subclass as its items() and a list subclass as its iteration:
    the worker gets exactly that, so the key follows it too, here and there alike."""
    loud = Loud(sku="a")
    assert one(loud) == one(json.loads(json.dumps(loud))) == one({"SKU": "a"})
    back = Backwards([1, 2])
    assert one(back) == one(json.loads(json.dumps(back))) == one([2, 1])


def test_dict_keys_that_json_merges_key_like_the_merged_dict():
    """{1: "a", "1": "b"} reaches the worker as {"1": "b"}: the last one wins, as in JSON."""
    both = {1: "a", "1": "b"}
    assert one(both) == one(json.loads(json.dumps(both))) == one({"1": "b"})
    assert one({"1": "b", 1: "a"}) == one({"1": "a"})


def test_int_key_does_not_depend_on_the_int_digit_limit():
    """sys.set_int_max_str_digits (or PYTHONINTMAXSTRDIGITS) must not change or break a key."""
    if not hasattr(sys, "set_int_max_str_digits"):
        pytest.skip("this Python has no int digit limit")
    longer = 10**700 + 12345
    huge = 7**9000  # ~7600 digits: more than JSON writes under the default limit
    before = sys.get_int_max_str_digits()
    default = one(longer), one(-longer), one(huge)
    try:
        sys.set_int_max_str_digits(640)
        assert (one(longer), one(-longer), one(huge)) == default
        sys.set_int_max_str_digits(0)  # no limit at all
        assert (one(longer), one(-longer), one(huge)) == default
    finally:
        sys.set_int_max_str_digits(before)
    assert keys.canonical(longer) == ["int", str(longer)]
    assert one(huge) != one(huge + 1) and one(longer) != one(longer + 1)


# -- golden values: these strings must never change ---------------------------------------

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
    # added with the fixes for subclasses, enums, the decimal context and *args/**kw
    "int_enum": "csl:shop.deduct:{925077f9c6e8bbb1c0b624a376343990}",
    "int_subclasses": "csl:shop.deduct:{cbb1769a9d12b03e4b55e60256052f29}",
    "str_enum": "csl:shop.deduct:{cda605d3c1cada1cc6d70714b6a68e6f}",
    "floats": "csl:shop.deduct:{663a41d769c595aae040e8fff3fa91bb}",
    "datetime_subclass": "csl:shop.deduct:{7e0128ba61ceac193fef788ef02343d7}",
    "big_ints": "csl:shop.deduct:{453ccddfb596c808d58a0d89a4549b62}",
    "decimal_precise": "csl:shop.deduct:{25f17f24569562802e2d119aaeb10aac}",
    "var_positional": "csl:shop.deduct:{557010480141d0cfa86dfd3e9b0abd8f}",
    "var_keyword": "csl:shop.deduct:{cec6a48e936752b2da25aeec40dd90d6}",
    "var_keyword_empty": "csl:shop.deduct:{e8f0904874f57dd3677c519cad21bff2}",
    "var_keyword_lock_key": "csl:shop.deduct:{96decc4f8e2eed41924e5be1783bce19}",
}


def var_positional(a, *rest):
    pass


def var_keyword(a, /, b=0, *args, **kw):
    pass


def golden_keys() -> dict[str, str]:
    """The golden cases' keys, computed by this process (see the subprocess tests below)."""
    out = {name: keys.derive(PREFIX, TASK, SIG, args, kwargs) for name, (args, kwargs) in GOLDEN_CALLS.items()}
    out["lock_key_names"] = keys.derive(PREFIX, TASK, SIG, ("sku-42",), {"b": object()}, ["a"])
    out["lock_key_callable"] = keys.derive(PREFIX, TASK, SIG, ("sku-42",), {}, lambda a, b=2: f"sku:{a}")
    # values whose spelling once depended on their class, the Python version or the decimal context
    out["int_enum"] = keys.derive(PREFIX, TASK, SIG, (Color.RED,), {})  # must be the "int" key
    out["int_subclasses"] = keys.derive(PREFIX, TASK, SIG, (Cents(150), Perm.R | Perm.W), {})
    out["str_enum"] = keys.derive(PREFIX, TASK, SIG, (Size.S,), {"b": Shouting("x")})
    out["floats"] = keys.derive(PREFIX, TASK, SIG, ([1.5, -0.0, 0.1, 1e300, 5e-324, Price(2.5)],), {})
    out["datetime_subclass"] = keys.derive(PREFIX, TASK, SIG, (Stamp(2024, 3, 1, 12, tzinfo=timezone.utc),), {})
    out["big_ints"] = keys.derive(PREFIX, TASK, SIG, ([10**700 + 12345, -(7**9000)],), {})
    with localcontext() as ctx:
        ctx.prec, ctx.capitals = 50, 0
        out["decimal_precise"] = keys.derive(PREFIX, TASK, SIG, (Decimal(DIGITS_40), Decimal("1E+7")), {})
    # *args and **kw: each has its own place in the identity
    rest, kw = inspect.signature(var_positional), inspect.signature(var_keyword)
    out["var_positional"] = keys.derive(PREFIX, TASK, rest, (1, 2, [3]), {})
    out["var_keyword"] = keys.derive(PREFIX, TASK, kw, (1, 2, 3), {"a": 4, "args": [5], "kw": 6})
    out["var_keyword_empty"] = keys.derive(PREFIX, TASK, kw, (1,), {})
    out["var_keyword_lock_key"] = keys.derive(PREFIX, TASK, kw, (1,), {"sku": "A-1", "x": 0}, ["sku", "a"])
    return out


def test_golden_values():
    assert golden_keys() == GOLDEN
    # a value that arrives as its int or str keys like it, whatever its class
    assert GOLDEN["int_enum"] == GOLDEN["int"] == key(1)
    assert GOLDEN["int_subclasses"] == key(150, 6)
    assert GOLDEN["str_enum"] == key("small", "x")
    assert GOLDEN["datetime_subclass"] == key(datetime(2024, 3, 1, 12, tzinfo=timezone.utc))
    with localcontext() as ctx:
        ctx.prec = 5
        assert GOLDEN["decimal_precise"] == key(Decimal(DIGITS_40), Decimal("10000000"))


def test_golden_value_by_hand():
    """The documented recipe: sha256("<task>\\n<compact JSON of the tagged arguments>"), 32 hex digits."""
    blob = '[["a",["int","1"]],["b",["int","2"]]]'
    digest = hashlib.sha256(f"{TASK}\n{blob}".encode()).hexdigest()[:32]
    assert key(1) == f"csl:shop.deduct:{{{digest}}}" == GOLDEN["int"]
    # *args is a list under its name, **kw a dict under its name: no spelling of one call is another's
    blob = '[["a",["int","1"]],["args",["list",[]]],["b",["int","0"]],["kw",["dict",[["x",["int","2"]]]]]]'
    digest = hashlib.sha256(f"{TASK}\n{blob}".encode()).hexdigest()[:32]
    assert var_key((1,), {"x": 2}, sig=inspect.signature(var_keyword)) == f"csl:shop.deduct:{{{digest}}}"


# The golden cases, computed by another process: test_keys imported with stand-ins for the
# package (keys.py and exceptions.py only: the package's __init__ imports Celery, which the other
# Python has not got) and for pytest (test_keys uses it at import for marks only).
GOLDEN_SCRIPT = r"""
import json, os, sys, types
root = sys.argv[1]
package = types.ModuleType("celery_singleton_lock")
package.__path__ = [os.path.join(root, "celery_singleton_lock")]
sys.modules["celery_singleton_lock"] = package

class Anything:
    def __getattr__(self, name):
        return self

    def __call__(self, *args, **kwargs):
        return args[0] if len(args) == 1 and callable(args[0]) and not kwargs else self

sys.modules["pytest"] = Anything()
sys.path.insert(0, os.path.join(root, "tests", "unit"))
import test_keys
assert "celery" not in sys.modules and "redis" not in sys.modules, "keys.py must stay pure stdlib"
print(json.dumps({"version": list(sys.version_info[:3]), "keys": test_keys.golden_keys()}))
"""


def golden_keys_in(python: str, **env: str) -> dict[str, str]:
    out = subprocess.run(
        [python, "-c", GOLDEN_SCRIPT, str(ROOT)],
        env=dict(os.environ, PYTHONPATH=str(ROOT), **env), capture_output=True, text=True, timeout=50,
    )
    assert out.returncode == 0, f"{python} {env}: {out.stderr[-2000:]}"
    return json.loads(out.stdout)["keys"]


@pytest.mark.timeout(120)
def test_keys_equal_in_processes_with_other_hash_seeds_and_settings():
    """String hashing (and so set order) changes with PYTHONHASHSEED, the int digit limit with
    PYTHONINTMAXSTRDIGITS; the keys must not."""
    assert golden_keys() == GOLDEN
    for env in ({"PYTHONHASHSEED": "0"}, {"PYTHONHASHSEED": "4242", "PYTHONINTMAXSTRDIGITS": "640"}):
        assert golden_keys_in(sys.executable, **env) == GOLDEN, env


PYENV_VERSIONS = Path(os.environ.get("PYENV_ROOT") or Path.home() / ".pyenv") / "versions"
OTHER_PYTHONS = ["3.10.13", "3.11.7", "3.12.1", "3.13.0"]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("version", OTHER_PYTHONS)
def test_golden_values_on_other_python_versions(version):
    """The same keys on every supported Python: str(IntEnum), for one, changed in 3.11."""
    python = PYENV_VERSIONS / version / "bin" / "python"
    if not python.exists():
        pytest.skip(f"Python {version} is not installed (no {python})")
    if version.split(".")[:2] == [str(n) for n in sys.version_info[:2]]:
        pytest.skip(f"Python {version[:4]} is the one running these tests")
    assert golden_keys_in(str(python), PYTHONHASHSEED="1") == GOLDEN


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
