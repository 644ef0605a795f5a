"""Verify-block cost of tree vs chain verification on a hybrid (Gated DeltaNet) target.

Two measurements, the minimum over repeats (CPUs here are shared):
  1. One verify step of a small hybrid target (tests/test_hybrid_tree.py's shapes:
     3 Gated DeltaNet layers + 1 full-attention layer, batch 1): the target forward over the
     block plus the commit (chain: 16 tokens, causal; tree: budget 16 / 22, i.e. 17 / 23 nodes
     under a random ancestor mask, then `commit_path`).
  2. The delta rule alone at a production layer's size (16 value heads, Dk = Dv = 128):
     `recurrent` over 16 tokens vs `tree_recurrent` over 17 / 23 nodes.
Usage: python launch/bench.py hybrid-tree
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from typing import Sequence

import numpy as np

from jaxspec.io.architectures import config_from_hf
from jaxspec.models import gated_deltanet as gdn
from jaxspec.models import target as target_lib
from jaxspec.profiling import roofline
from jaxspec.state import DecodingState
from launch.benchmarks import gdn as gdn_bench

# tests/test_hybrid_tree.py's small hybrid: 3 Gated DeltaNet layers + 1 full-attention layer.
HYBRID = dict(
  architectures=["Qwen3_5ForCausalLM"],
  hidden_size=32,
  intermediate_size=48,
  num_hidden_layers=4,
  num_attention_heads=4,
  num_key_value_heads=2,
  head_dim=8,
  tie_word_embeddings=True,
  linear_conv_kernel_dim=4,
  linear_key_head_dim=8,
  linear_value_head_dim=6,
  linear_num_key_heads=2,
  linear_num_value_heads=4,
)


def define_flags() -> None:
  """This benchmark has no flags of its own."""


def _random_mask(rng, t: int) -> np.ndarray:
  parents = [-1] + [int(rng.integers(0, i)) for i in range(1, t)]
  mask = np.eye(t, dtype=bool)
  for i in range(t):
    j = parents[i]
    while j >= 0:
      mask[i, j], j = True, parents[j]
  return mask


def main(argv: Sequence[str]) -> None:
  del argv
  config = config_from_hf({**HYBRID, "vocab_size": 64}).with_options(linear_snapshots=32)
  params = roofline.random_params(config, 0, 0.08)  # the tests' scale: 4 × 0.02
  rng = np.random.default_rng(0)
  prompt = jnp.asarray(rng.integers(0, 64, (1, 12)), jnp.int32)
  state = DecodingState.create(config, 1, 64)
  state = target_lib.apply_decoder(config, params, prompt, None, state).state
  state = state.with_lengths(jnp.array([12], jnp.int32))
  start = jnp.array([12], jnp.int32)

  @jax.jit
  def chain_step(params, state, block):
    out = target_lib.apply_decoder(config, params, block, start, state)
    return out.logits, out.state.with_lengths(start + 5)

  @jax.jit
  def tree_step(params, state, block, mask, depths, path):
    out = target_lib.apply_decoder(
      config, params, block, start, state, positions=start[:, None] + depths, block_mask=mask
    )
    return out.logits, out.state.commit_path(path).with_lengths(start + path.shape[1])

  block = lambda t: jnp.asarray(rng.integers(0, 64, (1, t)), jnp.int32)
  chain = gdn_bench.min_ms(chain_step, (params, state, block(16)), {}, 20)
  print(f"target step, chain 16 tokens: {chain:7.2f} ms")
  for budget in (16, 22):
    t = budget + 1
    mask = _random_mask(rng, t)
    depths = jnp.asarray(mask.sum(-1)[None] - 1, jnp.int32)
    path = jnp.zeros((1, 5), jnp.int32)
    args = (params, state, block(t), jnp.asarray(mask[None]), depths, path)
    ms = gdn_bench.min_ms(tree_step, args, {}, 20)
    print(f"target step, tree budget {budget}: {ms:7.2f} ms  ({ms / chain:.2f}× chain)")

  b, h, dk, dv = 1, 16, 128, 128

  def inputs(t):
    q = gdn.l2norm(jnp.asarray(rng.normal(size=(b, t, h, dk)), jnp.float32)) * dk**-0.5
    k = gdn.l2norm(jnp.asarray(rng.normal(size=(b, t, h, dk)), jnp.float32))
    v = jnp.asarray(rng.normal(size=(b, t, h, dv)), jnp.float32)
    g = -jnp.asarray(rng.uniform(0.01, 1.0, size=(b, t, h)), jnp.float32)
    beta = jax.nn.sigmoid(jnp.asarray(rng.normal(size=(b, t, h)), jnp.float32))
    return q, k, v, g, beta, jnp.zeros((b, h, dk, dv), jnp.float32)

  rec = gdn_bench.min_ms(jax.jit(gdn.recurrent), inputs(16), {}, 15)
  print(f"delta rule, recurrent 16 tokens: {rec:7.2f} ms")
  for budget in (16, 22):
    t = budget + 1
    parents, _ = gdn.tree_structure(jnp.asarray(_random_mask(rng, t)[None]))
    q, k, v, g, beta, s0 = inputs(t)
    ms = gdn_bench.min_ms(jax.jit(gdn.tree_recurrent), (q, k, v, g, beta, parents, s0), {}, 15)
    print(f"delta rule, tree_recurrent budget {budget}: {ms:7.2f} ms  ({ms / rec:.2f}× chain)")

