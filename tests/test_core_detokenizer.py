"""Unit tests: incremental detokenization and stop strings (triode.engine.core.detokenizer).

Two small tokenizers trained here on local text: a byte-level BPE (GPT-2 / Llama 3 / Qwen /
SmolLM2 style), whose vocabulary is small enough that "世", "🙂" and "é" split across tokens, and
a SentencePiece-style BPE (Metaspace spaces, <0xXX> byte fallback, a decoder that strips the
first space: Llama 2 / Mistral style).
"""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from triode.engine.core.detokenizer import IncrementalDetokenizer
from triode.engine.sampling_params import SamplingParams

CORPUS = [
    "The quick brown fox jumps over the lazy dog. héllo 世界 🙂 naïve café",
    "Hello world, it's a test: ünïcödé ß 日本語 テキスト 🚀🙂 end of story.",
    "def add(a, b):\n    return a + b\n",
] * 20
ALPHABET = "ab c.é世界🙂\n"


def byte_level_tokenizer() -> PreTrainedTokenizerFast:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<|endoftext|>", "<|im_start|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|endoftext|>")


def sentencepiece_tokenizer() -> Tokenizer:
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.normalizer = normalizers.Sequence(
        [normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]
    )
    trainer = trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>", "<s>", "</s>"],
                                  limit_alphabet=30)
    tokenizer.train_from_iterator(CORPUS, trainer)
    spec = json.loads(tokenizer.to_str())
    vocab = spec["model"]["vocab"]
    for byte in range(256):
        vocab.setdefault(f"<0x{byte:02X}>", len(vocab))
    spec["model"]["byte_fallback"] = True
    spec["decoder"] = {"type": "Sequence", "decoders": [
        {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
        {"type": "ByteFallback"},
        {"type": "Fuse"},
        {"type": "Strip", "content": " ", "start": 1, "stop": 0},
    ]}
    return Tokenizer.from_str(json.dumps(spec))


TOKENIZERS = {"byte_level": byte_level_tokenizer(), "sentencepiece": sentencepiece_tokenizer()}


def backend(tokenizer) -> Tokenizer:
    return getattr(tokenizer, "backend_tokenizer", tokenizer)


def encode(tokenizer, text: str) -> list[int]:
    return backend(tokenizer).encode(text, add_special_tokens=False).ids


def stream(detok: IncrementalDetokenizer, ids: list[int], group: int = 1, **final) -> list[str]:
    """Feeds ids in groups and finishes; returns every delta, and checks each is UTF-8."""
    deltas = [detok.update(ids[i : i + group]) for i in range(0, len(ids), group)]
    deltas.append(detok.update([], finished=True, **final))
    for delta in deltas:
        delta.encode("utf-8")  # no lone surrogates
    return deltas


def test_multibyte_characters_split_across_tokens():
    tokenizer = TOKENIZERS["byte_level"]
    ids = encode(tokenizer, "héllo 世界 🙂")
    pieces = [backend(tokenizer).decode([i]) for i in ids]
    assert any("\ufffd" in piece for piece in pieces)  # the premise of the tests below
    deltas = stream(IncrementalDetokenizer(tokenizer, SamplingParams()), ids)
    assert "".join(deltas) == "héllo 世界 🙂"
    assert not any("\ufffd" in d for d in deltas)


@pytest.mark.parametrize("name", sorted(TOKENIZERS))
@settings(max_examples=150, deadline=None)
@given(data=st.data(), skip_special_tokens=st.booleans(), group=st.integers(1, 3))
def test_random_ids_stream_prefixes_of_the_one_shot_decode(name, data, skip_special_tokens, group):
    tokenizer = TOKENIZERS[name]
    vocab = backend(tokenizer).get_vocab_size()
    ids = data.draw(st.lists(st.integers(0, vocab - 1), max_size=24))
    expected = tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
    detok = IncrementalDetokenizer(tokenizer, SamplingParams(skip_special_tokens=skip_special_tokens))
    streamed = ""
    for delta in stream(detok, ids, group):
        streamed += delta
        # Never ahead of the final text: a split character is held back, not sent as U+FFFD.
        assert expected.startswith(streamed)
    assert streamed == expected == detok.output_text
    assert detok.output_token_ids == ids


@pytest.mark.parametrize("name", sorted(TOKENIZERS))
@settings(max_examples=200, deadline=None)
@given(data=st.data(), skip_special_tokens=st.booleans(), group=st.integers(1, 3),
       stop_terminated=st.booleans(), include_stop=st.booleans())
def test_deferred_decoding_gives_the_incremental_text(name, data, skip_special_tokens, group, stop_terminated,
                                                      include_stop):
    """``final_text_only`` (a FINAL_ONLY request without stop strings) decodes once at the end:
    the same final text as token by token, after any prompt context."""
    tokenizer = TOKENIZERS[name]
    vocab = backend(tokenizer).get_vocab_size()
    prompt = data.draw(st.lists(st.integers(0, vocab - 1), max_size=8))
    ids = data.draw(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=24))
    params = SamplingParams(skip_special_tokens=skip_special_tokens, include_stop_str_in_output=include_stop)
    texts = []
    for deferred in (False, True):
        detok = IncrementalDetokenizer(tokenizer, params, prompt, final_text_only=deferred)
        body = ids[:-1]
        deltas = [detok.update(body[i : i + group]) for i in range(0, len(body), group)]
        deltas.append(detok.update(ids[-1:], finished=True, stop_terminated=stop_terminated))
        if deferred:
            assert deltas[:-1] == [""] * (len(deltas) - 1)  # nothing until the end
        texts.append(("".join(deltas), detok.output_text, detok.output_token_ids))
    assert texts[1] == texts[0]


