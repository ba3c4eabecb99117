"""Prompt lookup (vLLM's ``ngram`` method): the tokens that followed the latest earlier
occurrence of the text's last n tokens, for the longest n from ``prompt_lookup_max`` down to
``prompt_lookup_min`` that occurs. Text that repeats its input (an edit, a summary quoting its
source, code refactored in place, JSON echoing its fields) is proposed whole runs at a time.

The index is incremental: each new token files the ``min``-gram it ends under that n-gram, so
a proposal looks up the suffix's candidates in a dict instead of scanning the history."""

from __future__ import annotations

from collections.abc import Iterable

# Earlier occurrences of the suffix tried for a longer match, latest first: bounds a lookup in
# a text that repeats one n-gram many times.
MAX_CANDIDATES = 32


class NgramIndex:
    """One sequence's tokens (prompt and output) and where each ``min_n``-gram ends in them."""

    def __init__(self, min_n: int, max_n: int, token_ids: Iterable[int] = ()) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.min_n = min_n
        self.max_n = max_n
        self.token_ids: list[int] = []
        self._ends: dict[tuple[int, ...], list[int]] = {}  # n-gram -> ends (exclusive), ascending
        self.extend(token_ids)

    def __len__(self) -> int:
        return len(self.token_ids)

    def extend(self, token_ids: Iterable[int]) -> None:
        tokens, n, ends = self.token_ids, self.min_n, self._ends
        for token_id in token_ids:
            tokens.append(token_id)
            end = len(tokens)
            if end >= n:
                ends.setdefault(tuple(tokens[end - n:]), []).append(end)

    def propose(self, num_tokens: int) -> tuple[int, ...]:
        """Up to ``num_tokens`` tokens to follow the text, or none when its last ``min_n``
        tokens occurred nowhere before."""
        tokens = self.token_ids
        length = len(tokens)
        if num_tokens <= 0 or length <= self.min_n:
            return ()
        ends = self._ends.get(tuple(tokens[length - self.min_n:]), ())
        best_end, best_match = 0, 0
        # ends[-1] is the suffix itself; try the others, latest first
        for end in reversed(ends[-MAX_CANDIDATES - 1:-1]):
            match = self.min_n
            while (match < self.max_n and end - match > 0
                   and tokens[end - match - 1] == tokens[length - match - 1]):
                match += 1
            if match > best_match:
                best_end, best_match = end, match
                if match == self.max_n:
                    break
        if not best_match:
            return ()
        return tuple(tokens[best_end:best_end + num_tokens])
