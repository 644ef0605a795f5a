"""DeepSeek Sparse Attention targets (GLM-5 `glm_moe_dsa`, DeepSeek-V3.2 `deepseek_v32`) against
an independent numpy reference (tests/dsa_reference.py, written from DeepSeek's published
inference code), past `index_topk`, where the indexer's choice matters.

The verdict of issue 49 (jaxspec and transformers 5.24 differ by 0.1-2 in logits past top-k):
jaxspec is right, transformers' difference is a tie-break. A key whose q·k is negative for
every indexer head scores exactly 0; with few heads (2-4) and negative head weights several
keys of a query often tie at 0 at the top-k boundary (here 3-17 of 64 queries per layer).
The published code leaves that choice to torch.topk. jaxspec (lax.top_k) keeps the earlier
key, as the reference does, so a query's choice depends on nothing after it. torch.topk on CPU
picks among the tied keys in an order that depends on the row's length: transformers' logits
equal the reference at every position before the sequence's first exact tie and differ from
there on, and its logits at position t change when later tokens are appended (by up to 1.6 at
t ≥ index_topk with index_n_heads 2). Both deviations are shown below as documented checks
(`test_transformers_equals_the_reference_until_the_first_exact_tie`) and an xfail.

Also noticed (not a tie): jaxspec's q_a_layernorm / kv_a_layernorm use `rms_norm_eps`, the
published DeepSeek code and transformers a fixed 1e-6 (vLLM uses rms_norm_eps). DeepSeek
ships rms_norm_eps 1e-6, so they agree there; with GLM-style 1e-5 the logits move by ~3e-5.
The configurations here use 1e-6 so the comparison can be tight.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.io.hf import load_model
from jaxspec.models import target as target_lib
from jaxspec.state import DecodingState
from tests import dsa_reference, hf_models

TOPK, LENGTH, PREFIX = 9, 41, 30
# name → (config class, model class, changes to hf_models' DSA fields)
CASES = {
  "glm_moe_dsa": (
    "GlmMoeDsaConfig",
    "GlmMoeDsaForCausalLM",
    {"num_hidden_layers": 3, "indexer_types": ["full", "shared", "full"], "index_n_heads": 2},
  ),
  "deepseek_v32": (
    "DeepseekV32Config",
    "DeepseekV32ForCausalLM",
    {"num_hidden_layers": 2, "index_n_heads": 4},
  ),
}


class Case:
  """One DSA target: transformers' model, jaxspec's load of its checkpoint, the reference over
  the same weights, and their logits for two sequences of LENGTH tokens."""

  def __init__(self, name: str, directory: str):
    config_cls, model_cls, changes = CASES[name]
    fields = dict(hf_models._DSA, index_topk=TOPK, rms_norm_eps=1e-6, **changes)
    self.hf = hf_models.build_hf_model_from(config_cls, model_cls, fields)
    self.hf.save_pretrained(directory)
    self.model = load_model(directory)
    state = {k: v.numpy() for k, v in self.hf.state_dict().items()}
    config = self.hf.config.to_dict()
    self.reference = dsa_reference.Reference(state, config)
    self.last_wins = dsa_reference.Reference(state, config, tie="last")
    self.dense = dsa_reference.Reference(state, dict(config, index_topk=10**6))
    self.ids = np.random.default_rng(0).integers(0, fields["vocab_size"], (2, LENGTH))
    self.ours = np.asarray(self.model.logits(jnp.asarray(self.ids)))
    runs = [self.reference.forward(row) for row in self.ids]
    self.want = np.stack([logits for logits, _ in runs])
    # [2, LENGTH]: the smallest gap at the top-k boundary over the layers (0: an exact tie).
    self.gaps = np.stack(
      [
        np.min([dsa_reference.boundary_gaps(s, TOPK) for s in trace.scores.values()], 0)
        for _, trace in runs
      ]
    )

  def first_tie(self) -> np.ndarray:
    """[2] each row's first position with an exact tie at its top-k boundary."""
    return np.array([np.flatnonzero(g == 0)[0] for g in self.gaps])


_BUILT: dict[str, Case] = {}


