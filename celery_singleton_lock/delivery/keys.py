"""Identity: (task, args, kwargs) -> lock key. Pure functions, no I/O, no Celery.

The arguments are first bound to the task's signature with defaults applied,
so ``f(1)``, ``f(a=1)`` and ``f(1, b=<default>)`` are one call; ``*args`` and
``**kw`` stay under their own names, so no spelling of one call is another's.
Each value is then put in a canonical, type-tagged form that does not depend
on how it travelled: a tuple and a list are the same, dict order does not
matter, dict keys become strings the way JSON makes them, and UUID, Decimal,
datetime, date, time and bytes get fixed spellings. A value is spelt by its
base type, never by a subclass's ``__str__``/``__repr__`` (an ``IntEnum``
member keys like its int, as JSON sends it), nor by the thread's decimal
context or the process's int digit limit. The canonical form is hashed
(SHA-256), so no argument can escape the key's namespace, and the key is the
same on every process, host and Python version (the tests pin golden values
and compute them again under each installed Python).

    <prefix>:<task name>:{<32 hex digits>}

The braces are a Redis Cluster hash tag: the lock and its companion keys
share one slot.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import uuid
from collections.abc import Callable, Mapping, Sequence
from datetime import date, datetime, time, timezone
from decimal import Decimal
from typing import Any

from ..exceptions import LockKeyError

KeySpec = Sequence[str] | Callable[..., str] | None


# One encoder each, made once: json.dumps() with any non-default option builds a new
# JSONEncoder on every call. Same options, so the same output, byte for byte.
_COMPACT = json.JSONEncoder(separators=(",", ":"), ensure_ascii=True)
_SORTED = json.JSONEncoder(sort_keys=True)
_json_str: Callable[[str], str] = json.encoder.encode_basestring_ascii  # what _COMPACT writes for a str


def make_key(prefix: str, task_name: str, identity: Any) -> str:
    """The Redis key for ``identity`` (any canonical form) of ``task_name``."""
    blob = _COMPACT.encode(identity)
    digest = hashlib.sha256(f"{task_name}\n{blob}".encode()).hexdigest()[:32]
    return f"{prefix}:{task_name}:{{{digest}}}"


_SIMPLE = inspect.Parameter.POSITIONAL_OR_KEYWORD
_VAR_POSITIONAL = inspect.Parameter.VAR_POSITIONAL
_VAR_KEYWORD = inspect.Parameter.VAR_KEYWORD
_NO_DEFAULT = inspect.Parameter.empty


class _Shape:
    """What derive() needs to know about a signature, worked out once per signature."""

    __slots__ = ("sig", "plan", "var_positional", "var_keyword")

    def __init__(self, sig: inspect.Signature) -> None:
        params = sig.parameters.values()
        self.sig = sig  # held, so its id is not reused while cached
        # (name, default) per parameter when every parameter is plain positional-or-keyword: the fast path
        self.plan = tuple((p.name, p.default) for p in params) if all(p.kind is _SIMPLE for p in params) else None
        self.var_positional = next((p.name for p in params if p.kind is _VAR_POSITIONAL), None)
        self.var_keyword = next((p.name for p in params if p.kind is _VAR_KEYWORD), None)


_shapes: dict[int, _Shape] = {}


def _shape(sig: inspect.Signature) -> _Shape:
    hit = _shapes.get(id(sig))
    if hit is not None and hit.sig is sig:
        return hit
    if len(_shapes) >= 1024:  # signatures made per call (not a task's): keep the cache small
        _shapes.clear()
    shape = _shapes[id(sig)] = _Shape(sig)
    return shape


def bind_arguments(sig: inspect.Signature, args: Sequence[Any], kwargs: Mapping[str, Any],
                   partial: bool = False) -> dict[str, Any]:
    """Arguments by parameter name, defaults applied, as Python binds them (``partial``: the ones given
    may leave out parameters that have no default, as ``Signature.bind_partial``).

    ``*args`` is a tuple under its own name and ``**kw`` a dict under its own name,
    never merged with the named parameters: ``f(1)`` and ``f(args=[1])`` fill
    different parameters of ``f(*args, **kwargs)``, so they must not look alike.
    """
    if not kwargs and not partial:
        # The common call, positional arguments only, to a plain signature: what
        # sig.bind + apply_defaults give, without their cost. Anything else (and
        # every error) goes the general way below.
        plan = _shape(sig).plan
        if plan is not None and len(args) <= len(plan):
            named = dict(zip([name for name, _ in plan], args, strict=False))
            for name, default in plan[len(args):]:
                if default is _NO_DEFAULT:
                    break
                named[name] = default
            else:
                return named
    try:
        bound = sig.bind_partial(*args, **kwargs) if partial else sig.bind(*args, **kwargs)
    except TypeError as exc:
        raise LockKeyError(f"cannot derive a lock key: the arguments do not fit the task: {exc}") from None
    bound.apply_defaults()
    return dict(bound.arguments)


def derive(
    prefix: str,
    task_name: str,
    sig: inspect.Signature,
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
    lock_key: KeySpec = None,
    partial: bool = False,
) -> str:
    """The lock key of one call, per the task's ``lock_key`` option. ``partial`` (the operators' ``locks
    key``): with ``lock_key`` a list of names, the arguments may give those alone."""
    if callable(lock_key):
        try:
            custom = lock_key(*args, **kwargs)
        except Exception as exc:
            # the user's own error, told where it happened: which task, which option
            raise LockKeyError(
                f"task {task_name!r}: the lock_key callable raised {type(exc).__name__}: {exc}"
            ) from exc
        if not isinstance(custom, str):
            raise LockKeyError(
                f"lock_key callable of task {task_name!r} must return a str, "
                f"got {type(custom).__name__}: {custom!r}"
            )
        return make_key(prefix, task_name, ["key", str.__str__(custom)])
    named = bind_arguments(sig, args, kwargs, partial=partial and isinstance(lock_key, (list, tuple)))
    if lock_key is None:
        identity = [[name, canonical(named[name], name)] for name in sorted(named)]
    else:
        shape = _shape(sig)
        identity = []
        for name in lock_key:
            if name in named and name != shape.var_positional and name != shape.var_keyword:
                value = named[name]
            else:
                value = _pick(task_name, shape, named, name)
            identity.append([name, canonical(value, name)])
    return make_key(prefix, task_name, identity)


class KeyMaker:
    """:func:`derive` for one task, with what is per task worked out once (one per task and process).

    Why: a task's key is derived on every execution, and most of derive()'s work (binding the
    signature, ordering the names, the key's prefix) depends on the task, not on the call. The
    common call (positional arguments only, to a plain signature, keyed on every argument or on
    a list of named parameters) then costs one canonical() per argument and one hash; every other
    call, and every error, goes through :func:`derive` itself, so the keys are the same.
    """

    __slots__ = ("prefix", "task_name", "sig", "lock_key", "_head", "_salt", "_plan", "_fewest", "_most")

    def __init__(self, prefix: str, task_name: str, sig: inspect.Signature, lock_key: KeySpec = None) -> None:
        self.prefix, self.task_name, self.sig, self.lock_key = prefix, task_name, sig, lock_key
        self._head = f"{prefix}:{task_name}:{{"
        self._salt = f"{task_name}\n"
        plan = _shape(sig).plan
        # how many positional arguments bind without an error (a plain signature's defaults come last)
        self._most = len(plan or ())
        self._fewest = sum(1 for _, default in plan or () if default is _NO_DEFAULT)
        # (name as JSON, name, position, default) in the order derive() writes them: sorted, or lock_key's
        self._plan: tuple[tuple[str, str, int, Any], ...] | None = None
        if plan is not None and not callable(lock_key):
            where = {name: (i, default) for i, (name, default) in enumerate(plan)}
            names = sorted(where) if lock_key is None else list(lock_key)
            if all(name in where for name in names):
                self._plan = tuple((_json_str(name), name, *where[name]) for name in names)

    def __call__(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> str:
        plan = self._plan
        n = len(args)
        if plan is not None and not kwargs and self._fewest <= n <= self._most:
            # the JSON derive() writes for [[name, canonical(value)], ...], each pair spelt by _spelt
            blob = ",".join([f"[{head},{_spelt(args[i] if i < n else default, name)}]"
                             for head, name, i, default in plan])
            return self._head + hashlib.sha256(f"{self._salt}[{blob}]".encode()).hexdigest()[:32] + "}"
        return derive(self.prefix, self.task_name, self.sig, args, kwargs, self.lock_key)


def _spelt(value: Any, path: str) -> str:
    """``_COMPACT.encode(canonical(value, path))``, with the commonest arguments (an int, a str) spelt by
    hand: the same text, without building the canonical form and walking it again."""
    kind = type(value)
    if kind is int and -_DIGITS_SAFE < value < _DIGITS_SAFE:
        return '["int","' + int.__repr__(value) + '"]'
    if kind is str:
        return _json_str(value)
    return _COMPACT.encode(canonical(value, path))


def _pick(task_name: str, shape: _Shape, named: dict[str, Any], name: str) -> Any:
    """The argument ``lock_key`` names that is no named parameter's: one passed through ``**kw``.

    Never None for an argument the call did not pass: every such call would share one key.
    """
    if name == shape.var_positional or name == shape.var_keyword:
        star = "*" if name == shape.var_positional else "**"
        raise LockKeyError(
            f"task {task_name!r}: lock_key names {name!r}, the task's {star}{name} parameter itself; "
            "name the arguments to key on"
        )
    if name in named:
        return named[name]
    if name in shape.sig.parameters:  # (a call bound in part, for an operator: this one is not given)
        raise LockKeyError(f"cannot derive a lock key: the arguments do not fit the task: "
                           f"missing a required argument: {name!r}")
    if shape.var_keyword is not None:
        extra = named[shape.var_keyword]
        if name in extra:
            return extra[name]
        raise LockKeyError(
            f"task {task_name!r}: lock_key names {name!r}, which this call does not pass: it is no named "
            f"parameter of the task, so it can only arrive through **{shape.var_keyword}"
        )
    raise LockKeyError(
        f"task {task_name!r}: lock_key names {name!r}, which is not a parameter of the task "
        f"(parameters: {', '.join(shape.sig.parameters) or 'none'})"
    )


def canonical(value: Any, path: str = "value") -> Any:
    """A JSON-ready, type-tagged form of ``value`` that is equal exactly when the values are.

    ``path`` names where the value sits (``order['items'][0]``), for the error.

    A value is spelt by what it is, through its base type's own methods, never
    through a subclass's overrides, the Python version or the process's
    settings: an ``IntEnum`` member or an int subclass keys like its int (what
    JSON sends; ``str()`` of one differs between classes and Python versions),
    a str subclass like its text, a Decimal without the thread's decimal
    context. Containers are the exception: JSON (and pickle) send a dict or
    list subclass as its own ``items()`` / iteration, so the key follows them too.
    """
    kind = type(value)
    # exact types first: the common case, and no subclass can intervene
    if kind is str or value is None or kind is bool:
        return value
    if kind is int:  # as digits: no float precision loss in any JSON reader
        return ["int", repr(value) if -_DIGITS_SAFE < value < _DIGITS_SAFE else _int_text(value)]
    if kind is float:
        return ["float", repr(value + 0.0)]  # + 0.0 turns -0.0 into 0.0: equal values, one key
    if kind is list or kind is tuple:
        return ["list", [canonical(v, f"{path}[{i}]") for i, v in enumerate(value)]]
    if kind is dict:
        return _canonical_items(value.items(), path)
    return _canonical_other(value, path)


def _canonical_other(value: Any, path: str) -> Any:
    """canonical() for everything but the exact JSON types: subclasses and tagged types."""
    # bool cannot be subclassed; IntEnum, IntFlag and StrEnum members land here, as their int or str
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return ["int", _int_text(int.__index__(value))]
    if isinstance(value, float):
        return ["float", float.__repr__(float.__add__(value, 0.0))]
    if isinstance(value, (list, tuple)):
        return ["list", [canonical(v, f"{path}[{i}]") for i, v in enumerate(value)]]
    if isinstance(value, Mapping):
        return _canonical_items(value.items(), path)
    if isinstance(value, (set, frozenset)):
        members = [canonical(v, f"{path}{{...}}") for v in value]
        return ["set", sorted(members, key=_SORTED.encode)]
    if isinstance(value, uuid.UUID):
        return ["uuid", uuid.UUID.__str__(value)]
    if isinstance(value, Decimal):
        return ["decimal", _decimal_text(value)]
    if isinstance(value, datetime):
        if datetime.utcoffset(value) is not None:
            value = datetime.astimezone(value, timezone.utc)
        return ["datetime", datetime.isoformat(value)]
    if isinstance(value, date):
        return ["date", date.isoformat(value)]
    if isinstance(value, time):
        return ["time", time.isoformat(value)]
    if isinstance(value, bytes):
        return ["bytes", bytes.hex(value)]
    if isinstance(value, bytearray):
        return ["bytes", bytearray.hex(value)]
    if isinstance(value, memoryview):
        return ["bytes", value.tobytes().hex()]
    raise LockKeyError(
        f"cannot derive a lock key from argument {path} of type "
        f"{type(value).__module__}.{type(value).__qualname__}: {_short(value)}. "
        "Pass lock_key=[names] to leave it out, or a lock_key callable."
    )


def _canonical_items(items: Any, path: str) -> list[Any]:
    """A dict's items, keyed as JSON writes them; when two keys write alike, the last wins, as in JSON."""
    merged: dict[str, Any] = {}
    for k, v in items:
        name = _json_key(k, path)
        merged[name] = canonical(v, f"{path}[{name!r}]")
    return ["dict", [[name, merged[name]] for name in sorted(merged)]]


def _json_key(key: Any, path: str) -> str:
    """A dict key as JSON would write it (int 1 -> "1", True -> "true"), as a plain str."""
    if isinstance(key, str):
        return str.__str__(key)
    if key is None or key is True or key is False:
        return _COMPACT.encode(key)
    if isinstance(key, int):
        return _int_text(int.__index__(key))
    if isinstance(key, float):
        return _COMPACT.encode(float.__add__(key, -0.0))  # x + -0.0 is x, -0.0 included: a plain float
    raise LockKeyError(
        f"cannot derive a lock key from argument {path}: dict key {key!r} "
        f"of type {type(key).__name__} is not a str, int, float, bool or None"
    )


# int -> decimal text is refused past sys.get_int_max_str_digits() (PYTHONINTMAXSTRDIGITS, at
# least 640, 4300 by default): a key must not depend on that setting, nor fail with a ValueError.
_DIGITS_SAFE = 10**640  # below: int.__repr__ always works
_DIGITS_JSON = 10**4300  # from here: JSON cannot write it (by default), hex is linear where decimal is not
_CHUNK_DIGITS = 600
_CHUNK = 10**_CHUNK_DIGITS


def _int_text(n: int) -> str:
    """A plain int's text: its decimal digits, as JSON writes them; "0x..." beyond 4300 digits."""
    if -_DIGITS_SAFE < n < _DIGITS_SAFE:
        return int.__repr__(n)
    if -_DIGITS_JSON < n < _DIGITS_JSON:
        sign, n = ("-", -n) if n < 0 else ("", n)
        chunks = []
        while n:
            n, low = divmod(n, _CHUNK)
            chunks.append(low)
        head = int.__repr__(chunks.pop())
        return sign + head + "".join(f"{low:0{_CHUNK_DIGITS}d}" for low in reversed(chunks))
    return format(n, "#x")


_SPECIALS = {"F": "Infinity", "n": "NaN", "N": "sNaN"}


def _decimal_text(value: Decimal) -> str:
    """``str(value.normalize())``, written out by hand from the digits.

    ``normalize()`` rounds to the thread's decimal context (precision, exponent
    range) and ``str()`` asks it for E or e: the same value would key
    differently in another thread. Here equal values get one text, any context:
    trailing zeros go (``1.10`` is ``1.1``, ``10`` is ``1E+1``) and every zero
    is ``0``.
    """
    sign, digits, exponent = Decimal.as_tuple(value)
    minus = "-" if sign else ""
    if isinstance(exponent, str):  # Infinity, NaN, sNaN (with its payload)
        payload = "".join(map(str, digits)).lstrip("0") if exponent != "F" else ""
        return minus + _SPECIALS[exponent] + payload
    text = "".join(map(str, digits)).lstrip("0")
    if not text:
        return "0"  # Decimal("-0") == Decimal("0.00") == 0
    stripped = text.rstrip("0")
    exponent += len(text) - len(stripped)
    text = stripped
    # what Decimal.__str__ does (scientific notation, capital E), from _pydecimal
    left = exponent + len(text)  # digits left of the point
    dot = left if exponent <= 0 and left > -6 else 1
    if dot <= 0:
        whole, fraction = "0", "." + "0" * -dot + text
    elif dot >= len(text):
        whole, fraction = text + "0" * (dot - len(text)), ""
    else:
        whole, fraction = text[:dot], "." + text[dot:]
    power = "" if left == dot else f"E{left - dot:+d}"
    return minus + whole + fraction + power


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
