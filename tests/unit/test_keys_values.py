"""Key derivation: a value keys by what it is, not by its class's manners or the process's settings
(int, float and str subclasses, enums, the decimal context, the int digit limit). Pure functions: no
Redis, no Celery here."""

from __future__ import annotations

import json
import sys
import uuid
from datetime import date, datetime, time, timedelta, timezone
from decimal import Decimal, localcontext

import pytest
from _keys_support import (
    DIGITS_40,
    Backwards,
    Blob,
    Cents,
    Clock,
    Color,
    Day,
    Ident,
    Loud,
    Money,
    Perm,
    Plain,
    Price,
    Shouting,
    Size,
    Stamp,
    one,
)

from celery_singleton_lock.delivery import keys
from celery_singleton_lock.exceptions import LockKeyError

pytestmark = pytest.mark.timeout(60)


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
