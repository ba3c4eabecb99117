"""Incremental detokenization with stop strings, for one output sequence.

Decoding token by token is wrong in two ways: a character can span several tokens (byte-level
BPE splits "🙂" into byte tokens), and a decoder may treat the start of a string specially
(SentencePiece's Metaspace strips the first space). So, as vLLM does, each step decodes a short
window of ids twice, ``ids[prefix:read]`` and ``ids[prefix:]``, and the delta is what the longer
one adds. The window starts on already emitted tokens so both decodes see the same context.

Text is released only at points where the decode is settled, which makes the concatenated
deltas equal the one-shot ``decode(ids)``:
- the window's text ends with U+FFFD: a character is still incomplete (held until it is
  complete, or until the request finishes, when the one-shot decode shows U+FFFD too);
- the last token (skipped special tokens aside) is a byte-fallback token ``<0xXX>``:
  SentencePiece decodes a run of byte tokens as one unit, all of it U+FFFD if any part is
  invalid, so the run must be closed by another token first;
- the window produced no new text yet, or its start does not reproduce the prefix text.
The window slides forward only onto tokens that decode to some text, so its first token never
loses a leading space to a decoder's strip step while that space belongs to later text.

A caller that reads the text only once the request has finished (``final_text_only``, as
``OutputKind.FINAL_ONLY``) and has no stop strings gets the same text from one decode of the
window at the end, where the window's text starts with the context's (otherwise the steps are
replayed): a decode step then costs nothing per token.

Stop strings are searched in the decoded text. Unless ``include_stop_str_in_output``, the last
``len(longest stop) - 1`` characters are held back until the request finishes, so no part of a
stop string is ever streamed; on a match the output ends before (or after) it.

Logprobs name tokens one by one: ``TokenDecoder`` decodes each on its own, once per process.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Sequence
from typing import Any

import attrs

from triode.engine.outputs import Logprob
from triode.engine.sampling_params import SamplingParams
from triode.engine.worker_messages import TokenLogprobs

# Prompt tokens decoded as context for the first output token (vLLM uses 5 as well): with
# SentencePiece, "▁Paris" right after the prompt streams as " Paris", not "Paris".
PROMPT_CONTEXT_TOKENS = 5


@attrs.define
class DecodeClock:
    """Seconds the tokenizer spent decoding, summed over the detokenizers that share it (an
    engine's): timed around the decode calls only, so a deferred update costs no clock reads."""

    seconds: float = 0.0


_SPECIAL_IDS: weakref.WeakKeyDictionary[Any, frozenset[int]] = weakref.WeakKeyDictionary()


def special_token_ids(backend: Any) -> frozenset[int]:
    """The ids of ``backend``'s special added tokens, read once per tokenizer: reading them
    builds a dict of every added token, which cost a request's detokenizer a quarter of its
    set-up."""
    ids = _SPECIAL_IDS.get(backend)
    if ids is None:
        ids = _SPECIAL_IDS[backend] = frozenset(i for i, t in backend.get_added_tokens_decoder().items() if t.special)
    return ids


def _is_byte_token(token: str | None) -> bool:
    return token is not None and len(token) == 6 and token.startswith("<0x") and token[-1] == ">"


class IncrementalDetokenizer:
    """Feed sampled tokens with ``update``; stream what it returns.

    ``tokenizer`` is a ``tokenizers.Tokenizer`` or a transformers fast tokenizer (its backend
    is used directly: transformers 5 applies no clean-up of tokenization spaces to BPE models).
    """

    def __init__(
        self,
        tokenizer: Any,
        params: SamplingParams,
        prompt_token_ids: Sequence[int] = (),
        *,
        final_text_only: bool = False,
        clock: DecodeClock | None = None,
    ) -> None:
        backend = getattr(tokenizer, "backend_tokenizer", tokenizer)
        self._backend = backend
        self._clock = clock
        self._skip_special_tokens = params.skip_special_tokens
        # Skipped special tokens vanish before the decoder runs: byte runs join across them.
        self._skipped_ids = special_token_ids(backend) if params.skip_special_tokens else frozenset()
        self._stops = params.stop
        self._include_stop = params.include_stop_str_in_output
        self._min_tokens = params.min_tokens
        self._hold = 0 if self._include_stop or not self._stops else max(map(len, self._stops)) - 1
        self._deferred = final_text_only and not self._stops
        context = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:]) if prompt_token_ids else []
        self._ids = context  # the window source: a little prompt context, then output ids
        self._prefix_offset = 0
        self._read_offset = len(context)
        self._prefix_text = self._decode(context)
        self._text = ""  # settled text so far (streamed, plus the held-back tail)
        self._searched = 0  # how much of _text was already searched for stop strings
        self.output_token_ids: list[int] = []
        self.output_text = ""  # the concatenation of every delta returned so far
        self.stop_string: str | None = None  # the stop string that ended the output
        self.finished = False

    def _decode(self, ids: Sequence[int]) -> str:
        if self._clock is None:
            text: str = self._backend.decode(ids, skip_special_tokens=self._skip_special_tokens)
            return text
        started = time.perf_counter()
        text = self._backend.decode(ids, skip_special_tokens=self._skip_special_tokens)
        self._clock.seconds += time.perf_counter() - started
        return text

    def update(
        self,
        new_token_ids: Sequence[int],
        *,
        finished: bool = False,
        stop_terminated: bool = False,
    ) -> str:
        """Feeds the tokens sampled since the last call and returns the text delta to stream.

        ``finished``: the request ended (for any reason); everything held back is released.
        ``stop_terminated``: the last token is EOS or a stop token id; its text is output only
        with ``include_stop_str_in_output``; implies ``finished``. After a stop string was found
        (``stop_string`` is set, ``finished`` becomes True) later calls return "".
        """
        if self.finished:
            return ""
        if self._deferred and not (finished or stop_terminated):
            self.output_token_ids.extend(new_token_ids)  # the text waits for the end: nothing to do
            self._ids.extend(new_token_ids)
            return ""
        finished = finished or stop_terminated
        for i, token_id in enumerate(new_token_ids):
            self.output_token_ids.append(token_id)
            if stop_terminated and i == len(new_token_ids) - 1 and not self._include_stop:
                break
            self._ids.append(token_id)
            if self._deferred:
                continue
            self._advance(final=False)
            if self._check_stop():
                finished = True
                break
        if finished and self.stop_string is None:
            if self._deferred:
                self._catch_up()
            self._advance(final=True)
            self._check_stop()
        self.finished = finished
        start = len(self.output_text)
        end = len(self._text) if finished else max(start, len(self._text) - self._hold)
        delta = self._text[start:end]
        self.output_text += delta
        return delta

    def _advance(self, *, final: bool) -> None:
        """Moves the settled text forward over the unread ids, if it is settled (see above)."""
        if self._read_offset == len(self._ids):
            return
        new_text = self._decode(self._ids[self._prefix_offset :])
        if not final and (
            len(new_text) <= len(self._prefix_text)
            or new_text.endswith("\ufffd")
            or self._ends_in_byte_token()
            or not new_text.startswith(self._prefix_text)
        ):
            return
        self._text += new_text[len(self._prefix_text) :]
        next_prefix_text = self._decode(self._ids[self._read_offset :])
        if next_prefix_text:
            self._prefix_offset = self._read_offset
            self._prefix_text = next_prefix_text
        else:
            self._prefix_text = new_text
        self._read_offset = len(self._ids)

    def _catch_up(self) -> None:
        """Settles every unread id at once (deferred decoding): one decode of the window, or,
        where its text does not start with the prefix's, the steps one id at a time."""
        new_text = self._decode(self._ids[self._prefix_offset :])
        if new_text.startswith(self._prefix_text):
            self._text += new_text[len(self._prefix_text) :]
            self._read_offset = len(self._ids)
            return
        unread = self._ids[self._read_offset :]
        del self._ids[self._read_offset :]
        for token_id in unread:
            self._ids.append(token_id)
            self._advance(final=False)

    def _ends_in_byte_token(self) -> bool:
        for i in range(len(self._ids) - 1, self._prefix_offset - 1, -1):
            if self._ids[i] not in self._skipped_ids:
                return _is_byte_token(self._backend.id_to_token(self._ids[i]))
        return False

    def _check_stop(self) -> bool:
        """Searches the text added since the last search (plus the overlap a stop string can
        straddle) and cuts the output at the match that completes first."""
        searched, self._searched = self._searched, len(self._text)
        if not self._stops or len(self.output_token_ids) < self._min_tokens:
            return False
        best: tuple[int, int, str] | None = None  # (end, start, stop)
        for stop in self._stops:
            start = self._text.find(stop, max(0, searched - len(stop) + 1))
            if start >= 0 and (best is None or (start + len(stop), start) < best[:2]):
                best = (start + len(stop), start, stop)
        if best is None:
            return False
        end, start, self.stop_string = best
        self._text = self._text[: end if self._include_stop else start]
        return True


class TokenDecoder:
    """Each token decoded on its own (``Logprob.decoded_token``), cached: logprobs name the same
    few thousand tokens again and again."""

    def __init__(self, tokenizer: Any) -> None:
        self._backend = getattr(tokenizer, "backend_tokenizer", tokenizer)
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self._cache[token_id] = self._backend.decode([token_id], skip_special_tokens=False)
        return text

    def logprobs(self, entry: TokenLogprobs) -> dict[int, Logprob]:
        """vLLM's dict for one position: the chosen token first, then the top-N (a chosen token
        among them keeps its place and takes its top-N rank, as in vLLM)."""
        out = {entry.token_id: Logprob(entry.logprob, entry.rank, self(entry.token_id))}
        for rank, (token_id, logprob) in enumerate(entry.top, start=1):
            out[token_id] = Logprob(logprob, rank, self(token_id))
        return out
