"""The OpenAI API subset jaxspec serves: request bodies (validated) and response builders.

Requests are pydantic models that accept what OpenAI's API accepts for the parameters jaxspec
implements, ignore fields they do not know (as OpenAI does), and refuse a parameter they know
but cannot honour (echo, tools, ...) with a message
naming it, rather than silently serving something else. Extensions, as vLLM spells them:
`top_k` and `stop_token_ids`.

Responses are plain dicts in OpenAI's shapes: `completion` (a response or one of its SSE
chunks, object "text_completion") for /v1/completions, `chat_completion` / `chat_chunk` for
/v1/chat/completions ("chat.completion", "chat.completion.chunk"), `usage_chunk`, `usage`,
`error_body`.
"""

from __future__ import annotations

import math
import re
import time
import uuid
from typing import Annotated, Any, Literal

import pydantic
from pydantic import BaseModel, ConfigDict, Field

from jaxspec.errors import InputError
from jaxspec.penalties import MAX_LOGIT_BIAS

# OpenAI's own stand-in for "too unlikely to report": JSON has no -Infinity.
UNLIKELY_LOGPROB = -9999.0
DEFAULT_MAX_TOKENS = 16  # OpenAI's completions default

_Unit = Annotated[float, Field(gt=0, le=1)]
# A logit_bias key: a token id in ASCII digits (str.isdigit also passes "²", which int() refuses).
_TOKEN_ID = re.compile(r"[0-9]+")


# Pydantic's strict mode: a JSON string is not a number and `true` not a token id, as OpenAI
# refuses them too (an int is still a float). Unknown fields are ignored, as OpenAI does.
_CONFIG = ConfigDict(extra="ignore", strict=True)

# What a field takes, for the message when a value has the wrong type (pydantic's own message
# for a union lists every alternative's complaint).
_FORMS = {
  "prompt": "a string, a list of token ids, or a one-element list of either",
  "stop": "a string or a list of strings",
  "content": "a string or a list of {type: text, text} parts",
}


class StreamOptions(BaseModel):
  model_config = _CONFIG
  include_usage: bool = False


class _Common(BaseModel):
  """Parameters shared by completions and chat."""

  model_config = _CONFIG

  model: str
  temperature: Annotated[float, Field(ge=0, le=2)] = 1.0
  top_p: _Unit = 1.0
  top_k: Annotated[int, Field(ge=0, description="0 = off (extension)")] = 0
  seed: Annotated[int, Field(ge=0, lt=2**63)] | None = None
  stop: str | list[str] | None = None
  stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
  stream: bool = False
  stream_options: StreamOptions | None = None
  n: int = 1
  presence_penalty: Annotated[float, Field(ge=-2, le=2)] = 0.0
  frequency_penalty: Annotated[float, Field(ge=-2, le=2)] = 0.0
  repetition_penalty: Annotated[float, Field(gt=0, le=100, description="1 = off (extension)")] = 1.0
  logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100)]] | None = None

  @pydantic.model_validator(mode="before")
  @classmethod
  def _null_is_unset(cls, body: Any) -> Any:
    """A null parameter means "not given" (OpenAI's parameters are nullable, defaults apply)."""
    if isinstance(body, dict):
      return {k: v for k, v in body.items() if v is not None}
    return body

  @pydantic.field_validator("stop")
  @classmethod
  def _stop_nonempty(cls, v: str | list[str] | None) -> str | list[str] | None:
    if v == "" or (isinstance(v, list) and any(s == "" for s in v)):
      raise ValueError("stop strings must be non-empty")
    return v

  @pydantic.model_validator(mode="after")
  def _supported(self) -> _Common:
    _need(self.n >= 1, "n", f"n={self.n}: n must be at least 1")
    _need(
      self.stream_options is None or self.stream,
      "stream_options",
      "stream_options is only allowed with stream=true",
    )
    for key in self.logit_bias or {}:
      _need(_TOKEN_ID.fullmatch(key), "logit_bias", f"logit_bias keys are token ids, got {key!r}")
    _need(
      len(self.logit_bias or {}) <= MAX_LOGIT_BIAS,
      "logit_bias",
      f"logit_bias holds at most {MAX_LOGIT_BIAS} entries",
    )
    return self

  @property
  def logit_bias_ids(self) -> tuple[tuple[int, float], ...]:
    """logit_bias as sorted (token id, bias) pairs."""
    return tuple(sorted((int(k), float(v)) for k, v in (self.logit_bias or {}).items()))

  @property
  def stop_strings(self) -> list[str]:
    if self.stop is None:
      return []
    return [self.stop] if isinstance(self.stop, str) else list(self.stop)

  @property
  def include_usage(self) -> bool:
    return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Common):
  """POST /v1/completions."""

  prompt: str | list[int] | list[str] | list[list[int]]
  max_tokens: Annotated[int, Field(ge=1)] = DEFAULT_MAX_TOKENS
  logprobs: Annotated[int, Field(ge=0)] | None = None
  echo: bool = False
  best_of: int | None = None
  suffix: str | None = None

  @pydantic.model_validator(mode="after")
  def _completion_supported(self) -> CompletionRequest:
    _need(not self.echo, "echo", "echo=true is not supported")
    _need(
      self.best_of is None or self.best_of >= self.n,
      "best_of",
      f"best_of={self.best_of} must be at least n={self.n}",
    )
    _need(
      not (self.stream and self.candidates > self.n),
      "best_of",
      "best_of > n cannot be streamed (the best choices are known only at the end)",
    )
    _need(self.suffix is None, "suffix", "suffix is not supported")
    _need(
      self.logprobs is None or self.logprobs <= 5,
      "logprobs",
      f"logprobs={self.logprobs}: at most 5 alternatives per token (as OpenAI)",
    )
    return self

  @property
  def candidates(self) -> int:
    """Completions sampled: best_of (the n with the highest log-probability per token are
    returned), else n."""
    return max(self.best_of or 1, self.n)

  def prompt_input(self) -> str | list[int]:
    """The one prompt: text or token ids (a one-element list of either is unwrapped)."""
    p = self.prompt
    if isinstance(p, list) and p and isinstance(p[0], (str, list)):
      _need(len(p) == 1, "prompt", f"one prompt per request, got {len(p)}")
      p = p[0]
    _need(len(p) > 0, "prompt", "the prompt is empty")
    return p

  @property
  def want_logprobs(self) -> bool:
    return self.logprobs is not None

  @property
  def top_count(self) -> int:
    """Alternatives wanted per token (completions: `logprobs` itself)."""
    return self.logprobs or 0


