"""Attention over the decoding state: chunked XLA path and Pallas kernel against dense attention,
and the FP8 KV cache (jaxspec/models/attention.py, jaxspec/state/kv.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.config import ModelConfig
from jaxspec.models import attention as attention_lib
from jaxspec.quant.codecs import FP8_MAX, fp8_dequantize, fp8_quantize, fp8_values
from jaxspec.state import DecodingState, FloatKV, FP8KV

B, H, KV, D, S, L = 4, 4, 2, 8, 24, 2
CHUNK = 4
SCALE = D**-0.5


def _config() -> ModelConfig:
  return ModelConfig(
    architecture="Qwen3ForCausalLM",
    vocab_size=16,
    hidden_size=16,
    num_layers=L,
    num_heads=H,
    num_kv_heads=KV,
    head_dim=D,
    intermediate_size=16,
  )


def dense_attention(q, k, v, start, block_mask):
  """The pre-chunking definition: a [B, T, S] visibility mask over the whole layer cache."""
  b, t = q.shape[:2]
  slot = np.arange(k.shape[1])[None, None, :]
  rel = slot - np.asarray(start)[:, None, None]
  if block_mask is None:
    inside = rel <= np.arange(t)[None, :, None]
  else:
    mask = np.broadcast_to(np.asarray(block_mask, bool), (b, t, t))
    inside = np.take_along_axis(mask, np.clip(rel, 0, t - 1).repeat(t, axis=1), axis=2)
  visible = (rel < 0) | ((rel >= 0) & (rel < t) & inside)
  qg = np.asarray(q, np.float64).reshape(b, t, KV, H // KV, D)
  scores = np.einsum("btkgd,bskd->bkgts", qg, np.asarray(k, np.float64)) * SCALE
  scores = np.where(visible[:, None, None], scores, -np.inf)
  probs = np.exp(scores - scores.max(-1, keepdims=True))
  probs /= probs.sum(-1, keepdims=True)
  out = np.einsum("bkgts,bskd->btkgd", probs, np.asarray(v, np.float64))
  return out.reshape(b, t, H, D)


def _random_state(kind: str, seed: int = 0):
  rng = np.random.default_rng(seed)
  k = rng.normal(size=(L, B, S, KV, D)).astype(np.float32)
  v = rng.normal(size=(L, B, S, KV, D)).astype(np.float32)
  if kind == "float":
    return FloatKV(jnp.asarray(k), jnp.asarray(v))
  return FP8KV.quantized(jnp.asarray(k), jnp.asarray(v))


def _block(t: int, seed: int = 1):
  rng = np.random.default_rng(seed)
  q = jnp.asarray(rng.normal(size=(B, t, H, D)), jnp.float32)
  k = jnp.asarray(rng.normal(size=(B, t, KV, D)), jnp.float32)
  v = jnp.asarray(rng.normal(size=(B, t, KV, D)), jnp.float32)
  return q, k, v


def _tree_mask(t: int, seed: int = 2) -> np.ndarray:
  """A random ancestor mask per row: node i's parent is a random earlier node."""
  rng = np.random.default_rng(seed)
  masks = np.zeros((B, t, t), bool)
  for b in range(B):
    for i in range(t):
      masks[b, i, i] = True
      if i:
        masks[b, i] |= masks[b, rng.integers(0, i)]
  return masks


# Starts around chunk borders (CHUNK = 4), and one block that ends at the cache's last slot.
STARTS = {1: [3, 4, 5, 23], 5: [0, 4, 9, 19], 8: [7, 8, 12, 16]}
CASES = [
  ("decode", 1, None),
  ("chain", 5, None),
  ("tree", 8, "tree"),
  ("tree_2d", 5, "causal_2d"),
]


def _mask(kind, t):
  if kind == "tree":
    return jnp.asarray(_tree_mask(t))
  if kind == "causal_2d":
    return jnp.tril(jnp.ones((t, t), bool))
  return None


