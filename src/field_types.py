"""The simple fields of a frozen attrs config checked against their annotations.

A value of the wrong type that passes a range check (``top_k=1.5``, ``seed=1.5``,
``logprobs=True``) used to fail only inside a worker step, where every retry of the step
failed the same way until the restart budget ended the engine. Checked at construction, it is
an error naming the field. Annotations this module does not know (enums, nested configs,
mappings) are left to the class's own validation. The engine's configs and the scenario
runner's files both use it, so it imports nothing of either: callers raise their own errors.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import attrs


def _integer(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _number(value: Any) -> bool:
    return _integer(value) or (isinstance(value, float) and not math.isnan(value))


def _finite(value: Any) -> bool:
    # An int past float's range (10**400) would be infinite wherever it is used as a float.
    return (_integer(value) and abs(value) <= _LARGEST_FLOAT) or (isinstance(value, float) and math.isfinite(value))


_LARGEST_FLOAT = int(float("1.7976931348623157e308"))


def _strings(value: Any) -> bool:
    return isinstance(value, tuple) and all(isinstance(item, str) for item in value)


def _integers(value: Any) -> bool:
    return isinstance(value, tuple) and all(_integer(item) for item in value)


# annotation (as a string: the modules use postponed annotations) -> (check, what it expects)
_CHECKS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "int": (_integer, "an integer"),
    "float": (_number, "a number"),
    "bool": (lambda value: isinstance(value, bool), "true or false"),
    "str": (lambda value: isinstance(value, str), "a string"),
    "tuple[str, ...]": (_strings, "a string or a list of strings"),
    "tuple[int, ...]": (_integers, "a list of integers"),
    "tuple[int, int]": (lambda value: _integers(value) and len(value) == 2, "a pair of integers"),
}


def first_type_problem(instance: Any, *, finite: bool = False) -> tuple[str, str] | None:
    """(field, message) for the first field of ``instance`` whose value is not of its annotated
    type (``X | None`` admits None; an int is a number, a bool is not; NaN is not a number, nor
    an infinity with ``finite``), or None."""
    for field in attrs.fields(type(instance)):
        if problem := type_problem(field, getattr(instance, field.name), finite=finite):
            return field.name, problem
    return None


def type_problem(field: attrs.Attribute[Any], value: Any, *, finite: bool = False) -> str | None:
    """:func:`first_type_problem` for one field, for validators that compare the value (attrs
    runs them before ``__attrs_post_init__``): the message, or None."""
    annotation = field.type if isinstance(field.type, str) else getattr(field.type, "__name__", "")
    optional = annotation.endswith(" | None")
    known = _CHECKS.get(annotation.removesuffix(" | None"))
    if known is None or (value is None and optional):
        return None
    check, expected = known
    if check is _number and finite:
        check, expected = _finite, "a finite number"
    if check(value):
        return None
    return f"{field.name}: expected {expected}{' or None' if optional else ''}, got {_shown(value)}"


def _shown(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) <= 40 else text[:37] + '...'}"
