"""Unit tests (sans-IO, no event loop): structured-output parameters, their compilation in the
engine process (errors named, the time bound), and the worker's grammar state and logit mask,
on the tiny byte-level tokenizer."""

from __future__ import annotations

import json

import hypothesis
import hypothesis.strategies as st
import pytest
import torch

from triode import SamplingParams, StructuredOutputsParams
from triode.engine.errors import InvalidRequestError
from triode.engine.structured.compiler import GrammarCompiler
from triode.engine.structured.params import grammar_source
from triode.engine.worker.grammar import SequenceGrammars, apply_allowed_tokens_

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8}, "ok": {"type": "boolean"}},
    "required": ["name", "ok"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def tokenizer_file(tiny_tokenizer, tmp_path_factory):
    directory = tmp_path_factory.mktemp("grammar-tokenizer")
    tiny_tokenizer.save_pretrained(directory)
    return directory / "tokenizer.json"


@pytest.fixture(scope="module")
def eos(tiny_tokenizer):
    return (tiny_tokenizer.eos_token_id,)


def compiler(tokenizer_file, tiny_tokenizer, eos, timeout_s=10.0) -> GrammarCompiler:
    return GrammarCompiler(tokenizer_file, vocab_size=len(tiny_tokenizer), eos_token_ids=eos,
                           timeout_s=timeout_s)


# --- the parameters -------------------------------------------------------------------------

def _nested_schema(levels: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


@pytest.mark.parametrize("fields, field", [
    ({}, "structured_outputs"),
    ({"regex": "a+", "choice": ["a"]}, "structured_outputs"),
    ({"choice": []}, "structured_outputs.choice"),
    ({"choice": ["a", ""]}, "structured_outputs.choice"),
    ({"choice": "ab"}, "structured_outputs.choice"),
    ({"json": "{not json"}, "structured_outputs.json"),
    ({"json": 5}, "structured_outputs.json"),
    ({"regex": ""}, "structured_outputs.regex"),
    ({"grammar": "  "}, "structured_outputs.grammar"),
    ({"regex": "a", "disable_any_whitespace": None}, "structured_outputs.disable_any_whitespace"),
    ({"regex": "a", "disable_any_whitespace": "false"}, "structured_outputs.disable_any_whitespace"),
    ({"json": SCHEMA, "disable_additional_properties": 1}, "structured_outputs.disable_additional_properties"),
    ({"json_object": "x"}, "structured_outputs.json_object"),
    # each was an HTTP 500: a TypeError, a RecursionError in the schema's check or in json.loads
    *(({"choice": value}, "structured_outputs.choice") for value in (5, True, 1.5, {"a": "b"})),
    ({"json": _nested_schema(100)}, "structured_outputs.json"),
    ({"json": json.dumps(_nested_schema(400))}, "structured_outputs.json"),
    ({"json": "[" * 3000 + "]" * 3000}, "structured_outputs.json"),
])
def test_malformed_params_name_the_field(fields, field):
    with pytest.raises(InvalidRequestError) as caught:
        StructuredOutputsParams(**fields)
    assert caught.value.field == field


def test_a_json_string_is_parsed_and_params_hash():
    params = StructuredOutputsParams(json=json.dumps(SCHEMA))
    assert params.json == SCHEMA and params.kind == "json"
    assert hash(params) == hash(StructuredOutputsParams(json=SCHEMA))
    assert params == StructuredOutputsParams(json=SCHEMA)
    assert hash(SamplingParams(structured_outputs=params)) is not None


def test_sampling_params_take_a_mapping_and_reject_what_cannot_hold():
    params = SamplingParams(structured_outputs={"choice": ["yes", "no"]})
    assert params.structured_outputs == StructuredOutputsParams(choice=["yes", "no"])
    with pytest.raises(InvalidRequestError, match="unknown field 'guided_json'"):
        SamplingParams(structured_outputs={"guided_json": SCHEMA})
    with pytest.raises(InvalidRequestError) as caught:
        SamplingParams(ignore_eos=True, structured_outputs={"regex": "a"})
    assert caught.value.field == "ignore_eos"


def test_the_grammar_keeps_property_order_and_closes_objects_on_request():
    ordered = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "integer"}}}
    reordered = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}
    assert StructuredOutputsParams(json=ordered).cache_key() != StructuredOutputsParams(json=reordered).cache_key()
    # A property named "properties" is a name, not a schema to close.
    odd = {"type": "object", "properties": {"properties": {"type": "object"}}}
    closed = grammar_source(StructuredOutputsParams(json=odd, disable_additional_properties=True))
    assert json.loads(closed)["grammars"][0]["json_schema"]["properties"]["properties"] == {
        "type": "object", "additionalProperties": False}


