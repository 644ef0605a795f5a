"""The tests' comparisons that are exact except at genuine near-ties.

They live in the library, jaxspec/profiling/near_ties.py (the device check, `bench.py device`,
uses them too); this module keeps the tests' `from tests import near_ties`.
"""

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