@pytest.mark.parametrize("layer", [0, L - 1])
@pytest.mark.parametrize("name, t, mask_kind", CASES)
def test_chunked_xla_attention_equals_dense(name, t, mask_kind, layer):
  del name
  kv = _random_state("float")
  q, k, v = _block(t)
  start = jnp.asarray(STARTS[t], jnp.int32)
  mask = _mask(mask_kind, t)
  out, written = attention_lib.attention(
    q, k, v, kv, jnp.int32(layer), start, mask, SCALE, "xla", CHUNK
  )
  want = dense_attention(q, written.k[layer], written.v[layer], start, mask)
  np.testing.assert_allclose(np.asarray(out), want, atol=1e-5)
  # The block landed at its slots and nothing else moved.
  rows = np.arange(B)[:, None]
  slots = np.asarray(start)[:, None] + np.arange(t)
  np.testing.assert_array_equal(np.asarray(written.k[layer])[rows, slots], np.asarray(k))
  untouched = np.ones((B, S), bool)
  untouched[rows, slots] = False
  np.testing.assert_array_equal(
    np.asarray(written.k[layer])[untouched], np.asarray(kv.k[layer])[untouched]
  )


def test_prefill_without_a_prefix_and_without_a_state():
  """start = 0 reads no prefix chunk; state=None (training) attends within the block."""
  t = 16
  q, k, v = _block(t)
  zero = jnp.zeros((B,), jnp.int32)
  kv = FloatKV.create(_config(), L, B, S)
  with_state, _ = attention_lib.attention(q, k, v, kv, jnp.int32(1), zero, None, SCALE, "xla", 4)
  without, none = attention_lib.attention(q, k, v, None, jnp.int32(0), zero, None, SCALE)
  assert none is None
  want = dense_attention(q, k, v, zero, None)
  np.testing.assert_allclose(np.asarray(with_state), want, atol=1e-5)
  np.testing.assert_allclose(np.asarray(without), want, atol=1e-5)


def test_chunking_reads_only_the_live_prefix():
  """Garbage past the longest live prefix (and in other rows' scratch) changes nothing."""
  kv = _random_state("float")
  q, k, v = _block(1)
  start = jnp.asarray([3, 6, 2, 9], jnp.int32)
  out, _ = attention_lib.attention(q, k, v, kv, jnp.int32(0), start, None, SCALE, "xla", CHUNK)
  poisoned = FloatKV(kv.k.at[:, :, 10:].set(1e4), kv.v.at[:, :, 10:].set(-1e4))
  out2, _ = attention_lib.attention(
    q, k, v, poisoned, jnp.int32(0), start, None, SCALE, "xla", CHUNK
  )
  np.testing.assert_array_equal(np.asarray(out), np.asarray(out2))
  # ... while a poisoned committed slot does change it (the test can fail).
  bad = FloatKV(kv.k.at[0, 3, 8].set(50.0), kv.v)
  out3, _ = attention_lib.attention(q, k, v, bad, jnp.int32(0), start, None, SCALE, "xla", CHUNK)
  assert np.abs(np.asarray(out3)[3] - np.asarray(out)[3]).max() > 1e-3


@pytest.mark.parametrize("kind", ["float", "fp8"])
@pytest.mark.parametrize("name, t, mask_kind", CASES[:3])
def test_pallas_kernel_equals_chunked_xla(name, t, mask_kind, kind):
  """The Pallas tree-attention kernel (interpret mode on CPU) on the model's code path."""
  del name
  kv = _random_state(kind)
  q, k, v = _block(t)
  start = jnp.asarray(STARTS[t], jnp.int32)
  mask = _mask(mask_kind, t)
  xla, _ = attention_lib.attention(q, k, v, kv, jnp.int32(1), start, mask, SCALE, "xla", CHUNK)
  pallas, _ = attention_lib.attention(q, k, v, kv, jnp.int32(1), start, mask, SCALE, "pallas")
  np.testing.assert_allclose(np.asarray(pallas), np.asarray(xla), atol=2e-5)


