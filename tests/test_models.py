"""Target models against HF transformers (CPU, float32) on small random configurations."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
import torch

import jaxspec
from jaxspec.models import target as target_lib
from jaxspec.speculative import step as step_lib
from jaxspec.speculative.engine import SpecEngine
from jaxspec.speculative.engine_config import EngineConfig
from jaxspec.state import DecodingState, FloatKV

from tests import engine_models, hf_models, near_ties

NAMES = sorted(hf_models.CONFIGS)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  """name → (hf model, checkpoint dir), built once per module."""
  return hf_models.save_all(tmp_path_factory)


@pytest.mark.parametrize("backend", ["dense", "ragged", "loop"])
@pytest.mark.parametrize("name", NAMES)
def test_logits_match_transformers(saved, name, backend):
  hf_model, path = saved[name]
  model = jaxspec.load_model(path, options=jaxspec.RunOptions(moe_backend=backend))
  ids = np.random.default_rng(0).integers(0, model.config.vocab_size, (2, 11))
  ours = np.asarray(model.logits(ids))
  ref = hf_models.hf_logits(hf_model, ids)
  near_ties.assert_logits_match(model, ids, ours, ref, atol=1e-4)


def test_moe_backends_agree_and_differ_from_wrong_routing(saved):
  _, path = saved["glm4moe_grouped_shared_partial"]
  model = jaxspec.load_model(path)
  ids = np.random.default_rng(1).integers(0, model.config.vocab_size, (3, 9))
  ragged = np.asarray(model.with_options(moe_backend="ragged").logits(ids))
  dense = np.asarray(model.with_options(moe_backend="dense").logits(ids))
  gather = np.asarray(model.with_options(moe_backend="gather").logits(ids))
  loop = np.asarray(model.with_options(moe_backend="loop").logits(ids))
  auto = np.asarray(model.logits(ids))
  np.testing.assert_allclose(ragged, dense, atol=1e-5)
  np.testing.assert_allclose(gather, dense, atol=1e-5)
  np.testing.assert_allclose(loop, dense, atol=1e-5)
  np.testing.assert_allclose(auto, dense, atol=1e-5)
  # The oracle must notice a routing mistake: ignoring the groups changes the logits.
  ungrouped = np.asarray(model.with_config(n_group=1, topk_group=1).logits(ids))
  assert np.abs(ungrouped - ragged).max() > 1e-3


@pytest.mark.parametrize(
  "name", ["qwen3_gqa_bias_headdim", "qwen3moe_norm_mlponly", "glm4moe_grouped_shared_partial"]
)
def test_greedy_decode_matches_transformers_generate(saved, name):
  hf_model, path = saved[name]
  model = jaxspec.load_model(path)
  prompt = np.random.default_rng(2).integers(0, model.config.vocab_size, (1, 6))
  with torch.no_grad():
    ref = hf_model.generate(
      torch.as_tensor(prompt),
      max_new_tokens=32,
      do_sample=False,
      min_new_tokens=32,
      pad_token_id=0,
      eos_token_id=None,
    )
  ref_new = ref[0, 6:].numpy()
  cfg = EngineConfig(max_len=64, batch_size=1, use_eos=False)
  res = SpecEngine(model, None, cfg).generate([prompt[0]], max_new_tokens=32, temperature=0.0)
  ours = np.asarray(res.tokens[0])
  near_ties.assert_greedy_match(model, prompt, [ref_new.tolist()], [ours.tolist()])


def test_block_by_block_equals_full_forward(saved):
  _, path = saved["glm4moe_grouped_shared_partial"]
  model = jaxspec.load_model(path)
  b, t = 2, 13
  ids = np.random.default_rng(3).integers(0, model.config.vocab_size, (b, t))
  full = np.asarray(model.logits(ids))
  blocks = engine_models.blockwise_logits(model, ids, (4, 1, 3, 1, 4))
  near_ties.assert_logits_match(model, ids, blocks, full, atol=1e-4)


def test_per_sequence_start_positions(saved):
  """Two sequences at different offsets in one batch equal each run alone."""
  _, path = saved["qwen3moe_norm_mlponly"]
  model = jaxspec.load_model(path)
  rng = np.random.default_rng(4)
  a = rng.integers(0, model.config.vocab_size, (1, 9))
  c = rng.integers(0, model.config.vocab_size, (1, 5))
  ref_a, ref_c = np.asarray(model.logits(a)), np.asarray(model.logits(c))
  # Prefill a[:6] and c[:2] padded into one batch, then a 3-token block at starts (6, 2).
  prompts = np.zeros((2, 6), np.int32)
  prompts[0], prompts[1, :2] = a[0, :6], c[0, :2]
  state = model.init_state(2, 16)
  _, state, _, _ = step_lib.prefill_prompts(
    model.config, model.params, jnp.asarray(prompts), jnp.array([6, 2], jnp.int32), state
  )
  block = np.stack([a[0, 6:9], c[0, 2:5]])
  start = jnp.copy(state.lengths)  # not an alias of the donated state
  out = target_lib.forward(model.config, model.params, jnp.asarray(block), start, state)
  logits = np.asarray(out.logits)
  near_ties.assert_logits_match(model, a, logits[:1], ref_a[:, 6:9], 1e-4, slice(6, 9))
  near_ties.assert_logits_match(model, c, logits[1:], ref_c[:, 2:5], 1e-4, slice(2, 5))


def test_taps_are_hf_hidden_states(saved):
  hf_model, path = saved["glm4moe_grouped_shared_partial"]
  model = jaxspec.load_model(path)
  ids = np.random.default_rng(5).integers(0, model.config.vocab_size, (1, 7))
  with torch.no_grad():
    hs = hf_model(torch.as_tensor(ids), output_hidden_states=True).hidden_states
  taps = (0, 1)  # inner layers; HF replaces its last entry by the final-normed state
  out = target_lib.forward(model.config, model.params, jnp.asarray(ids, jnp.int32), taps=taps)
  for j, layer in enumerate(taps):
    near_ties.assert_logits_match(model, ids, out.taps[j], hs[layer + 1].numpy(), atol=1e-4)
  near_ties.assert_logits_match(model, ids, out.hidden, hs[-1].numpy(), atol=1e-4)


def test_block_mask_restricts_attention(saved):
  """A token whose mask hides its predecessor in the block equals a forward without it."""
  _, path = saved["qwen3_gqa_bias_headdim"]
  model = jaxspec.load_model(path)
  ids = np.random.default_rng(6).integers(0, model.config.vocab_size, (1, 6))
  # Block = tokens 3,4,5 after a prefix of 3. Token 5 sees 3 but not 4, at position 4.
  mask = np.array([[1, 0, 0], [1, 1, 0], [1, 0, 1]], bool)
  positions = np.array([[3, 4, 4]], np.int32)
  out = target_lib.forward(
    model.config,
    model.params,
    jnp.asarray(ids[:, :3], jnp.int32),
    jnp.zeros((1,), jnp.int32),
    model.init_state(1, 8),
  )
  out = target_lib.forward(
    model.config,
    model.params,
    jnp.asarray(ids[:, 3:6], jnp.int32),
    jnp.full((1,), 3, jnp.int32),
    out.state.commit(jnp.full((1,), 3, jnp.int32)),
    positions=jnp.asarray(positions),
    block_mask=jnp.asarray(mask),
  )
  path_ids = np.concatenate([ids[:, :4], ids[:, 5:6]], axis=1)
  ref = np.asarray(model.logits(path_ids))
  np.testing.assert_allclose(np.asarray(out.logits[0, 2]), ref[0, 4], atol=1e-4)
  np.testing.assert_allclose(
    np.asarray(out.logits[0, 1]), np.asarray(model.logits(ids[:, :5]))[0, 4], atol=1e-4
  )


def test_state_commit_path_moves_entries():
  k = np.arange(2 * 2 * 8 * 1 * 2, dtype=np.float32).reshape(2, 2, 8, 1, 2)
  # Two one-layer segments: the path is moved in every segment.
  segments = tuple(FloatKV(jnp.asarray(k[i : i + 1]), jnp.asarray(-k[i : i + 1])) for i in (0, 1))
  state = DecodingState(segments=segments, lengths=jnp.array([2, 3], jnp.int32))
  moved = state.commit_path(jnp.array([[0, 2, 3], [0, 1, 3]]))
  mk = np.concatenate([np.asarray(s.k) for s in moved.segments], axis=0)
  mv = np.concatenate([np.asarray(s.v) for s in moved.segments], axis=0)
  np.testing.assert_array_equal(mk[:, 0, 2:5], k[:, 0, [2, 4, 5]])
  np.testing.assert_array_equal(mk[:, 1, 3:6], k[:, 1, [3, 4, 6]])
  np.testing.assert_array_equal(mk[:, :, :2], k[:, :, :2])  # prefix untouched
  np.testing.assert_array_equal(mv, -mk)
  assert np.asarray(moved.lengths).tolist() == [2, 3]  # commit_path leaves lengths alone
  assert np.asarray(moved.commit(jnp.array([3, 3])).lengths).tolist() == [5, 6]
