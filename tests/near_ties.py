"""The tests' comparisons that are exact except at genuine near-ties.

They live in the library, jaxspec/profiling/near_ties.py (the device check, `bench.py device`,
uses them too); this module keeps the tests' `from tests import near_ties`, and adds the one
comparison that needs transformers: greedy decoding against its full (uncached) forward.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from jaxspec.profiling.near_ties import (  # noqa: F401  (re-exported)
  LOGIT_GAP,
  ROUTING_MARGIN,
  GreedyAgreement,
  assert_greedy_match,
  assert_logits_match,
  comparable_length,
  first_near_tie,
  greedy_agreement,
  routing_margins,
  stable_positions,
  top2_gaps,
)


def _full_forward(reference: Any) -> Callable[[np.ndarray], np.ndarray]:
  """ids [1, S] → logits [1, S, V] (numpy float32) of a transformers model's uncached forward,
  or `reference` itself when it is already such a function."""
  if not hasattr(reference, "config"):  # a plain callable
    return lambda ids: np.asarray(reference(ids), np.float32)
  import torch  # only these comparisons need it

  def forward(ids: np.ndarray) -> np.ndarray:
    with torch.no_grad():
      out = reference(torch.as_tensor(ids, dtype=torch.long), use_cache=False)
    return out.logits.float().numpy()

  return forward


def assert_greedy_is_full_forward_argmax(
  reference: Any,
  prompt: Sequence[int],
  tokens: Sequence[int],
  model: Any = None,
  min_fraction: float = 0.5,
) -> None:
  """Greedy `tokens` (jaxspec's cached decoding of `prompt`) are the argmax of the reference's
  full forward over prompt + tokens (teacher forcing), token by token.

  Stronger than comparing with transformers' `generate`: each token is judged on the same
  context, so one near-tie does not end the comparison, and there is no generation config to
  get wrong (`generate` given `pad_token_id` and no attention_mask masks every prompt token
  equal to the pad id: with pad_token_id=0 a random prompt holding token 0 decodes
  differently, which issue 49 took for a cache bug). `reference` is a transformers model
  (called with use_cache=False, no mask) or a function ids [1, S] → logits [1, S, V].

  Every position gets the same context in both, so each token is judged on its own: it must be
  the reference's argmax, or within LOGIT_GAP of its top logit (a genuine near-tie: either
  token is a correct argmax). With `model` (the jaxspec target), positions at or after the
  first MoE routing near-tie of the sequence are not compared (their hidden states may differ
  by O(1) between correct implementations); at least `min_fraction` of the tokens must be.
  """
  prompt = [int(x) for x in np.asarray(prompt).reshape(-1)]
  tokens = [int(x) for x in np.asarray(tokens).reshape(-1)]
  if not tokens:
    raise AssertionError("no tokens to compare")
  seq = np.asarray([prompt + tokens[:-1]], np.int64)
  logits = _full_forward(reference)(seq)[0, len(prompt) - 1 :]  # row j predicts tokens[j]
  n = len(tokens)
  if model is not None:
    unstable = ~stable_positions(model, seq.astype(np.int32))[0, len(prompt) - 1 :]
    n = first_near_tie(np.where(unstable, -np.inf, np.inf))
  if n < min_fraction * len(tokens):
    raise AssertionError(
      f"only {n} of {len(tokens)} tokens precede a routing near-tie; draw other inputs"
    )
  best = logits[:n].max(-1)
  chosen = logits[np.arange(n), tokens[:n]]
  short = np.flatnonzero(best - chosen >= LOGIT_GAP)
  if short.size:
    j = int(short[0])
    raise AssertionError(
      f"token {j} ({tokens[j]}) is not the full forward's argmax ({int(logits[j].argmax())}): "
      f"its logit is {best[j] - chosen[j]:.4g} below the top\n  tokens {tokens}\n"
      f"  argmax {logits.argmax(-1).tolist()}"
    )
