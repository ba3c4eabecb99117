"""Request bodies: JSON decoding, typed field reading, and the sampling fields shared by the
completion and chat endpoints. Every problem is an ``APIError(400)`` naming its ``param``."""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable
from typing import Any

import attrs
from quart import Request

from triode.engine.errors import InvalidRequestError
from triode.engine.model.generation_config import GenerationDefaults
from triode.engine.sampling_params import MAX_N, OutputKind, SamplingParams
from triode.engine.structured.params import StructuredOutputsParams
from triode.frontend.openai.errors import bad_request, from_engine_error

log = logging.getLogger("triode.frontend")

_INT64 = (-(2**63), 2**63 - 1)
_unknown_logged: set[tuple[str, str]] = set()


async def read_json_object(request: Request) -> dict[str, Any]:
    content_type = request.headers.get("Content-Type")
    if content_type:
        mimetype, _, parameters = content_type.partition(";")
        mimetype = mimetype.strip().lower()
        if mimetype != "application/json" and not mimetype.endswith("+json"):
            raise bad_request(f"unsupported Content-Type {mimetype!r}; send application/json",
                              code="unsupported_content_type")
        charset = parameters.strip().lower().removeprefix("charset=").strip('"')
        if parameters.strip().lower().startswith("charset=") and charset not in ("utf-8", "utf8"):
            raise bad_request(f"unsupported charset {charset!r}; send UTF-8", code="unsupported_content_type")
    raw = await request.get_data(as_text=False)
    if not raw.strip():
        raise bad_request("the request body is empty; expected a JSON object", code="invalid_json")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise bad_request(f"the request body is not valid UTF-8 (byte {e.start})", code="invalid_utf8") from None
    try:
        body = json.loads(text, parse_constant=_reject_constant)
    except json.JSONDecodeError as e:
        raise bad_request(f"the request body is not valid JSON: {e}", code="invalid_json") from None
    except ValueError as e:
        raise bad_request(f"the request body is not valid JSON: {e}", code="invalid_json") from None
    except RecursionError:
        raise bad_request("the request body is nested too deeply", code="invalid_json") from None
    if not isinstance(body, dict):
        raise bad_request(f"the request body must be a JSON object, not {_kind(body)}", code="invalid_json")
    return body


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _kind(value: Any) -> str:
    return {dict: "an object", list: "an array", str: "a string", bool: "a boolean",
            int: "an integer", float: "a number", type(None): "null"}.get(type(value), type(value).__name__)


class Reader:
    """Typed access to a request object's fields; None or absent means the default."""

    def __init__(self, body: dict[str, Any], endpoint: str, *, prefix: str = "") -> None:
        self.body = body
        self.endpoint = endpoint
        self.prefix = prefix
        self.used: set[str] = set()

    def raw(self, name: str) -> Any:
        self.used.add(name)
        return self.body.get(name)

    def fail(self, name: str, message: str) -> Exception:
        return bad_request(f"{self.prefix}{name}: {message}", param=self.prefix + name)

    def int(self, name: str, default: int | None = None, *, minimum: int | None = None,
            maximum: int | None = None) -> int | None:
        value = self.raw(name)
        if value is None:
            return default
        return self.as_int(name, value, minimum=minimum, maximum=maximum)

    def as_int(self, name: str, value: Any, *, minimum: int | None = None, maximum: int | None = None) -> int:
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if not isinstance(value, int) or isinstance(value, bool):
            raise self.fail(name, f"expected an integer, got {_kind(value)}")
        low = _INT64[0] if minimum is None else minimum
        high = _INT64[1] if maximum is None else maximum
        if not low <= value <= high:
            raise self.fail(name, f"must be in [{low}, {high}], got {value}")
        return value

    def number(self, name: str, default: float | None = None) -> float | None:
        value = self.raw(name)
        if value is None:
            return default
        if not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value):
            raise self.fail(name, f"expected a finite number, got {_kind(value)}")
        return float(value)

    def bool(self, name: str, default: bool) -> bool:
        value = self.raw(name)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise self.fail(name, f"expected true or false, got {_kind(value)}")
        return value

    def string(self, name: str, default: str | None = None) -> str | None:
        value = self.raw(name)
        if value is None:
            return default
        if not isinstance(value, str):
            raise self.fail(name, f"expected a string, got {_kind(value)}")
        return value

    def object(self, name: str) -> dict[str, Any] | None:
        value = self.raw(name)
        if value is not None and not isinstance(value, dict):
            raise self.fail(name, f"expected an object, got {_kind(value)}")
        return value

    def reject(self, name: str, allowed: Callable[[Any], bool], message: str) -> None:
        """A field we do not support: a 400 that says so unless its value is harmless."""
        value = self.raw(name)
        if value is not None and not allowed(value):
            raise bad_request(f"{name}: {message}", param=name, code="unsupported_parameter")

    def log_unknown(self) -> None:
        for name in sorted(set(self.body) - self.used):
            if (self.endpoint, name) not in _unknown_logged:
                _unknown_logged.add((self.endpoint, name))
                log.warning("%s: ignoring unknown field %r (logged once)", self.endpoint, name)


