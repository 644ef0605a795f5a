"""What the feature drafters (DFlash, EAGLE-3) share: the target's tapped features, its
embedding and LM head, the checks that a drafter fits its target, and random weights.

A feature drafter reads the outputs of some target layers (its `taps`, HF hidden_states[id + 1])
and, unless it carries its own, the target's embedding and LM head. These helpers are the one
place those pieces are gathered, so DFlash, EAGLE-3 and their training losses read them alike.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.config_checks import ROPE_TYPES
from jaxspec.config import ModelConfig
from jaxspec.errors import ConfigError
from jaxspec.io.drafter_ckpt import make_vocab_maps
from jaxspec.options import RunOptions
from jaxspec.models import matmul
from jaxspec.models.layers import dtype_of, scaled_rows, unfused_logits
from jaxspec.models.target import InputError, TargetModel
from jaxspec.quant.formats import is_quantized, materialize

# Target features a feature drafter keeps for long contexts (its ring's size; 0 = all).
DEFAULT_CONTEXT_WINDOW = 4096


def concat_taps(taps: jax.Array) -> jax.Array:
  """[n_taps, B, T, H] → [B, T, n_taps·H] (tap 0's features first, as torch.cat(dim=-1))."""
  n, b, t, h = taps.shape
  return jnp.moveaxis(taps, 0, 2).reshape(b, t, n * h)


# --------------------------------------------------------------------------------------------------
# Shared target pieces (embedding and LM head)
# --------------------------------------------------------------------------------------------------


def shared_target_params(target: TargetModel) -> dict:
  """The target's embedding (and untied LM head) as drafter parameters; nothing is copied."""
  out = {"embed": target.params["embed"]}
  if not target.config.tie_word_embeddings:
    out["lm_head"] = target.params["lm_head"]["kernel"]
  return out


def embed_tokens(shared: dict, tokens: jax.Array, dtype: str, scale: float = 1.0) -> jax.Array:
  """Rows of the shared embedding `shared["embed"]` for `tokens`, times the target's
  embedding scale (`ModelConfig.embedding_scale`), in `dtype`."""
  return scaled_rows(shared["embed"], tokens, scale).astype(dtype_of(dtype))


def target_head(shared: dict, h: jax.Array, dtype: str) -> jax.Array:
  """The target's LM head on drafter hidden states: float32 logits [..., V]."""
  dt = dtype_of(dtype)
  if "lm_head" in shared and (is_quantized(shared["lm_head"]) or dt == jnp.float32):
    # The target's own product: a quantized head is read as stored (computed in float32).
    return unfused_logits(matmul.dense(h.astype(dt), shared["lm_head"], 1, jnp.float32))
  if "lm_head" in shared:
    head, spec = shared["lm_head"].astype(dt), "...h,hv->...v"
  else:
    head, spec = shared["embed"].astype(dt), "...h,vh->...v"
  return unfused_logits(jnp.einsum(spec, h.astype(dt), head, preferred_element_type=jnp.float32))


def head_rows_of(shared: dict, ids: jax.Array) -> jax.Array:
  """The head's output rows W[:, ids] as float32 [..., H] (what `target_head` dots with h)."""
  if "lm_head" in shared:  # [H, V]
    return jnp.moveaxis(jnp.take(materialize(shared["lm_head"], jnp.float32), ids, axis=1), 0, -1)
  return jnp.take(shared["embed"], ids, axis=0).astype(jnp.float32)


def head_rows_expectation(shared: dict, probs: jax.Array) -> jax.Array:
  """Σ_v probs[..., v]·W[:, v] [..., H]: the head's output rows averaged under `probs`.

  Since `draft_logits` is linear, h·head_rows_expectation(p) = Σ_v p_v·logits_v(h) (the soft
  cross-entropy's cross term) at [..., H] cost instead of [..., V]. With a draft vocabulary
  (`draft_head_params`) `probs` runs over it, [..., V_d], as its logits do.
  """
  probs = probs.astype(jnp.float32)
  if "draft_head" in shared:
    return jnp.einsum("...v,vh->...h", probs, shared["draft_head"].astype(jnp.float32))
  if "lm_head" in shared:
    return jnp.einsum("...v,hv->...h", probs, materialize(shared["lm_head"], jnp.float32))
  return jnp.einsum("...v,vh->...h", probs, shared["embed"].astype(jnp.float32))


# A draft vocabulary over the target's head: the drafter scores only V_d of the target's rows
# (the most frequent target ids), so a propose reads V_d/V of the head. Drafts outside it are
# never proposed; verification stays lossless (q is zero there).


def draft_vocab_ids(
  draft_vocab: Optional[Any], vocab_size: int, configured: int, what: str
) -> Optional[np.ndarray]:
  """A drafter's draft vocabulary as sorted unique target ids (None: the whole vocabulary),
  checked against the target's size and the configured draft_vocab_size (0: unset)."""
  if draft_vocab is None:
    if 0 < configured < vocab_size:
      raise InputError(
        f"a {what} drafter with a draft vocabulary ({configured} of {vocab_size} ids) needs "
        "its ids (draft_vocab)"
      )
    return None
  d2t, _ = make_vocab_maps(draft_vocab, vocab_size)  # sorted, unique, in range (ConfigError)
  ids = np.arange(d2t.size) + d2t
  if configured and configured != ids.size:
    raise InputError(f"{what} draft vocabulary has {ids.size} ids, its config says {configured}")
  return ids


def draft_head_params(shared: dict, ids: Any, dtype: str) -> dict:
  """{"draft_vocab": sorted target ids [V_d] int32, "draft_head": their head rows [V_d, H]}:
  the rows are the target's own (read once here), so a draft vocabulary adds no weights."""
  ids = jnp.asarray(np.sort(np.asarray(ids)), jnp.int32)
  return {"draft_vocab": ids, "draft_head": head_rows_of(shared, ids).astype(dtype_of(dtype))}


def draft_logits(params: dict, h: jax.Array, dtype: str) -> jax.Array:
  """float32 logits of drafter hidden states: over the draft vocabulary [..., V_d] when the
  drafter has one (`draft_head_params`), else over the target's whole head [..., V]."""
  if "draft_head" not in params:
    return target_head(params, h, dtype)
  dt = dtype_of(dtype)
  rows = params["draft_head"].astype(dt)
  return jnp.einsum("...h,vh->...v", h.astype(dt), rows, preferred_element_type=jnp.float32)


def draft_to_target_ids(params: dict, idx: jax.Array) -> jax.Array:
  """Target ids of draft-vocabulary indices (the identity without a draft vocabulary)."""
  return jnp.take(params["draft_vocab"], idx) if "draft_vocab" in params else idx


def target_to_draft_ids(params: dict, ids: jax.Array, vocab_size: int) -> jax.Array:
  """Draft-vocabulary indices of target ids, −1 for those outside it (the identity without)."""
  if "draft_vocab" not in params:
    return ids
  d = params["draft_vocab"]
  t2d = jnp.full((vocab_size,), -1, jnp.int32).at[d].set(jnp.arange(d.shape[0], dtype=jnp.int32))
  return t2d[ids]


def to_target_vocab(params: dict, x: jax.Array, vocab_size: int, fill: float) -> jax.Array:
  """Per-draft-id values [..., V_d] spread over the target vocabulary [..., V] (`fill` off the
  draft vocabulary: 0 for probabilities, NEG_INF for log-probabilities)."""
  if "draft_vocab" not in params:
    return x
  out = jnp.full(x.shape[:-1] + (vocab_size,), fill, x.dtype)
  return out.at[..., params["draft_vocab"]].set(x)


def check_target(
  target: TargetModel,
  *,
  hidden_size: int,
  target_hidden_size: int,
  vocab_size: int,
  tap_ids: tuple[int, ...],
  what: str,
) -> None:
  """Clear errors for a drafter built for a different target."""
  tc = target.config
  if vocab_size and vocab_size != tc.vocab_size:
    raise InputError(
      f"{what} drafter vocabulary ({vocab_size}) differs from the target's ({tc.vocab_size})"
    )
  if target_hidden_size and target_hidden_size != tc.hidden_size:
    raise InputError(
      f"{what} drafter expects target features of size {target_hidden_size}, but "
      f"the target's hidden size is {tc.hidden_size}"
    )
  if hidden_size != tc.hidden_size:
    raise InputError(
      f"{what} drafter hidden size ({hidden_size}) differs from the target's "
      f"({tc.hidden_size}); it shares the target's embedding and LM head"
    )
  bad = [i for i in tap_ids if not 0 <= i < tc.num_layers]
  if bad:
    raise InputError(
      f"{what} drafter taps target layers {list(tap_ids)}, but the target has "
      f"{tc.num_layers} layers"
    )


# --------------------------------------------------------------------------------------------------
# Configs and weights
# --------------------------------------------------------------------------------------------------


def check_layer_sizes(
  config: Any, what: str, sizes: tuple[str, ...]
) -> Callable[[bool, str], None]:
  """Checks a drafter config's attention sizes: every field in `sizes` positive, query heads a
  multiple of the key/value heads, head_dim even (RoPE). Returns `need(cond, msg)`, which
  raises ConfigError("<what> drafter: msg") unless cond, for the config's own checks."""

  def need(cond: bool, msg: str) -> None:
    if not cond:
      raise ConfigError(f"{what} drafter: {msg}")

  for name in sizes:
    need(getattr(config, name) > 0, f"{name} must be positive, got {getattr(config, name)}")
  need(
    config.num_heads % config.num_kv_heads == 0,
    f"num_attention_heads ({config.num_heads}) must be a multiple of num_key_value_heads "
    f"({config.num_kv_heads})",
  )
  need(config.head_dim % 2 == 0, f"head_dim must be even for RoPE, got {config.head_dim}")
  return need


def layer_config(config: Any, **fields: Any) -> ModelConfig:
  """The Qwen3-shaped ModelConfig a drafter's layers are built from (the shared modules read
  one): the attention/MLP sizes, norm, RoPE and dtypes of `config`, plus `fields`."""
  return ModelConfig(
    architecture="Qwen3ForCausalLM",
    hidden_size=config.hidden_size,
    num_heads=config.num_heads,
    num_kv_heads=config.num_kv_heads,
    head_dim=config.head_dim,
    intermediate_size=config.intermediate_size,
    rms_norm_eps=config.rms_norm_eps,
    rope_theta=config.rope_theta,
    rope_scaling=config.rope_scaling,
    options=RunOptions(dtype=config.dtype, param_dtype=config.param_dtype),
    **fields,
  )


def sized_like(target: TargetModel, **sizes: Optional[int]) -> dict[str, Any]:
  """Config fields of a drafter as wide as `target`, with its vocabulary, norm epsilon, RoPE base
  and dtype; each of `sizes` (num_heads, head_dim, ...) replaces the target's unless None/0."""
  tc = target.config
  fields = dict(
    hidden_size=tc.hidden_size,
    num_heads=tc.num_heads,
    num_kv_heads=tc.num_kv_heads,
    head_dim=tc.head_dim,
    intermediate_size=tc.intermediate_size,
    vocab_size=tc.vocab_size,
    target_hidden_size=tc.hidden_size,
    rms_norm_eps=tc.rms_norm_eps,
    rope_theta=tc.rope_theta,
    # A family's own RoPE kind (Gemma 4's "proportional") is not a drafter's: keep the default.
    rope_scaling=tc.rope_scaling if dict(tc.rope_scaling).get("rope_type") in ROPE_TYPES else (),
    dtype=tc.dtype,
  )
  fields.update({k: v for k, v in sizes.items() if v})
  return fields


def abstract_params(module: nn.Module, method: Callable, *inputs: jax.Array) -> Any:
  """`module`'s boxed variables as `module.init(..., method=method)` on `inputs` makes them,
  evaluated for shapes only (nothing runs): unbox for shapes, `nn.get_partition_spec` for axes."""
  return jax.eval_shape(lambda: module.init(jax.random.PRNGKey(0), *inputs, method=method))


def random_params(shapes: Any, seed: int = 0, stddev: float = 0.02) -> Any:
  """Random weights for a tree of parameter shapes: normal(stddev) matrices, zero biases, unit
  norm scales (numpy's generator, so a seed gives the same weights on every backend)."""
  rng = np.random.default_rng(seed)

  def make(path, leaf):
    name = jax.tree_util.keystr(path)
    if "scale" in name:
      return jnp.ones(leaf.shape, leaf.dtype)
    if "bias" in name:
      return jnp.zeros(leaf.shape, leaf.dtype)
    return jnp.asarray(rng.normal(0.0, stddev, leaf.shape), leaf.dtype)

  return jax.tree_util.tree_map_with_path(make, shapes)
