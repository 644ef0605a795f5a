"""One generation request, checked once at the boundary.

`SamplingArgs` is a call's sampling arguments as given (max_new_tokens, temperature, top_k,
top_p, seed, stop_token_ids, parse_special): the one type that `SpecEngine.generate`, `stream`,
`init_state`, `prefill_row` and `check_row` take (as keyword arguments, the public contract, or
as one `SamplingArgs`), that the server's scheduler sends in its ticks, and that
`Request.build` checks into a `Request`. Everything a caller can get wrong is refused here, with an
`InputError` naming the argument, before any compilation or device work: no silent coercion
(a float id is not truncated, "ab" is not two prompts, 1.5 new tokens is not 1, a list of three
temperatures for one prompt is not cut to one).

Accepted forms:
  prompts: one str, or a sequence (list, tuple, 2-D integer array) of prompts, each a str or a
    1-D sequence of Python / numpy integers (list, tuple or 1-D integer array).
  max_new_tokens, top_k: an integer, or one integer per prompt.
  temperature, top_p: a real number, or one per prompt.
  seed: an integer in [-2**63, 2**63), or one per prompt. One seed gives row i the key
    fold_in(PRNGKey(seed), i); per-prompt seeds give prompt i fold_in(PRNGKey(seed_i), 0), so a
    request with seed s samples the same wherever it runs (alone, in a batch, in a server slot).
  stop_token_ids: None, a sequence of token ids for every prompt, or one such sequence per
    prompt: extra stop tokens beside the engine's.
  presence_penalty, frequency_penalty: a number in [-2, 2] (0 = off), or one per prompt;
    repetition_penalty: a number > 0 (1 = off), or one per prompt (jaxspec/penalties.py).
  logit_bias: None, a mapping {token id: value in [-100, 100]} for every prompt, or one per
    prompt; at most 300 entries each.
Per-prompt values come as a list, tuple or 1-D array whose length is the prompt count; a
one-element sequence for one prompt is the same as its scalar.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
import numbers
from typing import Any, Callable, Optional, Sequence

import numpy as np

from jaxspec.errors import InputError
from jaxspec.penalties import MAX_LOGIT_BIAS  # noqa: F401  (re-exported for the engine)

_INT32_MAX = 2**31 - 1


def _is_int(x: Any) -> bool:
  return isinstance(x, (numbers.Integral, np.integer)) and not isinstance(x, (bool, np.bool_))


def _is_real(x: Any) -> bool:
  return (_is_int(x) or isinstance(x, (numbers.Real, np.floating))) and not isinstance(
    x, (bool, np.bool_)
  )


def _describe(x: Any) -> str:
  text = repr(x)
  return text if len(text) <= 60 else text[:57] + "..."


def _token_ids(prompt: Any, i: int) -> tuple[int, ...]:
  """A prompt of token ids as a tuple of ints, or an InputError saying what is wrong."""
  where = f"prompt {i}"
  if isinstance(prompt, np.ndarray):
    if prompt.ndim != 1 or prompt.dtype.kind not in "iu":
      raise InputError(
        f"{where}: an array prompt must be 1-D integer token ids, got shape {prompt.shape} "
        f"dtype {prompt.dtype}",
        "prompt",
      )
    values = prompt.tolist()
  elif isinstance(prompt, (list, tuple)):
    values = list(prompt)
    for j, t in enumerate(values):
      if not _is_int(t):
        hint = " (a text prompt is one str, not a list of str)" if isinstance(t, str) else ""
        raise InputError(
          f"{where}: token ids must be integers, got {_describe(t)} at position {j}{hint}",
          "prompt",
        )
  else:
    raise InputError(
      f"{where}: a prompt is a str or a 1-D sequence of token ids, got {type(prompt).__name__} "
      f"{_describe(prompt)}",
      "prompt",
    )
  ids = tuple(int(t) for t in values)
  if not ids:
    raise InputError(f"{where} is empty: a prompt needs at least one token", "prompt")
  bad = [t for t in ids if not 0 <= t <= _INT32_MAX]
  if bad:
    raise InputError(f"{where}: token ids must be ≥ 0, got {bad[:4]}", "prompt")
  return ids


def _per_prompt(name: str, value: Any, n: int, check, kind: str) -> tuple:
  """A scalar or one value per prompt, as an n-tuple; each value passes `check`."""
  if isinstance(value, np.ndarray):
    if value.ndim > 1:
      raise InputError(f"{name}: expected {kind} or one per prompt, got shape {value.shape}", name)
    values = value.tolist() if value.ndim == 1 else [value.item()]
    if value.ndim == 1 and value.dtype.kind not in "iuf":
      raise InputError(f"{name}: expected {kind} values, got dtype {value.dtype}", name)
  elif isinstance(value, (list, tuple)):
    values = list(value)
  else:
    values = None
  if values is None:
    out = (value,) * n
  elif len(values) != n:
    raise InputError(
      f"{name}: got {len(values)} values for {n} prompt{'s' if n != 1 else ''} "
      "(give one value, or one per prompt)",
      name,
    )
  else:
    out = tuple(values)
  for v in out:
    if not check(v):
      raise InputError(f"{name} must be {kind}, got {_describe(v)}", name)
  return out


def _stop_token_ids(value: Any, n: int) -> tuple[tuple[int, ...], ...]:
  """None, one id sequence for every prompt, or one per prompt → n tuples of ids."""
  if value is None:
    return ((),) * n
  if isinstance(value, np.ndarray):
    value = value.tolist()
  if not isinstance(value, (list, tuple)):
    raise InputError(
      f"stop_token_ids must be a sequence of token ids (or one per prompt), got {_describe(value)}",
      "stop_token_ids",
    )
  per_prompt = bool(value) and all(isinstance(v, (list, tuple, np.ndarray)) for v in value)
  if per_prompt:
    lists = [np.asarray(v).tolist() if isinstance(v, np.ndarray) else list(v) for v in value]
    if len(lists) != n:
      raise InputError(f"stop_token_ids: got {len(lists)} lists for {n} prompts", "stop_token_ids")
  else:
    lists = [list(value)] * n
  for ids in lists:
    for t in ids:
      if not (_is_int(t) and 0 <= t <= _INT32_MAX):
        raise InputError(
          f"stop_token_ids must hold token ids (integers ≥ 0), got {_describe(t)}",
          "stop_token_ids",
        )
  return tuple(tuple(int(t) for t in ids) for ids in lists)


# Per sampling argument: the check each per-prompt value passes, and what it must be.
_PER_PROMPT_CHECKS = {
  "max_new_tokens": (lambda v: _is_int(v) and 1 <= v <= _INT32_MAX, "an integer ≥ 1"),
  "temperature": (
    lambda v: _is_real(v) and math.isfinite(v) and v >= 0,
    "a finite number ≥ 0 (0 = greedy)",
  ),
  "top_k": (lambda v: _is_int(v) and 0 <= v <= _INT32_MAX, "an integer ≥ 0 (0 = off)"),
  # top_p and repetition_penalty are float32 on the device: a positive value that rounds to 0
  # there (1e-320) would fail inside the compiled step's setup, or divide by zero.
  "top_p": (
    lambda v: _is_real(v) and math.isfinite(v) and 0 < v <= 1 and np.float32(v) > 0,
    "a number in (0, 1] (1 = off), positive in float32",
  ),
  "presence_penalty": (lambda v: _is_real(v) and -2 <= v <= 2, "a number in [-2, 2] (0 = off)"),
  "frequency_penalty": (lambda v: _is_real(v) and -2 <= v <= 2, "a number in [-2, 2] (0 = off)"),
  "repetition_penalty": (
    lambda v: _is_real(v) and math.isfinite(v) and 0 < v <= 100 and np.float32(v) > 0,
    "a number in (0, 100] (1 = off), positive in float32",
  ),
}
PENALTIES = ("presence_penalty", "frequency_penalty", "repetition_penalty")
PENALTY_OFF = {"presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0}


def _logit_bias(value: Any, n: int) -> tuple[tuple[tuple[int, float], ...], ...]:
  """None, one {token id: bias} for every prompt, or one per prompt → n sorted tuples of
  (id, bias) pairs (ids as ints or their decimal strings, as JSON keys arrive)."""
  if value is None:
    return ((),) * n
  if isinstance(value, dict):
    maps = [value] * n
  elif isinstance(value, (list, tuple)) and all(isinstance(v, dict) or v is None for v in value):
    if len(value) != n:
      raise InputError(f"logit_bias: got {len(value)} mappings for {n} prompts", "logit_bias")
    maps = [v or {} for v in value]
  else:
    raise InputError(
      "logit_bias must be a mapping {token id: bias} (or one per prompt), got "
      f"{_describe(value)}",
      "logit_bias",
    )
  out = []
  for m in maps:
    if len(m) > MAX_LOGIT_BIAS:
      raise InputError(f"logit_bias holds {len(m)} entries; at most {MAX_LOGIT_BIAS}", "logit_bias")
    pairs = []
    for key, bias in m.items():
      digits = isinstance(key, str) and key.isascii() and key.strip().isdigit()  # not "²"
      token = int(key) if digits else key
      if not (_is_int(token) and 0 <= token <= _INT32_MAX):
        raise InputError(
          f"logit_bias keys must be token ids (integers ≥ 0), got {_describe(key)}", "logit_bias"
        )
      if not (_is_real(bias) and -100 <= bias <= 100):
        raise InputError(
          f"logit_bias values must be numbers in [-100, 100], got {_describe(bias)}", "logit_bias"
        )
      pairs.append((int(token), float(bias)))
    out.append(tuple(sorted(pairs)))
  return tuple(out)


@dataclasses.dataclass(frozen=True)
class SamplingArgs:
  """A call's sampling arguments, as given: each a scalar or one value per prompt (checked by
  `Request.build`, see the module docstring); the defaults are `generate`'s."""

  max_new_tokens: Any = 128
  temperature: Any = 0.0
  top_k: Any = 0
  top_p: Any = 1.0
  seed: Any = 0
  _: dataclasses.KW_ONLY
  parse_special: Any = False
  stop_token_ids: Any = None
  presence_penalty: Any = 0.0
  frequency_penalty: Any = 0.0
  repetition_penalty: Any = 1.0
  logit_bias: Any = None

  @classmethod
  def of(cls, args: tuple, kwargs: dict, where: str = "SamplingArgs") -> "SamplingArgs":
    """From a call's arguments after the prompt(s): one SamplingArgs (keyword arguments
    replace its fields), or the fields themselves, positional or by keyword."""
    try:
      if args and isinstance(args[0], SamplingArgs):
        if len(args) > 1:
          raise TypeError("takes one SamplingArgs or its fields, not both positionally")
        return dataclasses.replace(args[0], **kwargs)
      return cls(*args, **kwargs)
    except TypeError as e:
      raise TypeError(f"{where}(): {e}") from None

  def to_json(self) -> dict[str, Any]:
    """Plain JSON values (a server's tick); `SamplingArgs(**d)` rebuilds it."""
    plain = lambda v: np.asarray(v).tolist() if isinstance(v, (np.ndarray, np.generic)) else v
    return {k: plain(v) for k, v in dataclasses.asdict(self).items()}


