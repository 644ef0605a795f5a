"""Prompt-lookup drafting behind the Drafter protocol (the device function is ngram_lookup)."""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxspec.drafters.base import Drafter, Proposal, ProposeContext, check_gamma
from jaxspec.drafters.ngram_lookup import ngram_propose


@dataclasses.dataclass(frozen=True)
class NgramDrafter(Drafter):
  """Proposes the γ tokens that followed the latest earlier match of the last n tokens.

  Deterministic (q is one-hot), stateless, free to run: acceptance is what the text's own
  repetitions give (identifiers, boilerplate, copied code).
  """

  gamma: int = 4
  n: int = 3
  min_n: int = 1

  def __post_init__(self):
    if not 1 <= self.min_n <= self.n:
      raise ValueError(f"NgramDrafter needs 1 <= min_n <= n, got min_n={self.min_n}, n={self.n}")
    check_gamma("NgramDrafter", self.gamma)

  def propose(self, params: Any, state: Any, ctx: ProposeContext) -> tuple[Proposal, Any]:
    del params
    draft, _ = ngram_propose(ctx.tokens, ctx.seq_len, self.n, self.gamma, self.min_n)
    return Proposal(draft, None), state
