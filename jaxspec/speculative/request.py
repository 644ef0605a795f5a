"""One generation request, checked once at the boundary.

`SpecEngine.generate`, `stream` and `init_state` take keyword arguments (the public contract)
and build a `Request` from them. Everything a caller can get wrong is refused here, with an
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
Per-prompt values come as a list, tuple or 1-D array whose length is the prompt count; a
one-element sequence for one prompt is the same as its scalar.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any, Optional, Sequence

import numpy as np

from jaxspec.errors import InputError

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
        f"dtype {prompt.dtype}"
      )
    values = prompt.tolist()
  elif isinstance(prompt, (list, tuple)):
    values = list(prompt)
    for j, t in enumerate(values):
      if not _is_int(t):
        hint = " (a text prompt is one str, not a list of str)" if isinstance(t, str) else ""
        raise InputError(
          f"{where}: token ids must be integers, got {_describe(t)} at position {j}{hint}"
        )
  else:
    raise InputError(
      f"{where}: a prompt is a str or a 1-D sequence of token ids, got {type(prompt).__name__} "
      f"{_describe(prompt)}"
    )
  ids = tuple(int(t) for t in values)
  if not ids:
    raise InputError(f"{where} is empty: a prompt needs at least one token")
  bad = [t for t in ids if not 0 <= t <= _INT32_MAX]
  if bad:
    raise InputError(f"{where}: token ids must be ≥ 0, got {bad[:4]}")
  return ids


def _per_prompt(name: str, value: Any, n: int, check, kind: str) -> tuple:
  """A scalar or one value per prompt, as an n-tuple; each value passes `check`."""
  if isinstance(value, np.ndarray):
    if value.ndim > 1:
      raise InputError(f"{name}: expected {kind} or one per prompt, got shape {value.shape}")
    values = value.tolist() if value.ndim == 1 else [value.item()]
    if value.ndim == 1 and value.dtype.kind not in "iuf":
      raise InputError(f"{name}: expected {kind} values, got dtype {value.dtype}")
  elif isinstance(value, (list, tuple)):
    values = list(value)
  else:
    values = None
  if values is None:
    out = (value,) * n
  elif len(values) != n:
    raise InputError(
      f"{name}: got {len(values)} values for {n} prompt{'s' if n != 1 else ''} "
      "(give one value, or one per prompt)"
    )
  else:
    out = tuple(values)
  for v in out:
    if not check(v):
      raise InputError(f"{name} must be {kind}, got {_describe(v)}")
  return out


def _stop_token_ids(value: Any, n: int) -> tuple[tuple[int, ...], ...]:
  """None, one id sequence for every prompt, or one per prompt → n tuples of ids."""
  if value is None:
    return ((),) * n
  if isinstance(value, np.ndarray):
    value = value.tolist()
  if not isinstance(value, (list, tuple)):
    raise InputError(
      f"stop_token_ids must be a sequence of token ids (or one per prompt), got "
      f"{_describe(value)}"
    )
  per_prompt = bool(value) and all(isinstance(v, (list, tuple, np.ndarray)) for v in value)
  if per_prompt:
    lists = [np.asarray(v).tolist() if isinstance(v, np.ndarray) else list(v) for v in value]
    if len(lists) != n:
      raise InputError(f"stop_token_ids: got {len(lists)} lists for {n} prompts")
  else:
    lists = [list(value)] * n
  for ids in lists:
    for t in ids:
      if not (_is_int(t) and 0 <= t <= _INT32_MAX):
        raise InputError(f"stop_token_ids must hold token ids (integers ≥ 0), got {_describe(t)}")
  return tuple(tuple(int(t) for t in ids) for ids in lists)


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

  @classmethod
  def build(
    cls,
    prompts: Any,
    max_new_tokens: Any = 128,
    temperature: Any = 0.0,
    top_k: Any = 0,
    top_p: Any = 1.0,
    seed: Any = 0,
    parse_special: Any = False,
    max_prompts: Optional[int] = None,
    stop_token_ids: Any = None,
  ) -> "Request":
    """Checks every argument (see the module docstring); raises InputError on the first bad one."""
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
    new = _per_prompt(
      "max_new_tokens",
      max_new_tokens,
      n,
      lambda v: _is_int(v) and 1 <= v <= _INT32_MAX,
      "an integer ≥ 1",
    )
    temp = _per_prompt(
      "temperature",
      temperature,
      n,
      lambda v: _is_real(v) and math.isfinite(v) and v >= 0,
      "a finite number ≥ 0 (0 = greedy)",
    )
    k = _per_prompt(
      "top_k", top_k, n, lambda v: _is_int(v) and 0 <= v <= _INT32_MAX, "an integer ≥ 0 (0 = off)"
    )
    p = _per_prompt(
      "top_p",
      top_p,
      n,
      lambda v: _is_real(v) and math.isfinite(v) and 0 < v <= 1,
      "a number in (0, 1] (1 = off)",
    )
    seed_ok = lambda v: _is_int(v) and -(2**63) <= v < 2**63
    if isinstance(seed, (list, tuple, np.ndarray)):
      seeds = _per_prompt("seed", seed, n, seed_ok, "an integer in [-2**63, 2**63)")
      seed = tuple(int(v) for v in seeds)
    elif not seed_ok(seed):
      raise InputError(f"seed must be an integer in [-2**63, 2**63), got {_describe(seed)}")
    else:
      seed = int(seed)
    stops = _stop_token_ids(stop_token_ids, n)
    if not isinstance(parse_special, (bool, np.bool_)):
      raise InputError(f"parse_special must be a bool, got {_describe(parse_special)}")
    return cls(
      prompts=checked,
      max_new_tokens=tuple(int(v) for v in new),
      temperature=tuple(float(v) for v in temp),
      top_k=tuple(int(v) for v in k),
      top_p=tuple(float(v) for v in p),
      seed=seed,
      parse_special=bool(parse_special),
      stop_token_ids=stops,
    )

  def __len__(self) -> int:
    return len(self.prompts)

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

    return dict(
      max_new_tokens=rows(self.max_new_tokens, 1, np.int32),
      temperature=rows(self.temperature, 0.0, np.float32),
      top_k=rows(self.top_k, 0, np.int32),
      top_p=rows(self.top_p, 1.0, np.float32),
    )
