"""JSON that clients send and models write, bounded in how deeply it nests.

Python's JSON decoder, jsonschema's checks and the schema rewrites recurse once per level, so
a value a few hundred levels deep (a 6 KB schema, a tool call's arguments string) raised a
RecursionError wherever it was first walked: an HTTP 500. Here a value nested more than
``MAX_DEPTH`` levels is refused where it arrives, as JSON that is not valid is."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

# Far past any schema or arguments people write (OpenAI's strict schemas allow 10 levels),
# and well inside what every recursive walk of them takes.
MAX_DEPTH = 64


def too_deep(value: Any) -> bool:
    """Whether objects and arrays nest more than ``MAX_DEPTH`` levels in ``value`` (walked
    without recursion)."""
    pending = [(value, 1)] if isinstance(value, Mapping | list | tuple) else []
    while pending:
        item, level = pending.pop()
        children = item.values() if isinstance(item, Mapping) else item
        if level > MAX_DEPTH:
            return True
        pending.extend((child, level + 1) for child in children if isinstance(child, Mapping | list | tuple))
    return False


def loads(text: str | bytes, **options: Any) -> Any:
    """``json.loads``, where a value nested more than ``MAX_DEPTH`` levels deep is a
    ``json.JSONDecodeError`` as well."""
    try:
        value = json.loads(text, **options)
        if not too_deep(value):
            return value
    except RecursionError:
        pass
    document = text if isinstance(text, str) else text.decode("utf-8", "replace")
    raise json.JSONDecodeError(f"nested more than {MAX_DEPTH} levels deep", document, 0)