# --------------------------------------------------------------------------------------------------
# FP8 KV
# --------------------------------------------------------------------------------------------------


def test_fp8_quantization_error_and_scales():
  x = jnp.asarray(np.random.default_rng(3).normal(size=(64, 2, D)) * 5, jnp.float32)
  q, scale = fp8_quantize(x)
  assert q.dtype == jnp.float8_e4m3fn and scale.shape == (64, 2)
  back = np.asarray(fp8_dequantize(q, scale))
  amax = np.abs(np.asarray(x)).max(-1, keepdims=True)
  # E4M3 keeps 3 mantissa bits: relative error ≤ 2^-4 (plus subnormal steps near 0).
  assert np.all(np.abs(back - np.asarray(x)) <= np.abs(np.asarray(x)) / 16 + amax / FP8_MAX / 8)
  # The largest element of each vector maps to ±448 exactly.
  np.testing.assert_allclose(np.abs(np.asarray(q, np.float32)).max(-1), FP8_MAX)
  zero_q, zero_s = fp8_quantize(jnp.zeros((3, D)))
  assert np.all(np.asarray(zero_s) == 1.0) and np.all(np.asarray(zero_q, np.float32) == 0)


@pytest.mark.parametrize("name, t, mask_kind", CASES)
def test_fp8_attention_equals_attention_over_its_dequantized_values(name, t, mask_kind):
  del name
  kv = _random_state("fp8")
  q, k, v = _block(t)
  start = jnp.asarray(STARTS[t], jnp.int32)
  mask = _mask(mask_kind, t)
  out, written = attention_lib.attention(
    q, k, v, kv, jnp.int32(1), start, mask, SCALE, "xla", CHUNK
  )
  assert isinstance(written, FP8KV) and written.k.dtype == jnp.uint8
  deq = written.dequantized()
  want = dense_attention(q, deq.k[1], deq.v[1], start, mask)
  np.testing.assert_allclose(np.asarray(out), want, atol=1e-5)
  # The block attends to its own K/V rounded as stored: the same as over a float cache that
  # holds the dequantized values, block included.
  _, k_rt, v_rt = kv.write(jnp.int32(1), start, k, v)
  via_float, _ = attention_lib.attention(
    q, k_rt, v_rt, deq, jnp.int32(1), start, mask, SCALE, "xla", CHUNK
  )
  np.testing.assert_allclose(np.asarray(out), np.asarray(via_float), atol=1e-5)
  # Ignoring the scales (a broken dequantization) is noticed.
  unscaled = FloatKV(
    fp8_values(written.k).astype(jnp.float32), fp8_values(written.v).astype(jnp.float32)
  )
  wrong = dense_attention(q, unscaled.k[1], unscaled.v[1], start, mask)
  assert np.abs(wrong - want).max() > 1e-2


def test_fp8_commit_path_moves_values_and_scales():
  state = DecodingState(segments=(_random_state("fp8"),), lengths=jnp.asarray([2, 3, 0, 5]))
  path = jnp.asarray([[0, 2, 3], [0, 1, 3], [0, 3, 1], [0, 1, 2]])
  moved = state.commit_path(path)
  before, after = state.segments[0], moved.segments[0]
  for field in ("k", "v", "k_scale", "v_scale"):
    x, y = (
      np.asarray(getattr(before, field), np.float32),
      np.asarray(getattr(after, field), np.float32),
    )
    for b, n in enumerate([2, 3, 0, 5]):
      np.testing.assert_array_equal(y[:, b, n : n + 3], x[:, b, n + np.asarray(path[b])])
      np.testing.assert_array_equal(y[:, b, :n], x[:, b, :n])
  np.testing.assert_array_equal(np.asarray(moved.lengths), [2, 3, 0, 5])


