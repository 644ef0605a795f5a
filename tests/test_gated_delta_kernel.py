"""The Pallas chunked gated-delta-rule kernel (pallas_kernels/gated_delta) against its jnp
oracles (`gated_deltanet.chunked` and the token-by-token `recurrent_reference`), and the hybrid
model with `linear_attention_impl="pallas"` against "xla".

No GPU was available for these tests: the kernel runs with interpret=True on CPU, and is also
lowered (not compiled) for CUDA, where it must become a Triton call.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.errors import ConfigError
from jaxspec.models import gated_deltanet as gdn
from pallas_kernels.gated_delta import reference
from jaxspec.models import target as target_lib
from jaxspec.io.architectures import config_from_hf
from jaxspec.options import RunOptions
from pallas_kernels.gated_delta import gated_delta_pallas, gated_delta_rule

TOL = {"atol": 1e-5, "rtol": 1e-5}


def _inputs(seed: int, b: int = 2, t: int = 21, h: int = 2, dk: int = 8, dv: int = 4):
  rng = np.random.default_rng(seed)
  q = gdn.l2norm(jnp.asarray(rng.normal(size=(b, t, h, dk)), jnp.float32)) * dk**-0.5
  k = gdn.l2norm(jnp.asarray(rng.normal(size=(b, t, h, dk)), jnp.float32))
  v = jnp.asarray(rng.normal(size=(b, t, h, dv)), jnp.float32)
  g = -jnp.asarray(rng.uniform(0.01, 1.5, size=(b, t, h)), jnp.float32)
  beta = jax.nn.sigmoid(jnp.asarray(rng.normal(size=(b, t, h)), jnp.float32))
  s0 = jnp.asarray(rng.normal(size=(b, h, dk, dv)), jnp.float32)
  return q, k, v, g, beta, s0


# One shape for every kernel test (21 tokens, chunks of 8: two borders and a padded last chunk;
# the value columns split over two programs), so the kernel and the oracles compile once.
CHUNK, BLOCK_V = 8, 2
recurrent_ref = jax.jit(reference.recurrent_reference)
chunked_ref = jax.jit(gdn.chunked, static_argnames="chunk_size")


def _kernel(*args):
  return gated_delta_pallas(*args, chunk_size=CHUNK, block_v=BLOCK_V, interpret=True)


def _close(got, want):
  for a, b in zip(got, want):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), **TOL)


def test_kernel_equals_references_across_chunks():
  """Across chunk borders with a nonzero initial state: equal to `chunked` and to the
  recurrence."""
  q, k, v, g, beta, s0 = _inputs(0)
  got = _kernel(q, k, v, g, beta, s0)
  _close(got, recurrent_ref(q, k, v, g, beta, s0))
  _close(got, chunked_ref(q, k, v, g, beta, s0, chunk_size=CHUNK))


def test_kernel_zero_state_and_padding_tokens():
  """No initial state; padding tokens (g = 0, β = 0) at the end leave the state as it was after
  the real tokens and do not change their outputs."""
  q, k, v, g, beta, _ = _inputs(1)
  real = 13
  pad = jnp.arange(21)[None, :, None] >= real
  g, beta = jnp.where(pad, 0.0, g), jnp.where(pad, 0.0, beta)
  out, s = _kernel(q, k, v, g, beta, None)
  ref_out, ref_s = recurrent_ref(*(x[:, :real] for x in (q, k, v, g, beta)))
  np.testing.assert_allclose(np.asarray(out[:, :real]), np.asarray(ref_out), **TOL)
  np.testing.assert_allclose(np.asarray(s), np.asarray(ref_s), **TOL)


def test_kernel_strong_decay_stays_finite():
  """Decays of e^-20 per token (in-chunk exp(Γ) underflows to 0): finite and exact."""
  q, k, v, g, beta, s0 = _inputs(3)
  g = g * 14.0 - 1.0
  out, s = _kernel(q, k, v, g, beta, s0)
  assert np.isfinite(np.asarray(out)).all()
  _close((out, s), recurrent_ref(q, k, v, g, beta, s0))


def test_dispatcher_and_errors():
  q, k, v, g, beta, s0 = _inputs(4)
  want = chunked_ref(q, k, v, g, beta, s0, chunk_size=CHUNK)
  args = (q, k, v, g, beta, s0, CHUNK)
  program = lambda f, *a: str(
    jax.make_jaxpr(f, static_argnums=tuple(range(6, 7 + len(a))))(*args, *a)
  )
  for impl in ("auto", "xla"):  # auto = xla: the program of `chunked` itself
    assert program(gated_delta_rule, impl) == program(gdn.chunked)
  got = gated_delta_rule(q, k, v, g, beta, s0, CHUNK, "pallas", interpret=True, block_v=BLOCK_V)
  _close(got, want)
  with pytest.raises(ValueError, match="impl="):
    gated_delta_rule(q, k, v, g, beta, s0, impl="cuda")
  with pytest.raises(ValueError, match="power of two"):  # Dk = 8 is too narrow for Triton
    gated_delta_pallas(q, k, v, g, beta, s0)
  with pytest.raises(ValueError, match="block_v"):
    gated_delta_pallas(q, k, v, g, beta, s0, block_v=3, interpret=True)
  with pytest.raises(ConfigError, match="linear_attention_impl"):
    config_from_hf(HYBRID, options=RunOptions(linear_attention_impl="cuda"))


def test_kernel_lowers_to_triton():
  """Qwen3-Next's linear-layer shapes (Dk = Dv = 128), bf16 q/k/v: lowered for CUDA (no
  compile, no GPU here), the pallas_call becomes a Triton call."""
  b, t, h, d = 1, 100, 2, 128
  arg = lambda *shape, dt=jnp.bfloat16: jax.ShapeDtypeStruct(shape, dt)
  args = (arg(b, t, h, d), arg(b, t, h, d), arg(b, t, h, d))
  args += (arg(b, t, h, dt=jnp.float32), arg(b, t, h, dt=jnp.float32))
  args += (arg(b, h, d, d, dt=jnp.float32),)
  fn = jax.jit(lambda *a: gated_delta_pallas(*a, chunk_size=64, block_v=64))
  text = fn.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  assert "xla.gpu.triton" in text


HYBRID = {
  "architectures": ["Qwen3_5ForCausalLM"],
  "vocab_size": 48,
  "hidden_size": 16,
  "intermediate_size": 24,
  "num_hidden_layers": 2,
  "layer_types": ["linear_attention", "full_attention"],
  "num_attention_heads": 2,
  "num_key_value_heads": 1,
  "head_dim": 8,
  "tie_word_embeddings": True,
  "linear_conv_kernel_dim": 3,
  "linear_key_head_dim": 8,
  "linear_value_head_dim": 4,
  "linear_num_key_heads": 1,
  "linear_num_value_heads": 2,
}


@pytest.fixture(scope="module")
def hybrid_models():
  config = config_from_hf(HYBRID, options=RunOptions(linear_chunk=4))
  xla = target_lib.TargetModel.random(config.with_options(linear_attention_impl="xla"), seed=0)
  return xla, xla.with_options(linear_attention_impl="pallas")


@pytest.mark.slow  # ~15 s: model init and two model compiles; the layer test below is cheap
def test_hybrid_logits_pallas_equals_xla(hybrid_models):
  """A tiny Qwen3.5 (linear + full layer): full-forward logits, 11 tokens in chunks of 4."""
  xla, pallas = hybrid_models
  ids = np.random.default_rng(0).integers(0, xla.config.vocab_size, (2, 11))
  np.testing.assert_allclose(np.asarray(pallas.logits(ids)), np.asarray(xla.logits(ids)), **TOL)


@pytest.mark.slow  # ~10 s: two more model compiles
def test_hybrid_prefill_state_pallas_equals_xla(hybrid_models):
  """A prefill through the decoding state: logits and every state leaf (the linear layer's
  conv window and recurrent state) agree between the two impls."""
  ids = np.random.default_rng(1).integers(0, hybrid_models[0].config.vocab_size, (2, 11))
  outs = [
    target_lib.forward(
      m.config, m.params, jnp.asarray(ids), jnp.zeros(2, jnp.int32), m.init_state(2, 16)
    )
    for m in hybrid_models
  ]
  np.testing.assert_allclose(np.asarray(outs[1].logits), np.asarray(outs[0].logits), **TOL)
  leaves = [jax.tree_util.tree_leaves(o.state) for o in outs]
  assert len(leaves[0]) == len(leaves[1]) > 0
  for a, b in zip(*leaves):
    np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), **TOL)


def test_layer_pallas_equals_xla():
  """The GatedDeltaNet layer's prefill path (11 tokens in chunks of 4, the second sequence only
  7 valid tokens long) under both impls: the same output, and "pallas" really runs the kernel.
  A_log is lowered from its init range (decays of e^-1..e^-20 per token, under which the
  in-chunk solve barely matters) to e^-0.05..e^-0.3, so a wrong solve shows."""
  config = config_from_hf(HYBRID, options=RunOptions(linear_chunk=4))
  x = jnp.asarray(np.random.default_rng(2).normal(size=(2, 11, config.hidden_size)), jnp.float32)
  args = (x, None, jnp.int32(0), jnp.zeros(2, jnp.int32), jnp.array([11, 7]))
  layer = lambda impl: gdn.GatedDeltaNet(config.with_options(linear_attention_impl=impl))
  params = jax.jit(layer("xla").init)(jax.random.PRNGKey(0), *args)
  a_log = params["params"]["A_log"]
  params["params"]["A_log"] = a_log.replace_boxed(jnp.log(jnp.array([0.05, 0.2], jnp.float32)))
  got, _ = jax.jit(layer("pallas").apply)(params, *args)
  want, _ = jax.jit(layer("xla").apply)(params, *args)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), **TOL)
  jaxpr = lambda impl: str(jax.make_jaxpr(layer(impl).apply)(params, *args))
  assert "pallas_call" in jaxpr("pallas") and "pallas_call" not in jaxpr("auto")
