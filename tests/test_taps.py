"""Feature taps equal transformers' `hidden_states[id + 1]` for every layer, the last included.

Published feature drafters (DFlash, EAGLE-3) were trained on HF `output_hidden_states`, whose
last entry is the final-normed state, not the last layer's raw output.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
import torch

import jaxspec
from jaxspec.models import target as target_lib

from tests import engine_models, hf_models, near_ties

NAMES = sorted(hf_models.CONFIGS)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  """name → (hf model, jaxspec model), built once per module."""
  return {
    n: (hf, jaxspec.load_model(d)) for n, (hf, d) in hf_models.save_all(tmp_path_factory).items()
  }


def _hf_hidden(hf_model, ids: np.ndarray) -> np.ndarray:
  """[L, B, T, H]: transformers' hidden_states[1:] (layer outputs, the last one final-normed)."""
  with torch.no_grad():
    hs = hf_model(torch.as_tensor(ids), output_hidden_states=True).hidden_states
  return np.stack([h.float().numpy() for h in hs[1:]])


def _assert_taps_match(model, ids, ours, ref):
  for layer in range(ref.shape[0]):
    near_ties.assert_logits_match(model, ids, ours[layer], ref[layer], atol=1e-4)


@pytest.mark.parametrize("name", NAMES)
def test_taps_equal_hf_hidden_states(saved, name):
  """One-shot forward (prefill, training): every layer's tap, the last one final-normed."""
  hf_model, model = saved[name]
  ids = np.random.default_rng(0).integers(0, model.config.vocab_size, (2, 11))
  taps = tuple(range(model.config.num_layers))
  out = target_lib.forward(model.config, model.params, jnp.asarray(ids), taps=taps)
  ref = _hf_hidden(hf_model, ids)
  assert ref.shape[0] == len(taps)
  _assert_taps_match(model, ids, np.asarray(out.taps), ref)
  # The last tap is the state the LM head reads, not the raw output of the last layer.
  np.testing.assert_allclose(np.asarray(out.taps[-1]), np.asarray(out.hidden), atol=1e-6)


@pytest.mark.parametrize("name", ["glm4moe_grouped_shared_partial", "gptoss_sliding_sinks"])
def test_block_taps_equal_hf_hidden_states(saved, name):
  """Blocks through the decoding state (chunked prefill, verify blocks) tap the same states,
  in any order of the tapped ids."""
  hf_model, model = saved[name]
  b, sizes = 2, (6, 1, 6)
  ids = np.random.default_rng(1).integers(0, model.config.vocab_size, (b, sum(sizes)))
  taps = tuple(reversed(range(model.config.num_layers)))
  _, got = engine_models.blockwise_outputs(model, ids, sizes, taps=taps)
  ref = _hf_hidden(hf_model, ids)[list(taps)]
  _assert_taps_match(model, ids, got, ref)