class TextPart(BaseModel):
  model_config = _CONFIG
  type: Literal["text"]
  text: str


class ChatMessage(BaseModel):
  model_config = _CONFIG
  role: Literal["system", "developer", "user", "assistant", "tool"]
  content: str | list[TextPart] | None = None

  def text(self) -> str:
    if self.content is None:
      return ""
    if isinstance(self.content, str):
      return self.content
    return "".join(part.text for part in self.content)


class ChatRequest(_Common):
  """POST /v1/chat/completions."""

  messages: Annotated[list[ChatMessage], Field(min_length=1)]
  max_tokens: Annotated[int, Field(ge=1)] | None = None
  max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
  logprobs: bool = False
  top_logprobs: Annotated[int, Field(ge=0)] | None = None
  tools: list[Any] | None = None
  response_format: dict[str, Any] | None = None

  @pydantic.model_validator(mode="after")
  def _chat_supported(self) -> ChatRequest:
    _need(
      self.max_tokens is None
      or self.max_completion_tokens is None
      or self.max_tokens == self.max_completion_tokens,
      "max_completion_tokens",
      "max_tokens and max_completion_tokens disagree",
    )
    _need(
      self.top_logprobs is None or self.top_logprobs <= 20,
      "top_logprobs",
      f"top_logprobs={self.top_logprobs}: at most 20 alternatives per token",
    )
    _need(
      self.top_logprobs is None or self.logprobs,
      "top_logprobs",
      "top_logprobs needs logprobs=true",
    )
    _need(not self.tools, "tools", "tool calling is not supported")
    _need(
      self.response_format is None or self.response_format.get("type") == "text",
      "response_format",
      "only response_format {'type': 'text'} is supported",
    )
    return self

  @property
  def token_limit(self) -> int | None:
    """max_completion_tokens or max_tokens; None when neither is given."""
    return self.max_completion_tokens or self.max_tokens

  def message_dicts(self) -> list[dict[str, str]]:
    """The messages as the chat template reads them ({"role", "content": str})."""
    return [{"role": m.role, "content": m.text()} for m in self.messages]

  @property
  def want_logprobs(self) -> bool:
    return self.logprobs

  @property
  def top_count(self) -> int:
    """Alternatives wanted per token."""
    return self.top_logprobs or 0


class BadParameter(InputError):
  """A request parameter jaxspec refuses; `param` names it for the error body."""


def _need(ok: bool, param: str, message: str) -> None:
  if not ok:
    raise BadParameter(message, param)


def _json_integers(value: Any) -> Any:
  """`value` with its integral floats as ints: JSON (and its Schema) has one number type, in
  which 2.0 is the integer 2; strict validation would refuse it for an integer field."""
  if isinstance(value, float) and value.is_integer():
    return int(value)
  if isinstance(value, list):
    return [_json_integers(v) for v in value]
  if isinstance(value, dict):
    return {k: _json_integers(v) for k, v in value.items()}
  return value


