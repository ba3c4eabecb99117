"""POST /tokenize (a prompt, or chat messages through the model's template) and
POST /detokenize, with the engine's own tokenizer and template."""

from __future__ import annotations

import attrs
import trio
from quart import Blueprint, Response, jsonify, request

from triode.engine.errors import InvalidRequestError
from triode.frontend.openai.errors import bad_request, from_engine_error
from triode.frontend.openai.request_body import Reader, read_json_object
from triode.frontend.openai.requests import parse_chat_options
from triode.frontend.routes import check_chat_template, check_model, host, with_server_chat_template

blueprint = Blueprint("tokens", __name__)


@blueprint.post("/tokenize")
async def tokenize() -> Response:
    reader = Reader(await read_json_object(request), "/tokenize")
    check_model(reader.string("model"))
    llm = host().require_ready()
    tokenizer, processor = llm.tokenizer, llm.intake.processor
    return_strs = reader.bool("return_token_strs", False)
    if reader.body.get("messages") is not None:
        chat = parse_chat_options(reader)
        check_chat_template(chat)
        chat = with_server_chat_template(chat)
        if (tools := reader.raw("tools")) is not None:
            try:
                chat = attrs.evolve(chat, tools=tools or None)
            except InvalidRequestError as error:
                raise from_engine_error(error) from None
        add_special = reader.bool("add_special_tokens", False)

        def encode() -> list[int]:
            return processor.encode(processor.render_chat(chat), add_special_tokens=add_special, field="messages")
    else:
        prompt = reader.string("prompt")
        if prompt is None:
            raise bad_request("prompt: is required (or send messages)", param="prompt")
        add_special = reader.bool("add_special_tokens", True)

        def encode() -> list[int]:
            return processor.encode(prompt, add_special_tokens=add_special, field="prompt")
    reader.log_unknown()
    try:
        tokens = await trio.to_thread.run_sync(encode)
    except InvalidRequestError as e:
        raise from_engine_error(e) from None
    body = {"count": len(tokens), "max_model_len": llm.max_model_len, "tokens": tokens}
    if return_strs:
        body["token_strs"] = tokenizer.convert_ids_to_tokens(tokens)
    return jsonify(body)


@blueprint.post("/detokenize")
async def detokenize() -> Response:
    reader = Reader(await read_json_object(request), "/detokenize")
    check_model(reader.string("model"))
    llm = host().require_ready()
    tokens = reader.raw("tokens")
    if not isinstance(tokens, list):
        raise bad_request("tokens: expected an array of token ids", param="tokens")
    ids = [reader.as_int("tokens", t, minimum=0, maximum=llm.vocab_size - 1) for t in tokens]
    reader.log_unknown()
    text = await trio.to_thread.run_sync(lambda: llm.tokenizer.decode(ids))
    return jsonify({"prompt": text})