@attrs.frozen(kw_only=True)
class StreamOptions:
    stream: bool
    include_usage: bool
    # vLLM's: with include_usage, every chunk carries the usage so far (not null)
    continuous_usage_stats: bool = False


def read_stream(reader: Reader) -> StreamOptions:
    stream = reader.bool("stream", False)
    options = reader.object("stream_options")
    include_usage = continuous = False
    if options is not None:
        if not stream:
            raise reader.fail("stream_options", "only allowed when stream is true")
        sub = Reader(options, reader.endpoint, prefix="stream_options.")
        include_usage = sub.bool("include_usage", False)
        continuous = sub.bool("continuous_usage_stats", False)
    return StreamOptions(stream=stream, include_usage=include_usage, continuous_usage_stats=continuous)


def read_stop(reader: Reader) -> tuple[str, ...]:
    value = reader.raw("stop")
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    if isinstance(value, list) and all(isinstance(s, str) for s in value):
        return tuple(value)
    raise reader.fail("stop", "expected a string or an array of strings")


def read_logit_bias(reader: Reader) -> dict[int, float]:
    value = reader.object("logit_bias") or {}
    bias = {}
    for key, weight in value.items():
        try:
            token = int(key)
        except ValueError:
            raise reader.fail("logit_bias", f"keys must be token ids, got {key!r}") from None
        if not isinstance(weight, int | float) or isinstance(weight, bool) or not -100 <= weight <= 100:
            raise reader.fail("logit_bias", f"the bias of token {key} must be a number in [-100, 100]")
        bias[token] = float(weight)
    return bias


def read_sampling(reader: Reader, *, max_tokens: int | None, logprobs: int | None,
                  prompt_logprobs: int | None, stream: bool,
                  aliases: dict[str, str] | None = None,
                  defaults: GenerationDefaults | None = None,
                  structured_outputs: StructuredOutputsParams | None = None) -> SamplingParams:
    """The sampling fields both endpoints share, validated by SamplingParams itself.
    ``aliases``: the request's name for a SamplingParams field, for error messages.
    ``defaults``: the model's generation_config.json values for the fields left unset."""
    unset = SamplingParams()
    default = dict(defaults.sampling) if defaults is not None else {}
    stop_token_ids = reader.raw("stop_token_ids")
    if stop_token_ids is not None and not isinstance(stop_token_ids, list):
        raise reader.fail("stop_token_ids", "expected an array of token ids")
    fields = dict(
        n=reader.int("n", 1, minimum=1, maximum=MAX_N),
        temperature=reader.number("temperature", default.get("temperature", unset.temperature)),
        top_p=reader.number("top_p", default.get("top_p", unset.top_p)),
        top_k=reader.int("top_k", default.get("top_k", unset.top_k), minimum=-1),
        min_p=reader.number("min_p", default.get("min_p", unset.min_p)),
        presence_penalty=reader.number("presence_penalty", 0.0),
        frequency_penalty=reader.number("frequency_penalty", 0.0),
        repetition_penalty=reader.number("repetition_penalty",
                                         default.get("repetition_penalty", unset.repetition_penalty)),
        logit_bias=read_logit_bias(reader),
        seed=reader.int("seed"),
        max_tokens=max_tokens,
        min_tokens=reader.int("min_tokens", 0),
        stop=read_stop(reader),
        stop_token_ids=[reader.as_int("stop_token_ids", t, minimum=0) for t in stop_token_ids or ()],
        include_stop_str_in_output=reader.bool("include_stop_str_in_output", False),
        ignore_eos=reader.bool("ignore_eos", False),
        skip_special_tokens=reader.bool("skip_special_tokens", True),
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        output_kind=OutputKind.DELTA if stream else OutputKind.FINAL_ONLY,
        structured_outputs=structured_outputs,
        truncate_prompt_tokens=reader.int("truncate_prompt_tokens", minimum=-1),
    )
    try:
        return SamplingParams(**fields)
    except InvalidRequestError as e:
        raise from_engine_error(e, aliases) from None


def read_prompts(reader: Reader, name: str, *, limit: int, non_empty: bool = False) -> tuple[str | tuple[int, ...], ...]:
    """A field of OpenAI's prompt shapes: a string, an array of strings, token ids, or an array
    of non-empty token-id arrays (``non_empty``: no empty string either), at most ``limit``."""
    value = reader.raw(name)
    if value is None:
        raise reader.fail(name, "is required")
    if isinstance(value, str) and (value or not non_empty):
        return (value,)
    if isinstance(value, list) and value:
        if all(isinstance(p, str) and (p or not non_empty) for p in value):
            prompts: tuple = tuple(value)
        elif all(isinstance(t, int) and not isinstance(t, bool) for t in value):
            prompts = (tuple(value),)
        elif all(isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p)
                 for p in value):
            prompts = tuple(tuple(p) for p in value)
        else:
            strings = "non-empty strings" if non_empty else "strings"
            raise reader.fail(name, f"expected a string, an array of {strings}, an array of token ids or an "
                                    "array of non-empty token-id arrays")
        if len(prompts) > limit:
            raise reader.fail(name, f"at most {limit} per request, got {len(prompts)}")
        return prompts
    raise reader.fail(name, "expected a non-empty string or array")
