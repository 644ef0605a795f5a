"""Token ids to the text a client sees: incremental detokenizing, stop strings, chat templates.

The scheduler streams token ids; the HTTP layer must send text. Three things stand between:

* `Detokenizer` turns ids into text one token at a time and only ever emits complete UTF-8: a
  byte-level BPE token can end in the middle of a multi-byte character, which decodes to a
  trailing U+FFFD until the next token completes it, so that tail is held back.
* `StopMatcher` finds stop strings in that text. The stop string and everything after it are
  never returned; while streaming, a tail that could be the start of a stop string is held
  back and released once it turns out not to be one.
* `ChatTemplate` renders a chat's messages to one prompt string: the checkpoint's template
  (`chat_template.jinja`, else `tokenizer_config.json`'s `chat_template`; a Jinja template,
  run in a sandbox) when it has one, else `DEFAULT_CHAT_TEMPLATE`.

`TextStream` ties the first two together per request and keeps each token's log-prob and its
offset in the returned text, so the log-probs a response reports belong to the text it returns.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable, Sequence
from typing import Any, Protocol

import jinja2
import jinja2.sandbox

from jaxspec.errors import CheckpointError, InputError
from jaxspec.io import tokenizer as tokenizer_lib

REPLACEMENT = "\ufffd"  # what decoding an incomplete UTF-8 sequence yields
# Prompt tokens decoded before the first generated token: tokenizers that drop a leading space
# when a sequence starts (SentencePiece's ▁) need the previous token to decode the next one.
CONTEXT_TOKENS = 4

# Used when the checkpoint has no chat template (the bundled model has none: it was trained on
# source code, not on chats). One line per message, "role: content", then "assistant:" for the
# reply; plain text, so it needs no special tokens in the vocabulary.
DEFAULT_CHAT_TEMPLATE = (
  "{% for message in messages %}"
  "{{ message['role'] }}: {{ message['content'] }}\n"
  "{% endfor %}"
  "{% if add_generation_prompt %}assistant:{% endif %}"
)


class TokenizerLike(Protocol):
  def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str: ...


class Detokenizer:
  """Decodes generated ids incrementally, emitting only complete characters.

  Each call decodes a short window (the ids since the last emitted boundary, plus the tokens
  before it as context) rather than the whole sequence, so streaming costs O(tokens), and
  the text it returns concatenates to `decode(all generated ids)` (up to the held tail,
  which `flush` releases).
  """

  def __init__(
    self,
    tokenizer: TokenizerLike,
    prompt_ids: Sequence[int] = (),
    *,
    skip_special_tokens: bool = True,
  ):
    self._tok = tokenizer
    self._skip = skip_special_tokens
    self._ids = [int(i) for i in prompt_ids[max(0, len(prompt_ids) - CONTEXT_TOKENS) :]]
    self._prefix = 0  # start of the decode window (context for the next piece)
    self._read = len(self._ids)  # ids up to here have been emitted as text

  def _decode(self, ids: Sequence[int]) -> str:
    return self._tok.decode(ids, skip_special_tokens=self._skip)

  def add(self, token_id: int) -> str:
    """Appends one token; returns the text it completes ("" while a character is partial)."""
    self._ids.append(int(token_id))
    before = self._decode(self._ids[self._prefix : self._read])
    after = self._decode(self._ids[self._prefix :])
    if after.endswith(REPLACEMENT) or len(after) <= len(before) or not after.startswith(before):
      return ""
    self._prefix, self._read = self._read, len(self._ids)
    return after[len(before) :]

  def flush(self) -> str:
    """The held-back text at the end of generation (a partial character shows as U+FFFD)."""
    before = self._decode(self._ids[self._prefix : self._read])
    after = self._decode(self._ids[self._prefix :])
    self._prefix = self._read = len(self._ids)
    return after[len(before) :] if after.startswith(before) else after


class StopMatcher:
  """Finds the first stop string in text that arrives in pieces.

  `feed` returns the text that is safe to emit now: never a stop string or what follows it,
  and never a tail that could still become one.
  """

  def __init__(self, stops: Sequence[str]):
    if any(not s for s in stops):
      raise InputError("stop strings must be non-empty")
    self.stops = tuple(stops)
    self._held = ""
    self.matched: str | None = None

  def feed(self, text: str) -> str:
    """Adds text; returns what may be emitted. After a match, `matched` is set and the rest
    (the stop string and anything after it) is dropped, now and on later calls."""
    if self.matched is not None:
      return ""
    buf = self._held + text
    hits = [(buf.find(s), s) for s in self.stops if s in buf]
    if hits:
      cut, self.matched = min(hits)
      self._held = ""
      return buf[:cut]
    keep = max((_overlap(buf, s) for s in self.stops), default=0)
    self._held = buf[len(buf) - keep :]
    return buf[: len(buf) - keep]

  def flush(self) -> str:
    """Releases the held tail at the end of generation (it was not a stop string)."""
    out, self._held = self._held, ""
    return out


def _overlap(text: str, stop: str) -> int:
  """Length of the longest suffix of `text` that is a proper prefix of `stop`."""
  for n in range(min(len(text), len(stop) - 1), 0, -1):
    if text.endswith(stop[:n]):
      return n
  return 0


@dataclasses.dataclass
class Piece:
  """What one step of a `TextStream` returns: text and the tokens it covers."""

  text: str
  token_ids: list[int]
  logprobs: list[float] | None
  offsets: list[int]  # each token's start in the whole returned text
  stopped: bool = False  # a stop string matched: the request should end now


class TextStream:
  """One request's generated ids → returned text, with stop strings and per-token log-probs.

  A token is reported (in `Piece.token_ids`) with the first piece whose text reaches past
  its start, so tokens, log-probs and text stay aligned when text is held back. After a stop
  string matches, only the tokens that begin before it are reported, and later input is
  ignored.
  """

  def __init__(
    self,
    tokenizer: TokenizerLike,
    prompt_ids: Sequence[int],
    stops: Sequence[str] = (),
    *,
    logprobs: bool = False,
  ):
    self._detok = Detokenizer(tokenizer, prompt_ids)
    self._stop = StopMatcher(stops)
    self._logprobs = logprobs
    self._decoded = 0  # characters the detokenizer has produced
    self._sent = 0  # characters returned
    self._pending: list[tuple[int, float | None, int]] = []  # (id, logprob, start offset)
    self.completion_tokens = 0  # tokens reported so far

  @property
  def stopped(self) -> bool:
    return self._stop.matched is not None

  def add(self, token_ids: Sequence[int], logprobs: Sequence[float] | None = None) -> Piece:
    """Feeds newly committed tokens; returns what may be sent now."""
    if logprobs is not None and len(logprobs) != len(token_ids):
      raise ValueError(f"{len(token_ids)} tokens but {len(logprobs)} log-probs")
    text = []
    for i, tid in enumerate(token_ids):
      if self.stopped:
        break
      self._pending.append((int(tid), None if logprobs is None else logprobs[i], self._decoded))
      piece = self._detok.add(tid)
      self._decoded += len(piece)
      text.append(self._stop.feed(piece))
    return self._piece("".join(text), final=self.stopped)

  def finish(self) -> Piece:
    """The rest at the end of generation: held text and the tokens it covers."""
    text = ""
    if not self.stopped:
      tail = self._detok.flush()
      self._decoded += len(tail)
      text = self._stop.feed(tail)
      if not self.stopped:
        text += self._stop.flush()
    return self._piece(text, final=True)

  def _piece(self, text: str, final: bool) -> Piece:
    self._sent += len(text)
    if final:
      # Every token that starts before the end of the returned text (after a stop: before the
      # stop string); a token after the stop string's start is dropped with it.
      ready = [p for p in self._pending if p[2] < self._sent or not self.stopped]
      self._pending = []
    else:
      ready = [p for p in self._pending if p[2] < self._sent]
      self._pending = self._pending[len(ready) :]
    self.completion_tokens += len(ready)
    return Piece(
      text=text,
      token_ids=[p[0] for p in ready],
      logprobs=[p[1] for p in ready] if self._logprobs else None,
      offsets=[p[2] for p in ready],
      stopped=self.stopped,
    )


def _byte_level_alphabet() -> dict[str, int]:
  """Byte-level BPE's character → byte map: printable Latin-1 bytes stand for themselves,
  the other 68 bytes for the characters from U+0100 on, in byte order."""
  printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
  others = [b for b in range(256) if b not in printable]
  table = {chr(b): b for b in printable}
  table.update({chr(256 + n): b for n, b in enumerate(others)})
  return table


_BYTE_LEVEL = _byte_level_alphabet()


def token_bytes(tokenizer: Any, token_id: int) -> list[int] | None:
  """The raw bytes of one token (a token can hold part of a character, which its decoded
  text cannot show); None when they cannot be told."""
  backend = getattr(tokenizer, "backend", None)
  decoder = getattr(backend, "decoder", None)
  if type(decoder).__name__ == "ByteLevel":
    piece = tokenizer.id_to_token(token_id)
    if piece is not None and all(c in _BYTE_LEVEL for c in piece):
      return [_BYTE_LEVEL[c] for c in piece]
  piece = tokenizer.decode([token_id])
  return None if REPLACEMENT in piece else list(piece.encode("utf-8"))


class ChatTemplate:
  """Renders chat messages to a prompt string with a Jinja template, in a sandbox.

  The sandbox (jinja2's ImmutableSandboxedEnvironment) keeps a checkpoint's template from
  reaching Python internals or mutating its inputs; `raise_exception` lets templates refuse a
  conversation (HF templates use it, say, for a system message in the wrong place) and
  becomes an InputError (HTTP 400).
  """

  def __init__(self, source: str = DEFAULT_CHAT_TEMPLATE, special: dict[str, str] | None = None):
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = _raise_template_error
    try:
      self._template = env.from_string(source)
    except jinja2.TemplateError as e:
      raise CheckpointError(f"the chat template does not parse: {e}") from None
    self.source = source
    self._special = dict(special or {})

  def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
    """The prompt for `messages` (each {"role", "content"}), ending where the reply starts."""
    try:
      return self._template.render(
        messages=messages, add_generation_prompt=add_generation_prompt, **self._special
      )
    except InputError:
      raise
    except jinja2.TemplateError as e:
      raise InputError(f"the chat template failed on these messages: {e}") from None


def _raise_template_error(message: str) -> None:
  raise InputError(f"the chat template refused the messages: {message}")


def chat_template_of(tokenizer: Any) -> ChatTemplate:
  """The chat template of a loaded model's tokenizer: the one it carries (its directory's, or
  a GGUF file's with the token strings the file states), else the one in its directory
  (`load_chat_template`), else the default."""
  own = getattr(tokenizer, "chat_template", None)
  tokens = getattr(tokenizer, "special_tokens", None)
  if isinstance(own, str) and tokens:
    return ChatTemplate(own, tokens)
  source = getattr(tokenizer, "source", None)
  return load_chat_template(os.path.dirname(source) if source else None)


def load_chat_template(model_dir: str | None) -> ChatTemplate:
  """The chat template of `model_dir` (`tokenizer_lib.read_chat_template`: its
  chat_template.jinja, else tokenizer_config.json's), else the default one.

  The config's bos/eos/pad/unk token strings are passed to the template as HF does
  (`bos_token`, `eos_token`, ...), since templates use them.
  """
  found = tokenizer_lib.read_chat_template(model_dir)
  if found.template is None:
    return ChatTemplate()
  return ChatTemplate(found.template, found.tokens)
