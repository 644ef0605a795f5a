"""Comparisons that are exact except at genuine near-ties.

Two correct implementations of the same model (jaxspec vs transformers, a verify block vs
one-token decoding, sharded vs one device, AVX-512 vs AVX2 kernels) agree to float rounding,
about 1e-6. That is enough for every continuous quantity, but not for a discrete choice made
on nearly equal values:

* MoE routing: two routing groups or two experts whose scores differ by 1e-7 can be chosen
  differently; the token's output then differs by O(1), and so does every later token of its
  sequence (they attend to it).
* Greedy decoding: when the two best logits differ by less than the rounding, either token is
  a correct argmax, and the continuations differ from there on.

This module finds those places on the jaxspec side (router logits are sown by the MoE layer as
`intermediates/router_logits`; routing margins are recomputed here in float64, independently
of `moe.route`) and compares everything before them exactly as before. Nothing is loosened:
a position that is not at or after a near-tie must match to the test's usual tolerance.

The tests (through tests/near_ties.py) and the device check (`bench.py device`, whose lossless
section compares greedy speculative decoding with plain decoding in float32 and bf16) share
these comparisons: `greedy_agreement` counts, `assert_greedy_match` asserts.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.models import target as target_lib
from jaxspec.models.decoder import Decoder

# Score gap (sigmoid scores or softmax probabilities, ~[0, 1]) below which a routing choice is
# a near-tie. Correct implementations differ by ~1e-7..1e-6 in these scores (logits by ~1e-6);
# the failure that motivated this module had a gap of 1.4e-7.
ROUTING_MARGIN = 1e-5
# Top-2 logit gap below which a greedy choice is a near-tie (parity tolerances are 1e-4).
LOGIT_GAP = 1e-3


def _routing_margins_one(config, logits: np.ndarray, bias: np.ndarray | None) -> np.ndarray:
  """Smallest score gap at any discrete routing choice: logits [N, E] → margins [N]."""
  k = config.num_experts_per_tok
  logits = logits.astype(np.float64)
  n, e = logits.shape
  margins = np.full((n,), np.inf)
  if config.router == "softmax":
    z = np.exp(logits - logits.max(-1, keepdims=True))
    choice = z / z.sum(-1, keepdims=True)
  elif config.router == "topk_softmax":  # gpt-oss: top-k of the (biased, as sown) logits
    choice = logits
  else:
    choice = 1.0 / (1.0 + np.exp(-logits)) + bias[None, :].astype(np.float64)
    if config.n_group > 1:
      grouped = np.sort(choice.reshape(n, config.n_group, e // config.n_group), axis=-1)
      group_scores = np.sort(grouped[..., -2:].sum(-1), axis=-1)[:, ::-1]  # [N, G] descending
      if config.topk_group < config.n_group:
        gap = group_scores[:, config.topk_group - 1] - group_scores[:, config.topk_group]
        margins = np.minimum(margins, gap)
      threshold = group_scores[:, config.topk_group - 1]
      per_group = grouped[..., -2:].sum(-1)  # [N, G] in group order
      keep = np.repeat(per_group >= threshold[:, None], e // config.n_group, axis=1)
      choice = np.where(keep, choice, -np.inf)
  ordered = np.sort(choice, axis=-1)[:, ::-1]
  if k < e:  # a kept expert against the best one left out (-inf outside the kept groups)
    margins = np.minimum(margins, ordered[:, k - 1] - ordered[:, k])
  return margins


@functools.partial(jax.jit, static_argnums=0)
def _intermediates(config, params: Any, tokens: jax.Array) -> Any:
  """The values sown by a full causal forward (router logits per MoE layer)."""
  _, state = Decoder(config).apply({"params": params}, tokens, mutable=["intermediates"])
  return state["intermediates"]


def routing_margins(model: target_lib.TargetModel, ids: Any) -> np.ndarray:
  """[B, T] smallest routing margin of each token over every MoE layer (inf for dense models)."""
  tokens = jnp.asarray(model.check_tokens(ids))
  b, t = tokens.shape
  config = model.config
  if not config.num_experts:
    return np.full((b, t), np.inf)
  margins = np.full((b, t), np.inf)
  # The scanned layout (model.config.options.scan_layers) stacks the per-layer values; make it so.
  params = model.with_scan_layers(True).params
  scanned = config.with_options(scan_layers=True)
  for stack, sown in _intermediates(scanned, params, tokens).items():
    if "mlp" not in sown or "router_logits" not in sown["mlp"]:
      continue
    per_layer = np.asarray(sown["mlp"]["router_logits"][0])  # [L_stack, B*T, E]
    biases = params[stack]["mlp"].get("e_score_correction_bias")
    for layer, logits in enumerate(per_layer):
      bias = None if biases is None else np.asarray(biases[layer])
      margins = np.minimum(margins, _routing_margins_one(config, logits, bias).reshape(b, t))
  return margins


def stable_positions(model: target_lib.TargetModel, ids: Any) -> np.ndarray:
  """bool [B, T]: positions whose logits every correct implementation reproduces.

  A position is unstable from the first routing near-tie of its sequence onwards.
  """
  tie = routing_margins(model, ids) < ROUTING_MARGIN
  return ~np.logical_or.accumulate(tie, axis=1)


def assert_logits_match(
  model: target_lib.TargetModel,
  ids: Any,
  ours: Any,
  reference: Any,
  atol: float,
  columns: slice = slice(None),
  max_excluded: float = 0.25,
) -> None:
  """assert_allclose of [B, T, ...] arrays (logits, hidden states) on the stable positions.

  `ids` [B, S] is the whole sequence the arrays were computed for; `columns` selects the T
  positions they cover (e.g. a verify block). At most `max_excluded` of those may be left out.
  """
  keep = stable_positions(model, ids)[:, columns]
  excluded = 1.0 - keep.mean()
  if excluded > max_excluded:
    raise AssertionError(
      f"{excluded:.0%} of positions follow a routing near-tie; draw other inputs"
    )
  np.testing.assert_allclose(np.asarray(ours)[keep], np.asarray(reference)[keep], atol=atol, rtol=0)


def first_near_tie(gaps: Any, threshold: float = LOGIT_GAP) -> int:
  """Index of the first top-2 logit gap under `threshold` in `gaps` [N], or N if none is."""
  ties = np.flatnonzero(np.asarray(gaps) < threshold)
  return int(ties[0]) if ties.size else len(gaps)


def top2_gaps(
  model: target_lib.TargetModel,
  prompts: Sequence[Sequence[int]],
  outputs: Sequence[Sequence[int]],
  length: int,
) -> list[np.ndarray]:
  """Per sequence, the top-2 logit gap at the position that predicts each token of `outputs`.

  One causal forward of every prompt + output[:-1], right-padded to `length` tokens (so one
  compile serves every call of the same shape).
  """
  ids = np.zeros((len(prompts), length), np.int32)
  for i, (p, o) in enumerate(zip(prompts, outputs)):
    seq = list(p) + list(o[:-1])
    ids[i, : len(seq)] = seq
  top2 = jax.lax.top_k(model.logits(ids), 2)[0]
  gap = np.asarray(top2[..., 0] - top2[..., 1])
  return [
    gap[i, len(p) - 1 : len(p) - 1 + len(o)] for i, (p, o) in enumerate(zip(prompts, outputs))
  ]


@dataclasses.dataclass(frozen=True)
class GreedyAgreement:
  """Greedy outputs against a reference, each compared up to its first near-tie.

  `first_diff[i]`: the first token where sequence i differs from its reference (-1: none);
  `compared`: tokens compared (before the near-ties), of `tokens` reference tokens;
  `ok`: no sequence differs before its first near-tie.
  """

  sequences: int
  tokens: int
  compared: int
  exact: int
  first_diff: tuple[int, ...]
  ok: bool


def greedy_agreement(
  reference: Sequence[Sequence[int]],
  got: Sequence[Sequence[int]],
  comparable: Sequence[int],
) -> GreedyAgreement:
  """Compares `got` with `reference` on each sequence's first `comparable[i]` tokens (the tokens
  before its first near-tie: `comparable_length`, or `first_near_tie` of `top2_gaps`)."""
  exact = compared = total = 0
  first_diff, ok = [], True
  for ref, out, n_ok in zip(reference, got, comparable):
    ref, out = list(ref), list(out)
    n = len(ref)
    diff = next((j for j in range(n) if j >= len(out) or out[j] != ref[j]), None)
    if diff is None and len(out) != n:
      diff = n
    exact += diff is None
    first_diff.append(-1 if diff is None else diff)
    ok = ok and (diff is None or diff >= n_ok)
    compared += n_ok
    total += n
  return GreedyAgreement(len(reference), total, compared, exact, tuple(first_diff), ok)


def comparable_length(
  model: target_lib.TargetModel, prompt: Sequence[int], generated: Sequence[int]
) -> int:
  """How many leading tokens of a greedy continuation every correct implementation reproduces.

  `generated` is a reference greedy continuation of `prompt`. Token j is fixed if no routing
  near-tie occurs at or before the position that predicts it, and no logit near-tie (top-2
  gap < LOGIT_GAP) occurs at the positions that predict tokens 0..j.
  """
  prompt, generated = list(prompt), list(generated)
  if not generated:
    return 0
  seq = np.asarray([prompt + generated[:-1]], np.int32)
  logits = np.asarray(model.logits(seq))[0, len(prompt) - 1 :]  # predicts generated[j] at row j
  top2 = np.sort(logits, axis=-1)[:, -2:]
  gaps = top2[:, 1] - top2[:, 0]
  routing_tie = ~stable_positions(model, seq)[0, len(prompt) - 1 :]
  return first_near_tie(np.where(routing_tie, -np.inf, gaps))


def assert_greedy_match(
  model: target_lib.TargetModel,
  prompts: Sequence[Sequence[int]],
  reference: Sequence[Sequence[int]],
  got: Sequence[Sequence[int]],
  min_fraction: float = 0.5,
) -> None:
  """Greedy outputs equal the reference up to each sequence's first near-tie.

  Asserts that the compared tokens are at least `min_fraction` of the reference tokens, so a
  test does not pass by comparing nothing.
  """
  if len(got) != len(reference):
    raise AssertionError(f"{len(got)} outputs for {len(reference)} references")
  comparable = [
    comparable_length(model, [int(x) for x in np.asarray(p).reshape(-1)], list(ref))
    for p, ref in zip(prompts, reference)
  ]
  agreement = greedy_agreement(reference, got, comparable)
  for i, (ref, out, n) in enumerate(zip(reference, got, comparable)):
    if list(out)[:n] != list(ref)[:n]:
      raise AssertionError(
        f"sequence {i}: outputs differ before the first near-tie (token {n}):\n"
        f"  reference {list(ref)[:n]}\n  got       {list(out)[:n]}"
      )
    if n == len(ref) and len(out) != len(ref):
      raise AssertionError(f"sequence {i}: length {len(out)} != {len(ref)}")
  if agreement.tokens and agreement.compared < min_fraction * agreement.tokens:
    raise AssertionError(
      f"only {agreement.compared} of {agreement.tokens} tokens precede a near-tie; "
      "draw other inputs"
    )
