"""Unit tests of the engine's input processor (triode.engine.inputs) on the tiny tokenizer: the
field a chat template's failure is blamed on, and token ids the tokenizer gives past the
model's vocabulary."""

from __future__ import annotations

import copy

import pytest

from triode.engine.chat_options import ChatOptions
from triode.engine.errors import InvalidRequestError
from triode.engine.inputs import InputProcessor
from triode.engine.sampling_params import SamplingParams

# a template that refuses a role, and one that needs a variable to be a mapping
STRICT = ("{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('no system') }}"
          "{% endif %}{{ m['content'] }}{% endfor %}{% if style is defined %}{{ style.name.upper() }}{% endif %}")


@pytest.mark.parametrize("messages, kwargs, field", [
    ([{"role": "system", "content": "s"}], {"style": {"name": "a"}}, "messages"),
    ([{"role": "user", "content": "u"}], {"style": {}}, "chat_template_kwargs"),
    ([{"role": "user", "content": "u"}], {"tokenize": True}, "chat_template_kwargs"),
])
def test_a_template_failure_names_the_field_that_caused_it(tiny_tokenizer, messages, kwargs, field):
    """The kwargs are named only where the template renders without them."""
    tokenizer = copy.deepcopy(tiny_tokenizer)
    tokenizer.chat_template = STRICT
    processor = InputProcessor(tokenizer, max_model_len=512, vocab_size=len(tokenizer))
    assert processor.render_chat(ChatOptions(messages=[{"role": "user", "content": "u"}],
                                             chat_template_kwargs={"style": {"name": "a"}})) == "uA"
    with pytest.raises(InvalidRequestError) as raised:
        processor.render_chat(ChatOptions(messages=messages, chat_template_kwargs=kwargs))
    assert raised.value.field == field and str(raised.value).startswith(f"{field}: the chat template did not render")


def test_a_token_past_the_models_vocabulary_is_refused_before_it_reaches_a_worker(tiny_tokenizer):
    """Found by probing: a tokenizer with an added token past the model's vocab_size (a broken
    checkpoint) gave its id to the worker's embedding, whose IndexError on every retry ended
    the engine."""
    top = len(tiny_tokenizer) - 1
    word = tiny_tokenizer.convert_ids_to_tokens(top)
    text = tiny_tokenizer.convert_tokens_to_string([word])
    assert top in tiny_tokenizer.encode(text, add_special_tokens=False)
    processor = InputProcessor(tiny_tokenizer, max_model_len=512, vocab_size=top)
    params = SamplingParams(max_tokens=2)
    for prompt, field in [(text, "prompt"), (ChatOptions(messages=[{"role": "user", "content": text}]), "messages")]:
        with pytest.raises(InvalidRequestError, match=rf"{field}: the model's tokenizer gives token id {top} "
                                                      rf"\(.*\), outside the model's vocabulary \[0, {top}\)"):
            processor.process(prompt, params)
    assert processor.process("plain words", params).prompt_token_ids
