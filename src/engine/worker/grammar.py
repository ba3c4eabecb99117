"""Grammar-constrained sampling inside the worker: one llguidance matcher per constrained
sequence, the packed bitmask of the tokens each may take next, and that mask applied to the
step's logits as one tensor operation for the whole batch.

Only the rank that samples (rank 0) keeps matchers. A matcher's state is the sequence's
output so far, so a sequence that arrives again after preemption or a worker restart (its
``NewSequence`` carries the tokens already sampled) gets a fresh matcher that replays them.
Grammars are compiled once per source; each sequence deep-copies the compiled one, which also
shares llguidance's lazily built lexer states between requests with the same schema."""

from __future__ import annotations

import collections
from collections.abc import Sequence
from pathlib import Path

import llguidance
import llguidance.numpy as llg_numpy
import numpy as np
import torch

from triode.engine.structured.compiler import open_grammar_tokenizer
from triode.engine.structured.params import StructuredOutputsParams, grammar_source

_COMPILED_KEPT = 128
_NEG_INF = float("-inf")


class SequenceGrammars:
    def __init__(self, tokenizer_file: Path, vocab_size: int, *, reasoning_parser: str | None = None) -> None:
        self._tokenizer_file = tokenizer_file
        self._reasoning_parser = reasoning_parser
        self.vocab_size = vocab_size
        self.words = (vocab_size + 31) // 32
        self._tokenizers: dict[tuple[int, ...], object] = {}  # by the model's EOS ids
        self._compiled: collections.OrderedDict[tuple, object] = collections.OrderedDict()
        self._matchers: dict[str, object] = {}
        self._eos: dict[str, tuple[int, ...]] = {}
        self._executor = None

    def __contains__(self, seq_id: str) -> bool:
        return seq_id in self._matchers

    def __len__(self) -> int:
        return len(self._matchers)

    def start(
        self, seq_id: str, params: StructuredOutputsParams, eos_token_ids: Sequence[int],
        output_token_ids: Sequence[int] = (),
    ) -> None:
        """A matcher for ``seq_id`` that has consumed ``output_token_ids`` (a replay)."""
        eos = tuple(eos_token_ids)
        if eos not in self._tokenizers:
            self._tokenizers[eos] = open_grammar_tokenizer(self._tokenizer_file, self.vocab_size, eos)
        key = (params.cache_key(), eos)
        compiled = self._compiled.get(key)
        if compiled is None:
            compiled = llguidance.LLMatcher(self._tokenizers[eos], grammar_source(params, self._reasoning_parser),
                                 log_level=0)
            self._compiled[key] = compiled
            while len(self._compiled) > _COMPILED_KEPT:
                self._compiled.popitem(last=False)
        self._compiled.move_to_end(key)
        matcher = compiled.deep_copy()
        for token_id in output_token_ids:
            matcher.consume_token(token_id)
        self._matchers[seq_id] = matcher
        self._eos[seq_id] = eos

    def forget(self, seq_id: str) -> None:
        self._matchers.pop(seq_id, None)
        self._eos.pop(seq_id, None)

    def is_complete(self, seq_id: str) -> bool:
        """True once the output satisfies the grammar and nothing may follow but EOS."""
        return self._matchers[seq_id].is_stopped()

    def allowed_tokens(self, seq_ids: Sequence[str]) -> torch.Tensor:
        """[len(seq_ids), words] int32: bit ``t % 32`` of word ``t // 32`` is set where token
        ``t`` may come next. A matcher in an error state (it cannot happen when every token was
        sampled under its mask) allows only EOS, so its sequence ends instead of looping."""
        bitmask = np.zeros((len(seq_ids), self.words), dtype=np.int32)
        matchers = [self._matchers[seq_id] for seq_id in seq_ids]
        if len(matchers) == 1:
            llg_numpy.fill_next_token_bitmask(matchers[0], bitmask, 0)
        else:
            if self._executor is None:
                self._executor = llguidance.LLExecutor()
            llg_numpy.fill_next_token_bitmask_par(
                self._executor, [(m, i) for i, m in enumerate(matchers)], bitmask
            )
        for row, (seq_id, matcher) in enumerate(zip(seq_ids, matchers, strict=True)):
            if matcher.is_error():
                self._allow_only_eos(bitmask[row], seq_id)
        return torch.from_numpy(bitmask)

    def _allow_only_eos(self, row: np.ndarray, seq_id: str) -> None:
        words = row.view(np.uint32)
        words[:] = 0
        for token_id in self._eos[seq_id]:
            words[token_id // 32] |= np.uint32(1 << (token_id % 32))

    def accept(self, seq_id: str, token_id: int) -> None:
        self._matchers[seq_id].consume_token(token_id)

    def allowed_tokens_along(self, seq_id: str, drafts: Sequence[int]) -> tuple[torch.Tensor, list[bool]]:
        """The masks of a sequence verifying proposed tokens: row i for the token after the
        first i proposals ([len(drafts) + 1, words]), and whether the grammar is complete there.
        The matcher walks the proposals it allows and is rolled back; past the first it does
        not allow (whose row's mask rejects it) the rows repeat that row's mask, unread."""
        matcher = self._matchers[seq_id]
        rows = len(drafts) + 1
        bitmask = np.zeros((rows, self.words), dtype=np.int32)
        complete = []
        allowed = 0 if matcher.is_error() else matcher.validate_tokens(list(drafts))
        for row in range(min(allowed + 1, rows)):
            if matcher.is_error():
                self._allow_only_eos(bitmask[row], seq_id)
            else:
                llg_numpy.fill_next_token_bitmask(matcher, bitmask, row)
            complete.append(matcher.is_stopped())
            if row < allowed:
                matcher.consume_token(drafts[row])
        if allowed:
            matcher.rollback(allowed)
        for row in range(allowed + 1, rows):
            bitmask[row] = bitmask[allowed]
            complete.append(complete[allowed])
        return torch.from_numpy(bitmask), complete


def apply_allowed_tokens_(logits: torch.Tensor, rows: torch.Tensor | None, bitmask: torch.Tensor) -> None:
    """Sets to -inf, in place, every logit of the given rows (all rows when None) whose bit in
    ``bitmask`` [len(rows), words] is clear: the bits are unpacked by one shift against 0..31,
    for every row at once."""
    vocab = logits.shape[-1]
    bitmask = bitmask.to(logits.device, non_blocking=True)
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).bool().flatten(1)[:, :vocab]
    if rows is None:
        logits.masked_fill_(~allowed, _NEG_INF)
    else:
        logits[rows] = logits[rows].masked_fill(~allowed, _NEG_INF)