def parse(model: type[BaseModel], body: Any) -> Any:
  """Validates a decoded JSON body; a problem becomes a BadParameter naming the field."""
  if not isinstance(body, dict):
    raise BadParameter(f"the request body must be a JSON object, got {type(body).__name__}")
  try:
    return model.model_validate(_json_integers(body))
  except RecursionError:  # a body nested nearly as deep as json.loads allows
    raise BadParameter("the request body nests too deeply") from None
  except pydantic.ValidationError as e:
    err = e.errors(include_url=False)[0]
    ctx_error = err.get("ctx", {}).get("error")
    if isinstance(ctx_error, BadParameter):
      raise ctx_error from None
    loc = [str(p) for p in err["loc"]]
    field = loc[0] if loc else None
    union = next((i for i, p in enumerate(loc) if p in _FORMS), None)
    if union is not None and err["type"] not in ("missing", "value_error"):
      message = f"{'.'.join(loc[: union + 1])}: expected {_FORMS[loc[union]]}"
    else:
      why = ctx_error if ctx_error is not None else err["msg"]
      message = f"{'.'.join(loc)}: {why}" if loc else str(why)
      more = len(e.errors()) - 1
      if more:
        message += f" (and {more} more problem{'s' if more > 1 else ''})"
    raise BadParameter(message, field) from None


# ---- responses ----------------------------------------------------------------------------


def new_id(prefix: str) -> str:
  return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
  return int(time.time())


def finite(logprob: float) -> float:
  """A log-prob JSON can carry: -inf (and nan) become UNLIKELY_LOGPROB, as OpenAI reports."""
  return float(logprob) if math.isfinite(logprob) else UNLIKELY_LOGPROB


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
  return {
    "prompt_tokens": prompt_tokens,
    "completion_tokens": completion_tokens,
    "total_tokens": prompt_tokens + completion_tokens,
  }


def completion_logprobs(
  tokens: list[str],
  logprobs: list[float],
  offsets: list[int],
  base: int = 0,
  top: list[list[tuple[str, float]]] | None = None,
) -> dict[str, Any]:
  """Completions' logprobs object; `top`: per token its alternatives as (text, log-prob),
  most likely first (None: top_logprobs null)."""
  return {
    "tokens": tokens,
    "token_logprobs": [finite(lp) for lp in logprobs],
    "top_logprobs": None if top is None else [{t: finite(lp) for t, lp in alts} for alts in top],
    "text_offset": [base + o for o in offsets],
  }


def chat_logprobs(
  tokens: list[str],
  token_bytes: list[list[int] | None],
  logprobs: list[float],
  top: list[list[tuple[str, list[int] | None, float]]] | None = None,
) -> dict[str, Any]:
  """Chat's logprobs object: one entry per token with its bytes and (`top`) its alternatives
  as (text, bytes, log-prob), most likely first."""
  alternatives = top or [[] for _ in tokens]
  content = [
    {
      "token": t,
      "logprob": finite(lp),
      "bytes": b,
      "top_logprobs": [{"token": s, "logprob": finite(v), "bytes": sb} for s, sb, v in alts],
    }
    for t, b, lp, alts in zip(tokens, token_bytes, logprobs, alternatives)
  ]
  return {"content": content, "refusal": None}


def _envelope(
  rid: str, obj: str, created: int, model: str, choice: dict, use: dict | None
) -> dict[str, Any]:
  return {
    "id": rid,
    "object": obj,
    "created": created,
    "model": model,
    "choices": [choice],
    "usage": use,
  }


def completion(
  rid: str,
  created: int,
  model: str,
  text: str,
  finish: str | None,
  logprobs: dict | None,
  use: dict | None = None,
) -> dict[str, Any]:
  """A /v1/completions response, or (finish None or not, usage None) one of its SSE chunks."""
  choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}
  return _envelope(rid, "text_completion", created, model, choice, use)


def chat_completion(
  rid: str, created: int, model: str, text: str, finish: str, logprobs: dict | None, use: dict
) -> dict[str, Any]:
  """A /v1/chat/completions response."""
  choice = {
    "index": 0,
    "message": {"role": "assistant", "content": text},
    "logprobs": logprobs,
    "finish_reason": finish,
  }
  return _envelope(rid, "chat.completion", created, model, choice, use)


def chat_chunk(
  rid: str, created: int, model: str, delta: dict, finish: str | None, logprobs: dict | None
) -> dict[str, Any]:
  """One SSE chunk of a chat stream; `delta` is {"role"} first, then {"content"}."""
  choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
  return _envelope(rid, "chat.completion.chunk", created, model, choice, None)


def usage_chunk(rid: str, obj: str, created: int, model: str, use: dict) -> dict[str, Any]:
  """The last chunk of a stream with include_usage: no choices, the totals."""
  return {"id": rid, "object": obj, "created": created, "model": model, "choices": [], "usage": use}


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None):
  return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def model_list(model: str, created: int) -> dict[str, Any]:
  return {
    "object": "list",
    "data": [{"id": model, "object": "model", "created": created, "owned_by": "jaxspec"}],
  }
