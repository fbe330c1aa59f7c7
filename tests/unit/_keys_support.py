"""Key derivation's shared test helpers (tests/unit/test_keys*.py): the task and signature most tests
key, ``key``/``one``/``var_key``, the values whose classes have manners of their own, and the golden
cases with :func:`golden_keys`, which another Python imports too (test_keys_golden.py): so this module
needs nothing but the standard library and the package's keys.py."""

from __future__ import annotations

import inspect
import uuid
from datetime import date, datetime, time, timedelta, timezone
from decimal import Decimal, localcontext
from enum import Enum, IntEnum, IntFlag

from celery_singleton_lock.delivery import keys

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


def var_key(args=(), kwargs=None, sig=None, lock_key=None) -> str:
    """derive() without the key() helper's own keyword names (a call may pass args=, kwargs=, sig=)."""
    return keys.derive(PREFIX, TASK, sig, tuple(args), kwargs or {}, lock_key)


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


DIGITS_40 = "1234567890123456789012345678901234567890.5"


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