# --- compilation in the engine process ------------------------------------------------------

@pytest.mark.parametrize("fields, match", [
    ({"json": {"type": "objekt"}}, r"structured_outputs\.json: is not a valid JSON Schema at type"),
    ({"json": {"type": "object", "properties": 5}}, r"at properties: 5 is not of type 'object'"),
    ({"json": {"type": "array", "uniqueItems": True}}, r"Unimplemented keys: \[\"uniqueItems\"\]"),
    ({"regex": "[a-"}, r"structured_outputs\.regex: invalid regular expression '\[a-': unclosed character class$"),
    ({"grammar": "start: foo"}, r"structured_outputs\.grammar: .*unknown name: \"foo\""),
    # Compiles, but stops the parser at once: its stop reason, not a dump of its state.
    ({"json": {"$ref": "#"}}, r"^structured_outputs\.json: admits no output: no token of the model can begin it "
                              r"\(NoExtensionBias\)$"),
    ({"grammar": "start: start"}, r"^structured_outputs\.grammar: admits no output"),
])
def test_constraints_that_do_not_compile_are_refused_with_the_field(
    tokenizer_file, tiny_tokenizer, eos, fields, match
):
    with pytest.raises(InvalidRequestError, match=match) as caught:
        compiler(tokenizer_file, tiny_tokenizer, eos).check(StructuredOutputsParams(**fields))
    assert caught.value.field == f"structured_outputs.{next(iter(fields))}"


def test_compilation_past_the_bound_is_refused_and_remembered(tokenizer_file, tiny_tokenizer, eos):
    slow = compiler(tokenizer_file, tiny_tokenizer, eos, timeout_s=1e-9)
    params = StructuredOutputsParams(json=SCHEMA)
    for _ in range(2):  # the second time from what the first learned
        with pytest.raises(InvalidRequestError, match="took longer than 1e-09 s"):
            slow.check(params)
    compiler(tokenizer_file, tiny_tokenizer, eos).check(params)


def test_a_tokenizer_larger_than_the_vocabulary_refuses_constraints_by_name(tokenizer_file, tiny_tokenizer, eos):
    """Found by probing: a model whose tokenizer has more tokens than its vocabulary (here 32
    fewer) made every constrained request fail with llguidance's bare ValueError, an HTTP 500
    each time; now each is refused naming the field and the reason, from what the first
    attempt learned."""
    small = GrammarCompiler(tokenizer_file, vocab_size=len(tiny_tokenizer) - 32, eos_token_ids=eos, timeout_s=10)
    for fields in ({"json": SCHEMA}, {"regex": "a+"}, {"json": SCHEMA}):
        with pytest.raises(InvalidRequestError, match="this model's tokenizer cannot constrain its output "
                                                      r"\(llguidance: vocab size too small") as caught:
            small.check(StructuredOutputsParams(**fields))
        assert caught.value.field == "structured_outputs"


# --- the worker's grammar state and the logit mask -----------------------------------------