def _built(name: str, tmp_path_factory) -> Case:
  if name not in _BUILT:
    _BUILT[name] = Case(name, str(tmp_path_factory.mktemp(name)))
  return _BUILT[name]


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request, tmp_path_factory):
  return _built(request.param, tmp_path_factory)


@pytest.fixture(scope="module")
def glm(tmp_path_factory):
  """GLM-5 (a layer sharing the previous indexer's choice, 2 indexer heads: the most ties)."""
  yield _built("glm_moe_dsa", tmp_path_factory)
  _BUILT.clear()


def test_inputs_reach_past_topk_with_exact_ties_and_no_near_ties(case):
  """The comparison below is where it matters: queries past index_topk, exact ties at the
  top-k boundary in both rows, and no other gap small enough for rounding to flip."""
  past = case.gaps[:, TOPK:]
  assert np.isinf(case.gaps[:, :TOPK]).all()
  assert (past == 0).any(axis=1).all()
  assert past[past > 0].min() > 1e-5


def test_logits_equal_the_reference_past_topk(case):
  np.testing.assert_allclose(case.ours, case.want, atol=2e-5, rtol=0)
  # The comparison sees the choice: breaking ties the other way, or keeping every key, moves
  # the logits past top-k (and only there).
  for other in (case.last_wins, case.dense):
    moved = np.stack(
      [np.abs(other.forward(row)[0] - w).max(-1) for row, w in zip(case.ids, case.want)]
    )
    assert moved[:, :TOPK].max() < 1e-9
    assert moved[:, TOPK:].max() > 0.1


def test_sparse_path_is_causal_and_length_invariant(glm):
  """Logits at t depend on tokens ≤ t only: appending tokens or changing later ones leaves
  them, through the top-k choice too (exact ties included)."""
  case = glm
  model, ids = case.model, case.ids
  shorter = np.asarray(model.logits(jnp.asarray(ids[:, :PREFIX])))
  np.testing.assert_allclose(shorter, case.ours[:, :PREFIX], atol=1e-5, rtol=0)
  changed = ids.copy()
  changed[:, PREFIX:] = (changed[:, PREFIX:] + 1) % model.config.vocab_size
  other = np.asarray(model.logits(jnp.asarray(changed)))
  np.testing.assert_allclose(other[:, :PREFIX], case.ours[:, :PREFIX], atol=1e-5, rtol=0)
  assert np.abs(other[:, PREFIX:] - case.ours[:, PREFIX:]).max() > 1e-2


def test_cached_decoding_equals_the_reference(glm):
  """A short prefill, a verify block and a one-token decode through the decoding state (latent
  cache and indexer keys) choose as the reference does, exact ties included."""
  model, ids = glm.model, glm.ids
  state = DecodingState.create(model.config, 2, 48)
  out, pos = [], 0
  for t in (TOPK - 1, LENGTH - TOPK, 1):
    start = jnp.full((2,), pos, jnp.int32)
    res = target_lib.forward(
      model.config, model.params, jnp.asarray(ids[:, pos : pos + t]), start, state
    )
    state = res.state.commit(jnp.full((2,), t, jnp.int32))
    out.append(np.asarray(res.logits))
    pos += t
  np.testing.assert_allclose(np.concatenate(out, axis=1), glm.want, atol=2e-5, rtol=0)


def test_transformers_equals_the_reference_until_the_first_exact_tie(case):
  """transformers 5.24 is the reference up to each row's first exact tie at a top-k boundary
  (so the MLA, indexer and RoPE math agree), and differs after it: torch.topk breaks the tie
  its own way (see the module docstring)."""
  theirs = hf_models.hf_logits(case.hf, case.ids)
  diff = np.abs(theirs - case.want).max(-1)
  for row, first in enumerate(case.first_tie()):
    assert diff[row, :first].max() < 2e-5, row
  assert diff.max() > 0.1  # the deviation this check documents; revisit if it disappears


@pytest.mark.xfail(
  reason="transformers 5.24 breaks exact index-score ties with torch.topk, whose "
  "order depends on the sequence length (issue 49)",
  strict=False,
)
def test_transformers_is_length_invariant_past_topk(case):
  shorter = hf_models.hf_logits(case.hf, case.ids[:, :PREFIX])
  np.testing.assert_allclose(shorter, hf_models.hf_logits(case.hf, case.ids)[:, :PREFIX], atol=1e-4)
