"""The Q4_0 KV cache (jaxspec/state/kv.py, issue 16 part 1): llama.cpp's format bit for bit,
attention over it equal to attention over its dequantized values, and lossless speculation on
it."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxspec
from jaxspec import plan
from jaxspec.config import ModelConfig
from jaxspec.drafters import registry
from jaxspec.models import attention as attention_lib
from jaxspec.quant.codecs import q4_0_dequantize, q4_0_quantize
from jaxspec.state import DecodingState, FloatKV, Q4KV

QK = 32


def llama_quantize_row_q4_0(
  x: np.ndarray, *, unsigned_scale: bool = False
) -> tuple[np.ndarray, np.ndarray]:
  """A numpy transcription of ggml's `quantize_row_q4_0_ref` (ggml-quants.c), float32 math.

  `unsigned_scale` (d = |max| / 8, a symmetric-quantizer habit, instead of the signed max / −8)
  is the broken variant the test must tell apart.
  """
  x = np.asarray(x, np.float32).reshape(-1, QK)
  qs = np.zeros((x.shape[0], QK // 2), np.uint8)
  ds = np.zeros((x.shape[0],), np.float16)
  for i, block in enumerate(x):
    amax, vmax = np.float32(0), np.float32(0)
    for v in block:
      if amax < abs(v):
        amax, vmax = np.float32(abs(v)), v
    d = np.float32(amax / np.float32(8)) if unsigned_scale else np.float32(vmax / np.float32(-8))
    ds[i] = np.float16(d)
    inv = np.float32(1) / d if d else np.float32(0)
    for j in range(QK // 2):
      x0 = np.float32(block[j] * inv)
      x1 = np.float32(block[QK // 2 + j] * inv)
      # (int8_t) truncates toward zero.
      q0, q1 = int(np.float32(x0 + np.float32(8.5))), int(np.float32(x1 + np.float32(8.5)))
      qs[i, j] = min(15, q0) | (min(15, q1) << 4)
  return qs, ds


def llama_dequantize_row_q4_0(qs: np.ndarray, ds: np.ndarray) -> np.ndarray:
  """ggml's `dequantize_row_q4_0`."""
  out = np.zeros((qs.shape[0], QK), np.float32)
  for i in range(qs.shape[0]):
    d = np.float32(ds[i])
    for j in range(QK // 2):
      out[i, j] = np.float32((int(qs[i, j]) & 0x0F) - 8) * d
      out[i, j + QK // 2] = np.float32((int(qs[i, j]) >> 4) - 8) * d
  return out.reshape(-1)


def _rows(seed: int = 0) -> np.ndarray:
  rng = np.random.default_rng(seed)
  x = (rng.normal(size=(24, 2 * QK)) * rng.uniform(0.01, 20, size=(24, 1))).astype(np.float32)
  x[3] = 0.0  # an all-zero block: d = 0, every q = 8
  x[4, :QK] = 1.0  # ties: the first maximum wins
  x[5, 7] = -30.0  # a negative maximum: d > 0
  x[6, 40] = np.float32(1e-30)  # tiny values
  return x


def test_quantize_and_dequantize_equal_llama_cpp_bit_for_bit():
  x = _rows()
  packed, d = q4_0_quantize(jnp.asarray(x))
  assert packed.dtype == jnp.uint8 and packed.shape == (24, QK)
  assert d.dtype == jnp.float16 and d.shape == (24, 2)
  want_q, want_d = llama_quantize_row_q4_0(x)
  np.testing.assert_array_equal(np.asarray(packed).reshape(-1, QK // 2), want_q)
  np.testing.assert_array_equal(np.asarray(d).reshape(-1).view(np.uint16), want_d.view(np.uint16))
  back = np.asarray(q4_0_dequantize(packed, d))
  np.testing.assert_array_equal(back.reshape(-1), llama_dequantize_row_q4_0(want_q, want_d))
  # The comparison can fail: a quantizer with an unsigned scale stores other nibbles.
  broken_q, _ = llama_quantize_row_q4_0(x, unsigned_scale=True)
  assert not np.array_equal(broken_q, want_q)


def test_error_is_bounded_by_half_a_step():
  x = _rows(1)
  packed, d = q4_0_quantize(jnp.asarray(x))
  back = np.asarray(q4_0_dequantize(packed, d)).reshape(-1, QK)
  step = np.abs(np.asarray(d, np.float32)).reshape(-1, 1)
  err = np.abs(back - x.reshape(-1, QK))
  # Half a quantization step, plus the clamp at q = 15 (the far end of a block: one step),
  # plus the fp16 rounding of d (≤ 8 · 2^-11 · |d|).
  assert np.all(err <= step * (1.0 + 8 * 2.0**-11) + 1e-30)


def _config(**kw) -> ModelConfig:
  base = dict(
    architecture="Qwen3ForCausalLM",
    vocab_size=32,
    hidden_size=64,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=QK,
    intermediate_size=64,
  )
  return ModelConfig(**{**base, **kw})


def test_bytes_are_exactly_4_5_of_32_of_float32():
  cfg = _config()
  kv = {
    fmt: plan.tree_bytes(
      jax.eval_shape(lambda f=fmt: DecodingState.create(cfg, 2, 256, f).segments)
    )
    for fmt in ("q4_0", "float")
  }
  assert kv["q4_0"] * 32 == kv["float"] * 4.5
  lengths = 2 * 4  # the committed lengths, int32 per sequence
  assert plan.decoding_state_bytes(cfg, 2, 256, "q4_0") == kv["q4_0"] + lengths
  with pytest.raises(jaxspec.ConfigError, match="head_dim to be a multiple of 32"):
    DecodingState.create(_config(head_dim=16, num_heads=8), 1, 8, "q4_0")


@pytest.mark.parametrize("t, masked", [(1, False), (5, False), (5, True)])
def test_attention_over_q4_equals_attention_over_its_dequantized_values(t, masked):
  rng = np.random.default_rng(2)
  k0 = jnp.asarray(rng.normal(size=(2, 3, 24, 2, QK)), jnp.float32)
  v0 = jnp.asarray(rng.normal(size=(2, 3, 24, 2, QK)), jnp.float32)
  kv = Q4KV.quantized(k0, v0)
  assert kv.k.shape == (2, 3, 24, 2, QK // 2)
  q = jnp.asarray(rng.normal(size=(3, t, 4, QK)), jnp.float32)
  k = jnp.asarray(rng.normal(size=(3, t, 2, QK)), jnp.float32)
  v = jnp.asarray(rng.normal(size=(3, t, 2, QK)), jnp.float32)
  start = jnp.asarray([4, 9, 17], jnp.int32)
  mask = jnp.tril(jnp.ones((t, t), bool)).at[-1, 0].set(False) if masked else None
  scale = QK**-0.5
  out, written = attention_lib.attention(q, k, v, kv, jnp.int32(1), start, mask, scale, "xla", 4)
  assert isinstance(written, Q4KV)
  _, k_rt, v_rt = kv.write(jnp.int32(1), start, k, v)
  via_float, _ = attention_lib.attention(
    q, k_rt, v_rt, written.dequantized(), jnp.int32(1), start, mask, scale, "xla", 4
  )
  np.testing.assert_allclose(np.asarray(out), np.asarray(via_float), atol=1e-5)
  # Reading the nibbles without their scales (a broken dequantization) is noticed.
  unscaled = FloatKV(
    q4_0_dequantize(written.k, jnp.ones_like(written.k_scale)),
    q4_0_dequantize(written.v, jnp.ones_like(written.v_scale)),
  )
  wrong, _ = attention_lib.attention(
    q, k_rt, v_rt, unscaled, jnp.int32(1), start, mask, scale, "xla", 4
  )
  assert np.abs(np.asarray(wrong) - np.asarray(out)).max() > 1e-2


def test_commit_path_moves_nibbles_and_scales():
  rng = np.random.default_rng(4)
  kv = Q4KV.quantized(
    jnp.asarray(rng.normal(size=(1, 2, 16, 2, QK)), jnp.float32),
    jnp.asarray(rng.normal(size=(1, 2, 16, 2, QK)), jnp.float32),
  )
  state = DecodingState(segments=(kv,), lengths=jnp.asarray([2, 5]))
  path = jnp.asarray([[0, 2, 3], [0, 3, 1]])
  moved = state.commit_path(path).segments[0]
  for field in ("k", "v", "k_scale", "v_scale"):
    x, y = np.asarray(getattr(kv, field)), np.asarray(getattr(moved, field))
    for b, n in enumerate([2, 5]):
      np.testing.assert_array_equal(y[:, b, n : n + 3], x[:, b, n + np.asarray(path[b])])


@functools.lru_cache(maxsize=None)
def _bundled():
  target = jaxspec.load_model(registry.bundled_dir("target"), scan_layers=False)
  return target, registry.make_drafter("eagle3", target, draft_dir=registry.bundled_dir("eagle3"))


# Tree commits over quantized caches are checked at the state level in every format
# (tests/test_sliding_kv.py, tests/test_paged_kv.py); the engine's tree run here is slow-marked.
@pytest.mark.parametrize("verify", ["chain", pytest.param("tree", marks=pytest.mark.slow)])
def test_greedy_speculation_on_a_q4_cache_equals_plain_decoding_on_it(verify):
  from tests import near_ties  # pylint: disable=import-outside-toplevel

  target, drafter = _bundled()
  assert target.config.head_dim % QK == 0
  prompts = ["def fib(n):", "import os\nimport sys\n"]
  tree = dict(verify="tree", tree_budget=8) if verify == "tree" else {}
  cfg = jaxspec.EngineConfig(max_len=96, batch_size=2, use_eos=False, kv_format="q4_0")
  plain = jaxspec.SpecEngine(target, None, cfg).generate(prompts, max_new_tokens=32)
  spec_engine = jaxspec.SpecEngine(
    target, drafter, jaxspec.EngineConfig(**{**cfg.__dict__, **tree})
  )
  spec = spec_engine.generate(prompts, max_new_tokens=32)
  assert isinstance(spec_engine.init_state(prompts, 8).target_state.segments[0], Q4KV)
  ids = [target.tokenizer.encode(p) for p in prompts]
  near_ties.assert_greedy_match(target, ids, plain.tokens, spec.tokens)
  assert spec.stats.acceptance_length > 1.5  # speculation really ran
  # The Q4_0 cache is really used: plain decoding on it differs from plain decoding on floats
  # somewhere in the logits (not necessarily in the greedy tokens).
  state = {fmt: target.init_state(1, 32, fmt) for fmt in ("float", "q4_0")}
  from jaxspec.models import target as target_lib  # pylint: disable=import-outside-toplevel

  x = jnp.asarray([ids[0]], jnp.int32)
  logits = {}
  for fmt, st in state.items():
    pre = target_lib.forward(target.config, target.params, x, jnp.zeros((1,), jnp.int32), st)
    step = target_lib.forward(
      target.config, target.params, x[:, :1], jnp.full((1,), x.shape[1], jnp.int32), pre.state
    )
    logits[fmt] = np.asarray(step.logits)
  assert np.abs(logits["q4_0"] - logits["float"]).max() > 1e-4


def test_memory_report_per_token_and_per_context():
  cfg = _config()  # float32, 2 layers, 2 KV heads × 32
  assert plan.kv_bytes_per_token(cfg, "float") == 2 * 2 * 2 * QK * 4  # layers · K,V · heads · D
  assert plan.kv_bytes_per_token(cfg, "q4_0") * 32 == plan.kv_bytes_per_token(cfg, "float") * 4.5
  rows = plan.kv_table(cfg, contexts=(1024,))
  assert rows[0].split() == ["kv", "bytes/token", "1K"]
  assert [r.split()[0] for r in rows[1:]] == ["float", "fp8", "q4_0"]
  assert rows[1].split()[1] == "1,024" and rows[1].split()[2:] == ["1.0", "MiB"]
  odd = plan.kv_table(_config(head_dim=16, num_heads=8))
  assert "multiple of 32" in odd[-1]