def allowed_ids(bitmask_row: torch.Tensor, vocab: int) -> set[int]:
    return {t for t in range(vocab) if (int(bitmask_row[t // 32]) >> (t % 32)) & 1}


def walk(grammars: SequenceGrammars, seq_id: str, tokens: list[int]) -> list[set[int]]:
    masks = []
    for token in tokens:
        masks.append(allowed_ids(grammars.allowed_tokens([seq_id])[0], grammars.vocab_size))
        assert token in masks[-1]
        grammars.accept(seq_id, token)
    return masks


def test_masks_follow_the_grammar_and_a_replay_restores_the_state(tokenizer_file, tiny_tokenizer, eos):
    vocab = len(tiny_tokenizer)
    grammars = SequenceGrammars(tokenizer_file, vocab)
    params = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
    text = '{"name":"ab","ok":true}'
    tokens = tiny_tokenizer.encode(text, add_special_tokens=False)
    grammars.start("s", params, eos)
    masks = walk(grammars, "s", tokens)
    assert allowed_ids(grammars.allowed_tokens(["s"])[0], vocab) == set(eos)  # done: only EOS
    assert grammars.is_complete("s")
    letter = tiny_tokenizer.encode("a", add_special_tokens=False)[0]
    assert letter not in masks[0] and letter in masks[len(tiny_tokenizer.encode('{"name":"', add_special_tokens=False))]
    # A sequence that comes back (preemption, a worker restart) replays what it sampled.
    cut = len(tokens) // 2
    grammars.start("s2", params, eos, output_token_ids=tokens[:cut])
    assert walk(grammars, "s2", tokens[cut:]) == masks[cut:]
    grammars.forget("s")
    assert "s" not in grammars and len(grammars) == 1


def test_a_broken_matcher_allows_only_eos(tokenizer_file, tiny_tokenizer, eos):
    grammars = SequenceGrammars(tokenizer_file, len(tiny_tokenizer))
    grammars.start("s", StructuredOutputsParams(regex="ab"), eos)
    grammars.accept("s", tiny_tokenizer.encode("zz", add_special_tokens=False)[0])  # outside the mask
    assert allowed_ids(grammars.allowed_tokens(["s"])[0], len(tiny_tokenizer)) == set(eos)


@hypothesis.given(
    rows=st.integers(1, 5), vocab=st.integers(1, 100), data=st.data(),
)
def test_the_mask_sets_exactly_the_clear_bits_to_minus_infinity(rows, vocab, data):
    words = (vocab + 31) // 32
    bits = data.draw(st.lists(st.lists(st.integers(-(2**31), 2**31 - 1), min_size=words, max_size=words),
                              min_size=rows, max_size=rows))
    subset = data.draw(st.lists(st.booleans(), min_size=rows, max_size=rows))
    logits = torch.randn(rows, vocab)
    expected = logits.clone()
    chosen = [r for r in range(rows) if subset[r]] or [0]
    bitmask = torch.tensor([bits[r] for r in chosen], dtype=torch.int32)
    for row in chosen:
        for token in range(vocab):
            if not (bits[row][token // 32] >> (token % 32)) & 1:
                expected[row, token] = float("-inf")
    index = None if len(chosen) == rows else torch.tensor(chosen)
    apply_allowed_tokens_(logits, index, bitmask)
    assert torch.equal(logits, expected)


def accepts(tokenizer_file, tiny_tokenizer, eos, params: StructuredOutputsParams, text: str,
            parser: str | None = None) -> bool:
    """Whether the worker's grammar state lets ``text`` through and then end."""
    grammars = SequenceGrammars(tokenizer_file, len(tiny_tokenizer), reasoning_parser=parser)
    grammars.start("s", params, eos)
    for token in tiny_tokenizer.encode(text, add_special_tokens=False):
        if not allowed_ids(grammars.allowed_tokens(["s"])[0], len(tiny_tokenizer)) >= {token}:
            return False
        grammars.accept("s", token)
    return grammars.is_complete("s") or set(eos) <= allowed_ids(grammars.allowed_tokens(["s"])[0], len(tiny_tokenizer))


OPEN_ENDED = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.mark.parametrize("fields, text, expected", [
    # vLLM's default backend: declared properties and nothing else, unless the schema says so
    ({"json": OPEN_ENDED}, '{"a":1}', True),
    ({"json": OPEN_ENDED}, '{"a":1,"b":2}', False),
    ({"json": {**OPEN_ENDED, "additionalProperties": True}}, '{"a":1,"b":2}', True),
    ({"json": OPEN_ENDED, "disable_additional_properties": False}, '{"a":1,"b":2}', True),
    ({"json": {"type": "object"}}, '{"x":1}', True),  # nothing declared: still any object
    ({"json": {"type": "object"}, "disable_additional_properties": True}, '{"x":1}', False),
    ({"json_object": True}, '{"x":1}', True),
    ({"json": {"type": "object", "properties": {"in": OPEN_ENDED}}}, '{"in":{"a":1,"z":0}}', False),
])
def test_objects_with_declared_properties_admit_no_other_keys_by_default(
    tokenizer_file, tiny_tokenizer, eos, fields, text, expected
):
    params = StructuredOutputsParams(disable_any_whitespace=True, **fields)
    assert accepts(tokenizer_file, tiny_tokenizer, eos, params, text) == expected


@pytest.mark.parametrize("parser, may_skip_thinking", [("qwen3", True), ("deepseek_r1", False)])
def test_with_a_reasoning_parser_the_constraint_holds_after_the_thinking(
    tokenizer_file, tiny_tokenizer, eos, parser, may_skip_thinking
):
    params = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
    answer = '{"name":"ab","ok":true}'

    def accepted(text: str) -> bool:
        return accepts(tokenizer_file, tiny_tokenizer, eos, params, text, parser)

    assert accepted("<think>a { b\nc</think>\n\n" + answer)
    assert accepted(answer) == may_skip_thinking
    assert not accepted("<think>x</think>not json")
    compiler(tokenizer_file, tiny_tokenizer, eos).check(params)  # compiles wrapped too
    GrammarCompiler(tokenizer_file, vocab_size=len(tiny_tokenizer), eos_token_ids=eos, timeout_s=10,
                    reasoning_parser=parser).check(params)
