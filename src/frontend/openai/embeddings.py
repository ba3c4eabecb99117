"""``POST /v1/embeddings``'s request and response shapes (OpenAI's, with vLLM's
``truncate_prompt_tokens`` and ``normalize``). ``input`` is a string, a list of strings, token
ids or a list of token-id lists; each is one engine request. ``encoding_format`` ``base64``
sends each embedding as its little-endian float32 bytes, base64-encoded, as OpenAI does."""

from __future__ import annotations

import base64
import struct
from collections.abc import Sequence
from typing import Any

import attrs

from triode.engine.errors import InvalidRequestError
from triode.engine.outputs import EmbeddingRequestOutput
from triode.engine.pooling_params import PoolingParams
from triode.frontend.openai.errors import from_engine_error
from triode.frontend.openai.request_body import Reader, read_prompts

ENDPOINT = "/v1/embeddings"
MAX_INPUTS = 2048  # OpenAI's limit per request
ENCODINGS = ("float", "base64")


@attrs.frozen(kw_only=True)
class EmbeddingsRequest:
    model: str | None
    inputs: tuple[str | tuple[int, ...], ...]
    params: PoolingParams
    encoding_format: str
    priority: int


def parse_embeddings(body: dict[str, Any]) -> EmbeddingsRequest:
    reader = Reader(body, ENDPOINT)
    model = reader.string("model")
    inputs = read_prompts(reader, "input", limit=MAX_INPUTS, non_empty=True)
    encoding = reader.string("encoding_format", "float")
    if encoding not in ENCODINGS:
        raise reader.fail("encoding_format", f"expected float or base64, got {encoding!r}")
    reader.string("user")
    try:
        params = PoolingParams(dimensions=reader.int("dimensions"),
                               normalize=reader.bool("normalize", True) if body.get("normalize") is not None
                               else None,
                               truncate_prompt_tokens=reader.int("truncate_prompt_tokens"))
    except InvalidRequestError as error:
        raise from_engine_error(error) from None
    priority = reader.int("priority", 0)
    reader.log_unknown()
    assert encoding is not None and priority is not None
    return EmbeddingsRequest(model=model, inputs=inputs, params=params, encoding_format=encoding, priority=priority)


def embeddings_response(outputs: Sequence[EmbeddingRequestOutput], *, model: str, encoding_format: str,
                        ) -> dict[str, Any]:
    data = [{"object": "embedding", "index": index, "embedding": _encoded(output.outputs.embedding, encoding_format)}
            for index, output in enumerate(outputs)]
    tokens = sum(len(output.prompt_token_ids) for output in outputs)
    return {"object": "list", "data": data, "model": model,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


def _encoded(embedding: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "float":
        return embedding
    return base64.b64encode(struct.pack(f"<{len(embedding)}f", *embedding)).decode("ascii")