def test_deferred_decoding_does_not_apply_with_stop_strings():
    tokenizer = TOKENIZERS["byte_level"]
    detok = IncrementalDetokenizer(tokenizer, SamplingParams(stop=["fox"]), final_text_only=True)
    stream(detok, encode(tokenizer, "the quick brown fox jumps"))
    assert detok.stop_string == "fox" and detok.output_text == "the quick brown "


@pytest.mark.parametrize("name", sorted(TOKENIZERS))
@settings(max_examples=100, deadline=None)
@given(text=st.text(alphabet=ALPHABET, max_size=40))
def test_valid_text_never_streams_a_replacement_character(name, text):
    tokenizer = TOKENIZERS[name]
    ids = encode(tokenizer, text)
    deltas = stream(IncrementalDetokenizer(tokenizer, SamplingParams()), ids)
    assert not any("\ufffd" in d for d in deltas)
    assert "".join(deltas) == backend(tokenizer).decode(ids)


def test_prompt_context_keeps_the_first_space():
    tokenizer = TOKENIZERS["sentencepiece"]
    prompt = encode(tokenizer, "The fox")
    output = encode(tokenizer, "jumps over")  # "▁jumps▁over": the normalizer adds the first ▁
    assert backend(tokenizer).decode(output) == "jumps over"  # the decoder strips the space
    detok = IncrementalDetokenizer(tokenizer, SamplingParams(), prompt_token_ids=prompt)
    assert "".join(stream(detok, output)) == " jumps over"


def first_stop(text: str, stops: list[str]) -> tuple[int, int] | None:
    """(start, end) of the stop string that completes first as text grows."""
    found = [(i + len(s), i) for s in stops if (i := text.find(s)) >= 0]
    return (min(found)[1], min(found)[0]) if found else None


@pytest.mark.parametrize("name", sorted(TOKENIZERS))
@settings(max_examples=150, deadline=None)
@given(
    text=st.text(alphabet=ALPHABET, max_size=40),
    stops=st.lists(st.text(alphabet=ALPHABET, min_size=1, max_size=4), min_size=1, max_size=3),
    include=st.booleans(),
)
def test_stop_strings_end_the_output_and_never_leak(name, text, stops, include):
    tokenizer = TOKENIZERS[name]
    ids = encode(tokenizer, text)
    full = backend(tokenizer).decode(ids)
    params = SamplingParams(stop=stops, include_stop_str_in_output=include)
    detok = IncrementalDetokenizer(tokenizer, params)
    match = first_stop(full, stops)
    expected = full if match is None else full[: match[1] if include else match[0]]
    streamed = ""
    for token_id in ids:
        streamed += detok.update([token_id])
        assert expected.startswith(streamed)  # nothing of a stop string streams early
        if detok.finished:
            break
    # (A match may settle only at the end, e.g. after a run of byte tokens.)
    streamed += detok.update([], finished=True)
    assert streamed == expected
    assert detok.stop_string == (None if match is None else full[match[0] : match[1]])
    assert detok.update(ids[:1]) == ""  # finished: later tokens add nothing


def test_stop_string_prefix_is_held_back_until_it_cannot_match():
    tokenizer = TOKENIZERS["byte_level"]
    detok = IncrementalDetokenizer(tokenizer, SamplingParams(stop=["fox!"]))
    out = "".join(detok.update([i]) for i in encode(tokenizer, "The fox"))
    assert out == "The "  # "fox" could still become "fox!"
    out += "".join(detok.update([i]) for i in encode(tokenizer, " jumps"))
    assert out == "The fox ju" and not detok.finished
    assert out + detok.update([], finished=True) == "The fox jumps"


@pytest.mark.parametrize(("min_tokens", "expected"), [(0, "a"), (2, "a"), (3, "a.a"), (6, "a.a.a")])
def test_stop_strings_wait_for_min_tokens(min_tokens, expected):
    tokenizer = TOKENIZERS["byte_level"]
    a, dot = (backend(tokenizer).token_to_id(t) for t in "a.")
    detok = IncrementalDetokenizer(tokenizer, SamplingParams(stop=["."], min_tokens=min_tokens))
    text = "".join(detok.update([t]) for t in [a, dot] * 3)
    assert detok.finished and detok.stop_string == "."
    assert text == expected


@pytest.mark.parametrize("include", [False, True])
def test_stop_token_text_is_dropped_unless_included(include):
    tokenizer = TOKENIZERS["byte_level"]
    eos = backend(tokenizer).token_to_id("<|endoftext|>")
    params = SamplingParams(skip_special_tokens=False, include_stop_str_in_output=include)
    detok = IncrementalDetokenizer(tokenizer, params)
    ids = encode(tokenizer, "héllo")
    text = "".join(detok.update([i]) for i in ids)
    text += detok.update([eos], stop_terminated=True)
    assert text == "héllo" + ("<|endoftext|>" if include else "")
    assert detok.finished and detok.output_token_ids == [*ids, eos]


def test_transformers_and_tokenizers_objects_agree():
    tokenizer = TOKENIZERS["byte_level"]
    ids = encode(tokenizer, "naïve café 🚀")
    a = stream(IncrementalDetokenizer(tokenizer, SamplingParams()), ids)
    b = stream(IncrementalDetokenizer(backend(tokenizer), SamplingParams()), ids)
    assert "".join(a) == "".join(b) == "naïve café 🚀"