def takes_sampling_args(method: Callable) -> Callable:
  """Gives `method(self, prompt, *args, **kwargs)` the signature `(self, prompt, max_new_tokens=
  128, ..., *, parse_special=False, stop_token_ids=None)` for help() and editors; the method
  builds its `SamplingArgs` with `SamplingArgs.of(args, kwargs)`."""
  own = list(inspect.signature(method).parameters.values())[:2]
  fields = [
    inspect.Parameter(
      f.name,
      inspect.Parameter.KEYWORD_ONLY if f.kw_only else inspect.Parameter.POSITIONAL_OR_KEYWORD,
      default=f.default,
    )
    for f in dataclasses.fields(SamplingArgs)
  ]
  sig = inspect.signature(method).replace(parameters=own + fields)

  @functools.wraps(method)
  def wrapper(*args: Any, **kwargs: Any) -> Any:
    return method(*args, **kwargs)

  wrapper.__signature__ = sig
  return wrapper


@dataclasses.dataclass(frozen=True)
class Request:
  """Validated inputs of one generate / stream call (per-prompt tuples of equal length)."""

  prompts: tuple[str | tuple[int, ...], ...]
  max_new_tokens: tuple[int, ...]
  temperature: tuple[float, ...]
  top_k: tuple[int, ...]
  top_p: tuple[float, ...]
  seed: int | tuple[int, ...] = 0
  parse_special: bool = False
  stop_token_ids: tuple[tuple[int, ...], ...] = ()  # one tuple per prompt (empty: none)
  presence_penalty: tuple[float, ...] = ()  # one per prompt (empty: off)
  frequency_penalty: tuple[float, ...] = ()
  repetition_penalty: tuple[float, ...] = ()
  logit_bias: tuple[tuple[tuple[int, float], ...], ...] = ()  # (id, bias) pairs per prompt

  @classmethod
  def build(
    cls, prompts: Any, *args: Any, max_prompts: Optional[int] = None, **kwargs: Any
  ) -> "Request":
    """Checks the prompts and the sampling arguments (one `SamplingArgs`, or its fields; see
    the module docstring); raises InputError on the first bad one."""
    a = SamplingArgs.of(args, kwargs, "Request.build")
    if isinstance(prompts, str):
      prompts = [prompts]
    elif isinstance(prompts, np.ndarray) and prompts.ndim != 1:
      if prompts.ndim != 2 or prompts.dtype.kind not in "iu":
        raise InputError(
          "prompts: an array of prompts must be 2-D integer token ids [prompts, tokens], got "
          f"shape {prompts.shape} dtype {prompts.dtype}"
        )
      prompts = list(prompts)
    elif isinstance(prompts, np.ndarray):
      prompts = prompts.tolist()
    elif not isinstance(prompts, (list, tuple)):
      raise InputError(
        "prompts must be a str or a sequence of prompts (each a str or a 1-D sequence of token "
        f"ids), got {type(prompts).__name__} {_describe(prompts)}"
      )
    n = len(prompts)
    if n and all(_is_int(p) for p in prompts):
      raise InputError(
        f"prompts is a flat sequence of {n} integers; a prompt of token ids goes inside the "
        f"list of prompts: [{_describe(list(prompts))}]"
      )
    if n == 0:
      raise InputError("no prompts: give at least one")
    if max_prompts is not None and n > max_prompts:
      raise InputError(
        f"got {n} prompts; this engine runs 1..{max_prompts} per call (EngineConfig.batch_size)"
      )
    checked = tuple(p if isinstance(p, str) else _token_ids(p, i) for i, p in enumerate(prompts))
    for i, p in enumerate(checked):
      if isinstance(p, str) and not p:
        raise InputError(f"prompt {i} is empty: a prompt needs at least one token")
    new, temp, k, p = (
      _per_prompt(name, getattr(a, name), n, *_PER_PROMPT_CHECKS[name])
      for name in ("max_new_tokens", "temperature", "top_k", "top_p")
    )
    seed_ok = lambda v: _is_int(v) and -(2**63) <= v < 2**63
    seed = a.seed
    if isinstance(seed, (list, tuple, np.ndarray)):
      seeds = _per_prompt("seed", seed, n, seed_ok, "an integer in [-2**63, 2**63)")
      seed = tuple(int(v) for v in seeds)
    elif not seed_ok(seed):
      raise InputError(f"seed must be an integer in [-2**63, 2**63), got {_describe(seed)}", "seed")
    else:
      seed = int(seed)
    stops = _stop_token_ids(a.stop_token_ids, n)
    penalties = {
      name: tuple(map(float, _per_prompt(name, getattr(a, name), n, *_PER_PROMPT_CHECKS[name])))
      for name in PENALTIES
    }
    if not isinstance(a.parse_special, (bool, np.bool_)):
      raise InputError(f"parse_special must be a bool, got {_describe(a.parse_special)}")
    return cls(
      prompts=checked,
      max_new_tokens=tuple(int(v) for v in new),
      temperature=tuple(float(v) for v in temp),
      top_k=tuple(int(v) for v in k),
      top_p=tuple(float(v) for v in p),
      seed=seed,
      parse_special=bool(a.parse_special),
      stop_token_ids=stops,
      logit_bias=_logit_bias(a.logit_bias, n),
      **penalties,
    )

  def __len__(self) -> int:
    return len(self.prompts)

  @property
  def adjusts_logits(self) -> bool:
    """Whether any prompt asks for a penalty or a logit bias (jaxspec/penalties.py)."""
    off = all(all(v == PENALTY_OFF[name] for v in getattr(self, name)) for name in PENALTIES)
    return not off or any(self.logit_bias)

  @property
  def seeds_and_rows(self) -> tuple[list[int], list[int]]:
    """(seed, index) per prompt for `sampling.row_keys` (see `seed` in the module docstring)."""
    if isinstance(self.seed, tuple):
      return list(self.seed), [0] * len(self)
    return [self.seed] * len(self), list(range(len(self)))

  def padded(self, batch: int) -> dict[str, np.ndarray]:
    """Per-row sampling values for a batch of `batch` rows; padding rows greedy and inert."""
    pad = batch - len(self)

    def rows(values: Sequence, fill, dtype) -> np.ndarray:
      return np.asarray(list(values) + [fill] * pad, dtype)

    penalties = {
      name: rows(getattr(self, name) or [PENALTY_OFF[name]] * len(self), PENALTY_OFF[name], "f4")
      for name in PENALTIES
    }
    return dict(
      max_new_tokens=rows(self.max_new_tokens, 1, np.int32),
      temperature=rows(self.temperature, 0.0, np.float32),
      top_k=rows(self.top_k, 0, np.int32),
      top_p=rows(self.top_p, 1.0, np.float32),
      **penalties,
    )

  def logit_bias_rows(self, batch: int, vocab: int) -> tuple[np.ndarray, np.ndarray]:
    """(ids [batch, MAX_LOGIT_BIAS] int32, vocab where unused; values float32) per row."""
    ids = np.full((batch, MAX_LOGIT_BIAS), vocab, np.int32)
    values = np.zeros((batch, MAX_LOGIT_BIAS), np.float32)
    for i, pairs in enumerate(self.logit_bias):
      for j, (token, bias) in enumerate(pairs):
        ids[i, j], values[i, j] = token, bias
    return ids, values
