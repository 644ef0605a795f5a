"""What a `SpecEngine` refuses of a request, on the host, before any device work.

`Request.build` (jaxspec/speculative/request.py) checks a call's arguments alone; these checks
need the engine: token ids outside the target's vocabulary, text prompts without a tokenizer, a
prompt + max_new_tokens + the verifier's lookahead past max_len, more stop ids than a row holds
(`EngineConfig.max_stop_ids`), penalties or a logit bias on an engine built without them.
"""

from __future__ import annotations

from typing import Any, Optional

import numpy as np

from jaxspec.errors import ConfigError, InputError
from jaxspec.speculative.request import Request, SamplingArgs


class RequestChecks:
  """`SpecEngine`'s request checks (a mixin over its config, target, stop ids and verifier)."""

  def _engine_stop_ids(self) -> tuple[int, ...]:
    """The config's stop ids and (use_eos) the target's eos ids, checked."""
    config, vocab = self.config, self.target.config.vocab_size
    stops = list(config.stop_ids)
    if config.use_eos:
      stops += list(self.target.config.eos_token_ids)
    stops = list(dict.fromkeys(int(t) for t in stops))
    outside = [t for t in stops if t >= vocab]
    if outside:
      raise ConfigError(f"stop ids {outside} are outside the vocabulary (size {vocab})")
    if len(stops) > config.max_stop_ids:
      raise ConfigError(
        f"at most {config.max_stop_ids} stop ids, got {stops} (raise EngineConfig.max_stop_ids)"
      )
    return tuple(stops)

  def _request(
    self, prompts: Any, args: SamplingArgs, max_prompts: Optional[int] = None
  ) -> Request:
    """Validates a call's arguments once (jaxspec/speculative/request.py)."""
    return Request.build(prompts, args, max_prompts=max_prompts or self.config.batch_size)

  def _row_stop_ids(self, request: Request, batch: int) -> np.ndarray:
    """int32 [batch, max_stop_ids]: the engine's stop ids plus each prompt's own, -1 padded."""
    out = np.full((batch, self.config.max_stop_ids), -1, np.int32)
    vocab = self.target.config.vocab_size
    for i in range(batch):
      extra = request.stop_token_ids[i] if i < len(request) else ()
      bad = [t for t in extra if t >= vocab]
      if bad:
        raise InputError(
          f"prompt {i}: stop_token_ids {bad} are outside the vocabulary ({vocab})", "stop_token_ids"
        )
      ids = list(dict.fromkeys(self.stop_ids + tuple(extra)))
      if len(ids) > self.config.max_stop_ids:
        raise InputError(
          f"prompt {i}: {len(ids)} stop ids (the engine's {len(self.stop_ids)} and its own), "
          f"more than EngineConfig.max_stop_ids={self.config.max_stop_ids}",
          "stop_token_ids",
        )
      out[i, : len(ids)] = ids
    return out

  def _encode(self, request: Request) -> list[list[int]]:
    out = []
    tok = self.target.tokenizer
    for i, p in enumerate(request.prompts):
      if isinstance(p, str):
        if tok is None:
          raise InputError("text prompts need a model with a tokenizer; pass token ids instead")
        # User text is plain text: a typed "<|mask|>" is characters, not the control token,
        # unless the caller asks for special tokens to be parsed.
        ids = tok.encode(p, split_special_tokens=not request.parse_special)
        if not ids:
          raise InputError(f"prompt {i} encodes to no tokens")
      else:
        ids = list(p)
      try:
        self.target.check_tokens(np.asarray([ids]))
      except InputError as e:
        raise InputError(str(e), "prompt") from None
      out.append(ids)
    return out

  def _checked(self, request: Request, batch: int) -> tuple[list[list[int]], np.ndarray]:
    """The request's token ids and [batch, max_stop_ids] stop ids, or the InputError that
    prefilling it would hit (ids outside the vocabulary, too long for max_len, stop ids)."""
    ids = self._encode(request)
    cfg = self.config
    stop_ids = self._row_stop_ids(request, batch)
    if request.adjusts_logits and not cfg.penalties:
      raise InputError(
        "penalties and logit_bias need an engine built with EngineConfig(penalties=True)"
      )
    vocab = self.target.config.vocab_size
    for i, pairs in enumerate(request.logit_bias):
      outside = [t for t, _ in pairs if t >= vocab]
      if outside:
        raise InputError(
          f"prompt {i}: logit_bias ids {outside[:4]} are outside the vocabulary", "logit_bias"
        )
    for i, (p, m) in enumerate(zip(ids, request.max_new_tokens)):
      need = len(p) + m + self.lookahead + 1
      room = self.max_new_tokens_for(len(p))
      if m > room:
        raise InputError(
          f"prompt {i} has {len(p)} tokens; with max_new_tokens={m} and "
          f"{self.verifier.describe()} per step "
          f"it needs {need} slots, more than max_len={cfg.max_len}",
          "max_new_tokens" if room > 0 else "prompt",  # the prompt alone does not fit
        )
    return ids, stop_ids

  def max_new_tokens_for(self, prompt_len: int) -> int:
    """The most tokens a prompt of `prompt_len` tokens may generate: its sequence, the
    drafter's lookahead past the last token and the root must fit in max_len (≤ 0: none)."""
    return self.config.max_len - prompt_len - self.lookahead - 1
