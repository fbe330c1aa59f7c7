"""Identity: (task, args, kwargs) -> lock key. Pure functions, no I/O, no Celery.

The arguments are first bound to the task's signature with defaults applied,
so ``f(1)``, ``f(a=1)`` and ``f(1, b=<default>)`` are one call. Each value is
then put in a canonical, type-tagged form that does not depend on how it
travelled: a tuple and a list are the same, dict order does not matter, dict
keys become strings the way JSON makes them, and UUID, Decimal, datetime,
date, time and bytes get fixed spellings. The canonical form is hashed
(SHA-256), so no argument can escape the key's namespace, and the key is the
same on every process, host and Python version (the tests pin golden values).

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

from .exceptions import LockKeyError

KeySpec = Sequence[str] | Callable[..., str] | None


# One encoder each, made once: json.dumps() with any non-default option builds a new
# JSONEncoder on every call. Same options, so the same output, byte for byte.
_COMPACT = json.JSONEncoder(separators=(",", ":"), ensure_ascii=True)
_SORTED = json.JSONEncoder(sort_keys=True)


def make_key(prefix: str, task_name: str, identity: Any) -> str:
    """The Redis key for ``identity`` (any canonical form) of ``task_name``."""
    blob = _COMPACT.encode(identity)
    digest = hashlib.sha256(f"{task_name}\n{blob}".encode()).hexdigest()[:32]
    return f"{prefix}:{task_name}:{{{digest}}}"


_SIMPLE = inspect.Parameter.POSITIONAL_OR_KEYWORD
_NO_DEFAULT = inspect.Parameter.empty
_plans: dict[int, tuple[inspect.Signature, tuple[tuple[str, Any], ...] | None]] = {}


def _plan(sig: inspect.Signature) -> tuple[tuple[str, Any], ...] | None:
    """(name, default) per parameter when every parameter is plain positional-or-keyword, else None.

    Worked out once per signature (a task's is made once, at bind time).
    """
    hit = _plans.get(id(sig))
    if hit is not None and hit[0] is sig:
        return hit[1]
    params = sig.parameters.values()
    plan = tuple((p.name, p.default) for p in params) if all(p.kind is _SIMPLE for p in params) else None
    if len(_plans) >= 1024:  # signatures made per call (not a task's): keep the cache small
        _plans.clear()
    _plans[id(sig)] = (sig, plan)  # holds sig, so its id is not reused while cached
    return plan


def bind_arguments(sig: inspect.Signature, args: Sequence[Any], kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """Arguments by parameter name, defaults applied; ``**kw`` is flattened in."""
    if not kwargs:
        # The common call, positional arguments only, to a plain signature: what
        # sig.bind + apply_defaults give, without their cost. Anything else (and
        # every error) goes the general way below.
        plan = _plan(sig)
        if plan is not None and len(args) <= len(plan):
            named = dict(zip([name for name, _ in plan], args, strict=False))
            for name, default in plan[len(args):]:
                if default is _NO_DEFAULT:
                    break
                named[name] = default
            else:
                return named
    try:
        bound = sig.bind(*args, **kwargs)
    except TypeError as exc:
        raise LockKeyError(f"cannot derive a lock key: the arguments do not fit the task: {exc}") from None
    bound.apply_defaults()
    named: dict[str, Any] = {}
    for name, value in bound.arguments.items():
        if sig.parameters[name].kind is inspect.Parameter.VAR_KEYWORD:
            named.update(value)
        else:
            named[name] = value
    return named


def derive(
    prefix: str,
    task_name: str,
    sig: inspect.Signature,
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
    lock_key: KeySpec = None,
) -> str:
    """The lock key of one call, per the task's ``lock_key`` option."""
    if callable(lock_key):
        custom = lock_key(*args, **kwargs)
        if not isinstance(custom, str):
            raise LockKeyError(
                f"lock_key callable of task {task_name!r} must return a str, "
                f"got {type(custom).__name__}: {custom!r}"
            )
        return make_key(prefix, task_name, ["key", custom])
    named = bind_arguments(sig, args, kwargs)
    names = sorted(named) if lock_key is None else list(lock_key)
    identity = []
    for name in names:
        identity.append([name, canonical(named.get(name), name)])
    return make_key(prefix, task_name, identity)


def canonical(value: Any, path: str = "value") -> Any:
    """A JSON-ready, type-tagged form of ``value`` that is equal exactly when the values are.

    ``path`` names where the value sits (``order['items'][0]``), for the error.
    """
    # bool before int: True is an int in Python but a different JSON value
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return ["int", str(value)]  # no float precision loss in any JSON reader
    if isinstance(value, float):
        return ["float", repr(value + 0.0)]  # + 0.0 turns -0.0 into 0.0: equal values, one key
    if isinstance(value, (list, tuple)):
        return ["list", [canonical(v, f"{path}[{i}]") for i, v in enumerate(value)]]
    if isinstance(value, Mapping):
        items = []
        for k, v in value.items():
            name = _json_key(k, path)
            items.append([name, canonical(v, f"{path}[{name!r}]")])
        items.sort(key=lambda kv: kv[0])
        return ["dict", items]
    if isinstance(value, (set, frozenset)):
        members = [canonical(v, f"{path}{{...}}") for v in value]
        return ["set", sorted(members, key=_SORTED.encode)]
    if isinstance(value, uuid.UUID):
        return ["uuid", str(value)]
    if isinstance(value, Decimal):
        if value.is_zero():
            return ["decimal", "0"]  # Decimal("-0") == Decimal("0.00") == 0
        return ["decimal", str(value.normalize()) if value.is_finite() else str(value)]
    if isinstance(value, datetime):
        if value.tzinfo is not None and value.utcoffset() is not None:
            return ["datetime", value.astimezone(timezone.utc).isoformat()]
        return ["datetime", value.isoformat()]
    if isinstance(value, date):
        return ["date", value.isoformat()]
    if isinstance(value, time):
        return ["time", value.isoformat()]
    if isinstance(value, (bytes, bytearray, memoryview)):
        return ["bytes", bytes(value).hex()]
    raise LockKeyError(
        f"cannot derive a lock key from argument {path} of type "
        f"{type(value).__module__}.{type(value).__qualname__}: {_short(value)}. "
        "Pass lock_key=[names] to leave it out, or a lock_key callable."
    )


def _json_key(key: Any, path: str) -> str:
    """A dict key as JSON would write it (int 1 -> "1", True -> "true")."""
    if isinstance(key, str):
        return key
    if key is None or isinstance(key, (bool, int, float)):
        return json.dumps(key)
    raise LockKeyError(
        f"cannot derive a lock key from argument {path}: dict key {key!r} "
        f"of type {type(key).__name__} is not a str, int, float, bool or None"
    )


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
