"""What differs between the Celery versions we support (5.3 through 5.7), in one place.

Each name here is Celery's own where that Celery has it, and a copy of its behaviour where not,
so the rest of the package imports one name whatever Celery is installed.
"""

from __future__ import annotations

from typing import Any

from celery.result import EagerResult

try:  # Celery >= 5.7
    from celery.app.task import get_actual_ignore_result
except ImportError:  # Celery 5.3 - 5.6: the same rule, written out
    from celery.app.task import Context

    def get_actual_ignore_result(task: Any, req: Any) -> bool:
        """Whether a result is ignored: the request's own ``ignore_result`` when it set one, else the task's.

        Celery's ``Context`` has ``ignore_result = False`` on the class, so only a value set on the
        instance counts as the request's choice.
        """
        if req is None:
            return bool(task.ignore_result)
        actual = getattr(req, "ignore_result", None)
        if isinstance(req, Context) and "ignore_result" not in req.__dict__:
            actual = None
        return bool(actual if actual is not None else task.ignore_result)


def eager_result(task_id: str, value: Any, state: str, name: str | None) -> EagerResult:
    """An ``EagerResult`` carrying the task's name where Celery takes one (5.4 and newer)."""
    try:
        return EagerResult(task_id, value, state, name=name)
    except TypeError:  # Celery 5.3: no ``name``
        return EagerResult(task_id, value, state)


__all__ = ["eager_result", "get_actual_ignore_result"]
