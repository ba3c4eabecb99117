"""Markers in streamed text: a marker such as ``</think>`` or ``<tool_call>`` may arrive cut
across two pieces, so what ends a piece and could begin the marker is held back until the
next piece says. Shared by the reasoning parsers and the tool-call parsers."""

from __future__ import annotations


def held_prefix(text: str, marker: str) -> int:
    """The length of the longest end of ``text`` that begins ``marker`` (it may be cut)."""
    for size in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


def split_at(text: str, marker: str) -> tuple[str, str, bool]:
    """(what may be released, what is kept, whether ``marker`` was found): the text before
    the marker and the text after it, or, without it, all but an end that may begin it."""
    start = text.find(marker)
    if start >= 0:
        return text[:start], text[start + len(marker):], True
    keep = held_prefix(text, marker)
    return text[:len(text) - keep], text[len(text) - keep:], False
