"""Logprobs in OpenAI's two shapes, from the engine's vLLM-shaped ``{token_id: Logprob}``
dicts, with token strings and bytes decoded from the tokenizer.

A token's bytes come from its vocabulary entry (byte-level BPE alphabets and SentencePiece
byte-fallback tokens mapped back to raw bytes), so a token that holds half of a UTF-8
character reports its true bytes; its string is those bytes decoded with replacement."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from functools import lru_cache
from typing import Any

from triode.engine.outputs import Logprob

_FLOOR = -9999.0  # JSON has no -Infinity


def _finite(value: float) -> float:
    return value if math.isfinite(value) else _FLOOR


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2's printable alphabet for the 256 byte values, inverted."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) \
        + list(range(ord("®"), ord("ÿ") + 1))
    codes = printable[:]
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            codes.append(256 + extra)
            extra += 1
    return {chr(code): byte for byte, code in zip(printable, codes, strict=True)}


class TokenText:
    def __init__(self, tokenizer: Any) -> None:
        backend = getattr(tokenizer, "backend_tokenizer", tokenizer)
        self._backend = backend
        decoder = (json.loads(backend.to_str()).get("decoder") or {})
        parts = decoder.get("decoders", []) if decoder.get("type") == "Sequence" else [decoder]
        self._byte_level = any(p.get("type") == "ByteLevel" for p in parts)
        self._cache: dict[int, tuple[str, bytes]] = {}

    def __call__(self, token_id: int) -> tuple[str, bytes]:
        cached = self._cache.get(token_id)
        if cached is None:
            raw = self._bytes(token_id)
            cached = self._cache[token_id] = (raw.decode("utf-8", errors="replace"), raw)
        return cached

    def _bytes(self, token_id: int) -> bytes:
        piece = self._backend.id_to_token(token_id)
        if piece is None:
            return b""
        if self._byte_level:
            table = _byte_decoder()
            return b"".join(bytes([table[c]]) if c in table else c.encode() for c in piece)
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            try:
                return bytes([int(piece[3:5], 16)])
            except ValueError:
                pass
        return piece.replace("▁", " ").encode()

    def text(self, token_id: int) -> str:
        return self(token_id)[0]


def top_entries(entry: dict[int, Logprob], count: int) -> list[tuple[int, Logprob]]:
    """The ``count`` most likely tokens of a position, most likely first. The chosen token is in
    the dict even when it is not among them (its rank then exceeds ``count``)."""
    ranked = sorted(entry.items(), key=lambda item: item[1].rank if item[1].rank is not None else math.inf)
    return ranked[:count]


class CompletionLogprobs:
    """``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}`` for one choice; keeps the
    text offset across streamed chunks."""

    def __init__(self, token_text: TokenText, top_count: int, *, start_offset: int = 0) -> None:
        self.token_text = token_text
        self.top_count = top_count
        self.offset = start_offset

    def format(self, token_ids: Sequence[int], entries: Sequence[dict[int, Logprob] | None]) -> dict[str, list]:
        out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for token_id, entry in zip(token_ids, entries, strict=False):
            text = self.token_text.text(token_id)
            out["tokens"].append(text)
            out["text_offset"].append(self.offset)
            self.offset += len(text)
            if entry is None:  # the first prompt token has no logprob
                out["token_logprobs"].append(None)
                out["top_logprobs"].append(None)
                continue
            chosen = _finite(entry[token_id].logprob)
            out["token_logprobs"].append(chosen)
            top: dict[str, float] = {}
            for alternative, logprob in top_entries(entry, self.top_count):
                top.setdefault(self.token_text.text(alternative), _finite(logprob.logprob))  # keep the likelier
            top.setdefault(text, chosen)
            out["top_logprobs"].append(top)
        return out


def chat_logprobs(token_text: TokenText, token_ids: Sequence[int], entries: Sequence[dict[int, Logprob]],
                  top_count: int) -> dict[str, Any]:
    """``{"content": [{"token", "logprob", "bytes", "top_logprobs"}], "refusal": None}``."""

    def item(token_id: int, logprob: Logprob) -> dict[str, Any]:
        text, raw = token_text(token_id)
        return {"token": text, "logprob": _finite(logprob.logprob), "bytes": list(raw)}

    content = [
        {**item(token_id, entry[token_id]),
         "top_logprobs": [item(t, lp) for t, lp in top_entries(entry, top_count)]}
        for token_id, entry in zip(token_ids, entries, strict=False)
    ]
    return {"content": content, "refusal": None}