def test_state_create_and_errors():
  cfg = _config().replace(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8)
  cfg = cfg.replace(layer_is_moe=(False, True))
  state = DecodingState.create(cfg, 2, 32, "fp8")
  assert len(state.segments) == 2 and state.kv_format == "fp8" and state.max_len == 32
  assert state.segments[0].k.shape == (1, 2, 32, KV, D)
  assert state.segments[1].k_scale.shape == (1, 2, 32, KV)
  with pytest.raises(ValueError, match="kv_format='q8'"):
    DecodingState.create(cfg, 2, 32, "q8")
  with pytest.raises(ValueError, match="attention_impl"):
    attention_lib.resolve_impl("cuda")
  assert attention_lib.resolve_impl("auto") == "xla"


def test_state_is_a_pytree_that_jit_donates():
  state = DecodingState.create(_config(), 2, 8, "fp8")
  f = jax.jit(lambda s: s.commit(jnp.asarray([1, 2])), donate_argnums=0)
  out = f(state)
  assert np.asarray(out.lengths).tolist() == [1, 2] and isinstance(out.segments[0], FP8KV)


# --------------------------------------------------------------------------------------------------
# FP8 KV in the engine
# --------------------------------------------------------------------------------------------------


# Tree commits over quantized caches are checked at the state level in every format
# (tests/test_sliding_kv.py, tests/test_paged_kv.py); the engine's tree run here is slow-marked.
@pytest.mark.parametrize("verify", ["chain", pytest.param("tree", marks=pytest.mark.slow)])
def test_greedy_speculation_on_an_fp8_cache_equals_plain_decoding_on_it(verify):
  # pylint: disable=import-outside-toplevel
  from jaxspec.drafters.draft_model import DraftModelDrafter
  from jaxspec.speculative.engine import SpecEngine
  from jaxspec.speculative.engine_config import EngineConfig
  from tests import engine_models, near_ties

  target, draft = engine_models.random_target(), engine_models.random_draft()
  prompts = [[5, 9, 3, 5, 9, 3], [7, 7, 8, 1]]
  cfg = EngineConfig(max_len=64, batch_size=2, use_eos=False, kv_format="fp8")
  plain = SpecEngine(target, None, cfg).generate(prompts, max_new_tokens=24)
  spec_cfg = cfg if verify == "chain" else cfg.__class__(**{**cfg.__dict__, "verify": "tree"})
  spec = SpecEngine(target, DraftModelDrafter.from_model(draft, gamma=3), spec_cfg)
  out = spec.generate(prompts, max_new_tokens=24)
  assert isinstance(spec.init_state(prompts, 24).target_state.segments[0], FP8KV)
  near_ties.assert_greedy_match(target, prompts, plain.tokens, out.tokens)
  # The FP8 cache is really used: a decode step over an FP8 prefix differs from one over a
  # float prefix, by quantization noise only.
  from jaxspec.models import target as target_lib  # pylint: disable=import-outside-toplevel

  ids = jnp.asarray([prompts[0]], jnp.int32)
  logits = {}
  for fmt in ("float", "fp8"):
    state = target.init_state(1, 16, fmt)
    pre = target_lib.forward(target.config, target.params, ids, jnp.zeros((1,), jnp.int32), state)
    step = target_lib.forward(
      target.config, target.params, ids[:, :1], jnp.full((1,), 6, jnp.int32), pre.state
    )
    logits[fmt] = np.asarray(step.logits)
  diff = np.abs(logits["fp8"] - logits["float"]).max()
  assert 1e-5 < diff < 0.1 * np.abs(logits["float"]).max(), diff


def test_bad_kv_format_is_named():
  from jaxspec.speculative.engine_config import EngineConfig  # pylint: disable=import-outside-toplevel

  with pytest.raises(ValueError, match="kv_format='int4'"):
    EngineConfig(kv_format="int4")
