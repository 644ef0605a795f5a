"""Quantization sensitivity per layer and module kind, and the cheapest policy under a KL budget.

For each group (one role in one layer: a layer's experts, its attention, its router, ...; the
LM head and MTP layers as their own groups) and each format that fits it, quantize that group
alone and measure on held-out tokens, against the unquantized target:

  KL(p_full ‖ p_quantized)  mean over positions of the next-token distributions
  top-1 agreement           how often both pick the same next token
  Δ perplexity              relative change of the held-out perplexity
  Δ acceptance length       with a drafter, greedy, on a few prompts (optional: it is slower)

`choose_policy` then takes, group by group, the format with the most bytes saved per unit of
KL while the summed KL stays within the budget, measures the combined policy (KL is not exactly
additive) and drops groups until the measured KL fits. The result is a per-layer policy
("experts@3" rules) that `jaxspec.quantize` and `launch/generate.py --quant_policy` accept.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.errors import ConfigError
from jaxspec.quant.formats import FORMATS
from jaxspec.quant.policy import (
  NEVER,
  layer_of,
  path_str,
  quantize,
  role_of,
)


@dataclasses.dataclass
class GroupResult:
  """One group quantized alone in one format, measured against the full target."""

  layer: Optional[int]
  role: str
  format: str
  bytes_before: int
  bytes_after: int
  kl: float
  top1: float
  ppl_delta: float
  tau_delta: Optional[float] = None

  @property
  def pattern(self) -> str:
    return self.role if self.layer is None else f"{self.role}@{self.layer}"

  @property
  def saved(self) -> int:
    return self.bytes_before - self.bytes_after


def groups(target: Any) -> list[tuple[Optional[int], str]]:
  """The (layer, role) groups of a per-layer (scan_layers=False) target's quantizable weights."""
  if target.config.options.scan_layers:
    raise ConfigError("profiling needs the per-layer layout: load with scan_layers=False")
  found = set()
  for path, _ in jax.tree_util.tree_flatten_with_path(target.params)[0]:
    name = path_str(path)
    role = role_of(name)
    if role in NEVER:
      continue
    found.add((layer_of(target.config, name), role))
  return sorted(found, key=lambda g: (g[0] is None, g[0] or 0, g[1]))


def held_out_windows(tokenizer: Any, count: int, length: int) -> np.ndarray:
  """`count` windows of `length` tokens of the validation split (never trained on)."""
  from jaxspec.train import data as data_lib  # pylint: disable=import-outside-toplevel

  ids: list[int] = []
  files = data_lib.corpus_files("validation")
  for i in range(0, len(files), 32):
    ids.extend(tokenizer.encode("\n\n".join(data_lib.read_documents(files[i : i + 32]))))
    if len(ids) >= count * length * 4:
      break
  if len(ids) < count * length:
    raise ConfigError(f"the validation split holds {len(ids)} tokens, fewer than {count * length}")
  starts = np.linspace(0, len(ids) - length, count).astype(int)
  return np.stack([np.asarray(ids[s : s + length], np.int32) for s in starts])


class Evaluator:
  """The full target's next-token distributions on fixed tokens, and a model's distance to it."""

  def __init__(self, target: Any, tokens: np.ndarray):
    self.tokens = jnp.asarray(tokens)
    self.ref = self._logprobs(target)
    nll = -np.take_along_axis(self.ref[:, :-1], np.asarray(tokens)[:, 1:, None], -1)
    self.ref_ppl = float(np.exp(nll.mean()))

  def _logprobs(self, model: Any) -> np.ndarray:
    logits = model.logits(self.tokens)
    return np.asarray(jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1), np.float64)

  def compare(self, model: Any) -> dict[str, float]:
    lp = self._logprobs(model)
    kl = np.sum(np.exp(self.ref) * (self.ref - lp), axis=-1)
    top1 = np.argmax(self.ref, -1) == np.argmax(lp, -1)
    nll = -np.take_along_axis(lp[:, :-1], np.asarray(self.tokens)[:, 1:, None], -1)
    ppl = float(np.exp(nll.mean()))
    return {
      "kl": float(kl.mean()),
      "top1": float(top1.mean()),
      "ppl_delta": ppl / self.ref_ppl - 1.0,
    }


def acceptance_length(target: Any, drafter: Any, prompts: Sequence[Any], max_new: int) -> float:
  """Greedy pooled acceptance length of `drafter` on `target` (a quantized one included)."""
  from jaxspec.speculative.engine import SpecEngine  # pylint: disable=import-outside-toplevel
  from jaxspec.speculative.engine_config import EngineConfig  # pylint: disable=import-outside-toplevel

  if drafter is None or not prompts:
    return float("nan")
  longest = max(len(target.tokenizer.encode(p)) if isinstance(p, str) else len(p) for p in prompts)
  cfg = EngineConfig(max_len=longest + max_new + drafter.gamma + 2, batch_size=len(prompts))
  out = SpecEngine(target, drafter, cfg).generate(list(prompts), max_new_tokens=max_new)
  return out.stats.acceptance_length


