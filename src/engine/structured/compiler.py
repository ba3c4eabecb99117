"""Compiling a request's structured_outputs in the engine process, before it is scheduled:
an invalid schema, regex or grammar is refused there with the field named (HTTP 400), and so
is one whose compilation takes longer than ``EngineArgs.structured_outputs_compile_timeout``,
so the worker never meets a grammar it cannot run.

Compilation runs on a small thread pool and is waited for with a deadline; llguidance's own
limits (lexer fuel, grammar size) end a runaway compilation that the deadline abandoned.
Callers are threads already (the intake actor hands prompt processing to ``trio.to_thread``;
``LLMEngine.add_request`` runs on the caller's thread), never the trio event loop."""

from __future__ import annotations

import collections
import concurrent.futures
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from triode.engine.errors import InvalidRequestError
from triode.engine.structured.params import FIELD, StructuredOutputsParams, grammar_source

_REMEMBERED = 512  # compiled (or refused) constraints remembered by their source


def open_grammar_tokenizer(tokenizer_file: Path, vocab_size: int, eos_token_ids: Sequence[int]):
    """llguidance's view of the model's tokenizer (0.4 s at a 49k vocabulary, 2 s at 152k)."""
    from llguidance import LLTokenizer

    return LLTokenizer(tokenizer_file.read_text(), n_vocab=vocab_size,
                       eos_token=list(eos_token_ids) or None)


def compile_error(tokenizer, source: str) -> str:
    """llguidance's message for a grammar that does not compile against ``tokenizer``, or "".
    The first mask is computed too: llguidance builds its lexer lazily."""
    from llguidance import LLMatcher

    matcher = LLMatcher(tokenizer, source, log_level=0)
    if not matcher.is_error():
        matcher.compute_bitmask()
    return matcher.get_error() if matcher.is_error() else ""


class GrammarCompiler:
    def __init__(
        self, tokenizer_file: Path, *, vocab_size: int, eos_token_ids: Sequence[int], timeout_s: float,
        reasoning_parser: str | None = None,
    ) -> None:
        self._reasoning_parser = reasoning_parser
        self._tokenizer_args = (tokenizer_file, vocab_size, tuple(eos_token_ids))
        self._tokenizer = None
        self._tokenizer_refused = ""  # llguidance's reason, where it took no view of the tokenizer
        self._tokenizer_lock = threading.Lock()
        self._timeout_s = timeout_s
        self._pool = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="triode-grammar")
        self._outcomes: collections.OrderedDict[str, str] = collections.OrderedDict()  # key -> error
        self._lock = threading.Lock()

    def _grammar_tokenizer(self):
        """llguidance's view of the tokenizer, built once. A tokenizer it refuses (one with
        more tokens than the model's vocabulary) refuses every constraint, naming the reason:
        the request is fine, this model cannot constrain its output."""
        with self._tokenizer_lock:
            if self._tokenizer is None and not self._tokenizer_refused:
                try:
                    self._tokenizer = open_grammar_tokenizer(*self._tokenizer_args)
                except ValueError as error:
                    self._tokenizer_refused = str(error)
            if self._tokenizer_refused:
                raise InvalidRequestError(f"{FIELD}: this model's tokenizer cannot constrain its output "
                                          f"(llguidance: {self._tokenizer_refused})", field=FIELD)
            return self._tokenizer

    def check(self, params: StructuredOutputsParams) -> None:
        """Raises ``InvalidRequestError`` naming the field unless ``params`` compiles in time."""
        key = params.cache_key()
        with self._lock:
            error = self._outcomes.get(key)
            if error is not None:
                self._outcomes.move_to_end(key)
        if error is None:
            error = self._compile(params)
            with self._lock:
                self._outcomes[key] = error
                while len(self._outcomes) > _REMEMBERED:
                    self._outcomes.popitem(last=False)
        if error:
            field = f"{FIELD}.{params.kind}"
            raise InvalidRequestError(f"{field}: {_readable(params, error)}", field=field)

    def _compile(self, params: StructuredOutputsParams) -> str:
        if params.kind == "json" and not isinstance(params.json, bool):
            if error := _schema_error(params.json):
                return error
        try:
            source = grammar_source(params, self._reasoning_parser)
        except ValueError as error:
            return str(error)
        tokenizer = self._grammar_tokenizer()  # once per engine; not the request's to wait on
        started = time.monotonic()
        future = self._pool.submit(compile_error, tokenizer, source)
        try:
            error = future.result(timeout=self._timeout_s)
        except concurrent.futures.TimeoutError:
            error = None
        # A compilation that finished past the bound, before this thread looked, is as slow.
        if error is None or time.monotonic() - started > self._timeout_s:
            return (f"compiling the constraint took longer than {self._timeout_s:g} s "
                    f"(structured_outputs_compile_timeout); simplify it")
        return error


def _readable(params: StructuredOutputsParams, error: str) -> str:
    # llguidance reports a regex error against the one-rule grammar it wraps the regex in;
    # the line that says what is wrong is the one the client needs.
    reason = next((line.removeprefix("error: ") for line in error.splitlines()
                   if line.startswith("error: ")), None)
    if params.kind == "regex" and reason is not None:
        return f"invalid regular expression {params.regex!r}: {reason}"
    if "\n<state>\n" in error:
        # A constraint that compiles but stops the parser at once (a schema that refers only to
        # itself, a grammar rule that never ends, a regex matching no character): llguidance
        # follows its stop reason with a dump of its parser's state, which says nothing to a client.
        stop = error.split("\n", 1)[0]
        return f"admits no output: no token of the model can begin it ({stop})"
    return error.strip()


def _schema_error(schema) -> str:
    """A JSON schema checked against its metaschema (Draft 2020-12 unless ``$schema`` says)."""
    import jsonschema

    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as error:
        where = "/".join(str(part) for part in error.absolute_path) or "the schema"
        return f"is not a valid JSON Schema at {where}: {error.message}"
    return ""
