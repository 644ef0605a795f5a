"""Models for engine tests: small random targets/drafters and exact bigram models.

A bigram model is a real one-layer Qwen3 whose attention and MLP output zero, whose embedding
is the identity and whose LM head holds log P(next | prev): it runs through the same decoder,
cache and engine code as any model, yet its distribution over whole sequences is known exactly.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax.numpy as jnp
import numpy as np

from jaxspec.config import ModelConfig
from jaxspec.models import target as target_lib
from jaxspec.models.target import TargetModel


def random_target(vocab: int = 96, seed: int = 0) -> TargetModel:
  cfg = ModelConfig(
    architecture="Glm4MoeForCausalLM",
    vocab_size=vocab,
    hidden_size=32,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    intermediate_size=48,
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=16,
    router="sigmoid",
    n_shared_experts=1,
    layer_is_moe=(False, True),
    partial_rotary_factor=0.5,
  )
  return _scaled(TargetModel.random(cfg, seed=seed), 4.0)


def random_draft(vocab: int = 96, seed: int = 1) -> TargetModel:
  cfg = ModelConfig(
    architecture="Qwen3ForCausalLM",
    vocab_size=vocab,
    hidden_size=16,
    num_layers=1,
    num_heads=2,
    num_kv_heads=1,
    head_dim=8,
    intermediate_size=32,
  )
  return _scaled(TargetModel.random(cfg, seed=seed), 4.0)


def _scaled(model: TargetModel, factor: float) -> TargetModel:
  """Sharper logits (fewer near-ties, more repetition) from scaled-up init weights."""
  import jax  # pylint: disable=import-outside-toplevel

  params = jax.tree_util.tree_map_with_path(
    lambda p, x: x if "scale" in jax.tree_util.keystr(p) else x * factor, model.params
  )
  return TargetModel(model.config, params)


def bigram_model(table: np.ndarray) -> TargetModel:
  """A TargetModel whose next-token distribution is table[prev] (rows sum to 1)."""
  vocab = table.shape[0]
  cfg = ModelConfig(
    architecture="Qwen3ForCausalLM",
    vocab_size=vocab,
    hidden_size=vocab,
    num_layers=1,
    num_heads=1,
    num_kv_heads=1,
    head_dim=2,
    intermediate_size=2,
    rms_norm_eps=1e-12,
    tie_word_embeddings=False,
  )
  import jax  # pylint: disable=import-outside-toplevel

  params = jax.tree_util.tree_map(np.array, TargetModel.random(cfg).params)
  params["embed"] = np.eye(vocab, dtype=np.float32)
  params["norm"]["scale"] = np.full((vocab,), 1.0 / np.sqrt(vocab), np.float32)
  params["layers_0"]["self_attn"]["o_proj"]["kernel"][:] = 0.0
  params["layers_0"]["mlp"]["down_proj"]["kernel"][:] = 0.0
  params["lm_head"]["kernel"] = np.log(np.maximum(table, 1e-30)).astype(np.float32)
  return TargetModel(cfg, jax.tree_util.tree_map(np.asarray, params))


def blockwise_logits(
  model: TargetModel, ids: np.ndarray, sizes: Sequence[int], max_len: int = 32
) -> np.ndarray:
  """Logits of `ids` [B, T] run through the decoding state in blocks of `sizes` (summing to
  T), each block committed before the next: what a full causal forward must equal."""
  return blockwise_outputs(model, ids, sizes, max_len)[0]


def blockwise_outputs(
  model: TargetModel,
  ids: np.ndarray,
  sizes: Sequence[int],
  max_len: int = 32,
  taps: tuple[int, ...] = (),
) -> tuple[np.ndarray, np.ndarray | None]:
  """As blockwise_logits, also returning the blocks' taps [n_taps, B, T, H] (None without)."""
  b = ids.shape[0]
  state = model.init_state(b, max_len)
  logits, tapped, pos = [], [], 0
  for size in sizes:
    out = target_lib.forward(
      model.config,
      model.params,
      jnp.asarray(ids[:, pos : pos + size]),
      jnp.full((b,), pos, jnp.int32),
      state,
      taps=taps,
    )
    state = out.state.commit(jnp.full((b,), size, jnp.int32))
    logits.append(np.asarray(out.logits))
    if taps:
      tapped.append(np.asarray(out.taps))
    pos += size
  assert pos == ids.shape[1], (sizes, ids.shape)
  return np.concatenate(logits, 1), np.concatenate(tapped, 2) if taps else None