def profile(
  target: Any,
  tokens: np.ndarray,
  drafter_fn: Optional[Callable[[Any], Any]] = None,
  prompts: Sequence[Any] = (),
  max_new: int = 48,
  formats: Sequence[str] = FORMATS,
  progress: bool = True,
) -> tuple[list[GroupResult], Evaluator]:
  """Every group alone in every format that fits it (see the module docstring).

  drafter_fn(target) → a drafter bound to that (quantized) target, for Δ acceptance length.
  """
  evaluator = Evaluator(target, tokens)
  measure_tau = drafter_fn is not None and bool(prompts)
  base_tau = None
  if measure_tau:
    base_tau = acceptance_length(target, drafter_fn(target), prompts, max_new)
  todo = [(g, f) for g in groups(target) for f in formats]
  results = []
  bar = None
  if progress:
    from tqdm import tqdm  # pylint: disable=import-outside-toplevel

    bar = tqdm(total=len(todo), desc="quantization sensitivity", unit="group")
  for (layer, role), fmt in todo:
    pattern = role if layer is None else f"{role}@{layer}"
    try:
      model = quantize(target, ((pattern, fmt),))
    except ConfigError:  # the format does not fit this group (MXFP4 needs blocks of 32)
      model = None
    if model is not None and model.quant_report.formats:
      r = model.quant_report
      tau = None  # no drafter or no prompts: Δτ not measured (not NaN)
      if measure_tau:
        tau = acceptance_length(model, drafter_fn(model), prompts, max_new) / base_tau - 1.0
      stored = _quantized_bytes(model)
      as_float = r.bytes_before - r.bytes_after + stored  # the group's own float bytes
      results.append(
        GroupResult(layer, role, fmt, as_float, stored, **evaluator.compare(model), tau_delta=tau)
      )
    if bar is not None:
      bar.update(1)
  if bar is not None:
    bar.close()
  return results, evaluator


def _quantized_bytes(model: Any) -> int:
  from jaxspec.quant.formats import QTensor, nbytes  # pylint: disable=import-outside-toplevel

  leaves = jax.tree_util.tree_leaves(model.params, is_leaf=lambda x: isinstance(x, QTensor))
  return sum(nbytes(x) for x in leaves if isinstance(x, QTensor))


def choose_policy(
  results: Sequence[GroupResult], evaluator: Evaluator, target: Any, kl_budget: float
) -> tuple[tuple[tuple[str, str], ...], dict[str, float]]:
  """The per-layer policy with the most bytes saved whose measured KL is within the budget.

  Returns (rules, the combined policy's measured metrics plus its bytes).
  """
  best: dict[str, GroupResult] = {}
  for r in sorted(results, key=lambda r: r.bytes_after):  # the cheapest fitting format first
    if r.kl <= kl_budget and r.pattern not in best:
      best[r.pattern] = r
  ranked = sorted(best.values(), key=lambda r: r.saved / max(r.kl, 1e-12), reverse=True)
  chosen, total = [], 0.0
  for r in ranked:
    if total + r.kl <= kl_budget:
      chosen.append(r)
      total += r.kl
  while True:
    rules = tuple((r.pattern, r.format) for r in chosen)
    measured = measure_policy(target, rules, evaluator)
    if measured["kl"] <= kl_budget or not chosen:
      return rules, measured
    chosen.pop()  # the least bytes per KL goes first


def measure_policy(target: Any, rules: tuple, evaluator: Evaluator) -> dict[str, float]:
  """A policy's KL, top-1 and Δ perplexity on the evaluator's tokens, and its bytes."""
  model = quantize(target, rules)
  out = evaluator.compare(model) if rules else {"kl": 0.0, "top1": 1.0, "ppl_delta": 0.0}
  out["bytes_before"] = model.quant_report.bytes_before
  out["bytes_after"] = model.quant_report.bytes_after
  return out


def policy_effect(
  target: Any,
  rules: Sequence,
  drafter_fn: Optional[Callable[[Any], Any]],
  prompts: Sequence[Any],
  max_new: int,
) -> dict[str, float]:
  """What a whole policy does to decoding: the fraction of greedy tokens equal to the
  unquantized target's (up to each prompt's first difference, and overall), and, with a
  drafter, the relative change of its acceptance length."""
  from jaxspec.speculative.engine import SpecEngine  # pylint: disable=import-outside-toplevel
  from jaxspec.speculative.engine_config import EngineConfig  # pylint: disable=import-outside-toplevel

  if not prompts:
    return {}
  model = quantize(target, rules)
  longest = max(len(target.tokenizer.encode(p)) if isinstance(p, str) else len(p) for p in prompts)
  cfg = EngineConfig(max_len=longest + max_new + 2, batch_size=len(prompts), use_eos=False)
  outs = [
    SpecEngine(m, None, cfg).generate(list(prompts), max_new_tokens=max_new).tokens
    for m in (target, model)
  ]
  same = prefix = total = 0
  for a, b in zip(*outs):
    eq = np.asarray(a) == np.asarray(b)
    same += int(eq.sum())
    prefix += len(eq) if eq.all() else int(np.argmin(eq))
    total += len(eq)
  out = {"greedy_match": same / total, "greedy_match_before_divergence": prefix / total}
  if drafter_fn is not None:
    base = acceptance_length(target, drafter_fn(target), prompts, max_new)
    out["tau_delta"] = acceptance_length(model, drafter_fn(model), prompts, max_new) / base - 1
  return out
