"""GQA attention of a block of new tokens over the decoding state (cost ∝ the live sequence).

A block of T tokens per sequence sits at slots start[b]..start[b]+T-1 of a layer-state entry
(jaxspec/state/). Query t sees every committed slot before start[b] and, inside the block,
slot start[b]+u iff block_mask[t, u] (causal when None; an ancestor mask for trees).

Two implementations, chosen by `RunOptions.attention_impl`:

* "xla": the block attends to itself (the [T, T] part, with the block's K/V rounded exactly as
  the cache stores them), then reads the committed prefix in chunks of `attention_chunk` slots
  up to the longest live prefix in the batch, with an online softmax. Nothing is sized by
  `max_len`: no [B, T, max_len] mask, no cast of the whole layer cache, and a quantized cache
  is dequantized chunk by chunk. Decoding at 450 tokens costs the same with max_len 1K or 32K.
* "pallas": the tree-attention kernel (pallas_kernels/tree_attention) over the stacked cache:
  KV groups read once for all their query heads, long prefixes split across programs. It runs
  on CUDA/ROCm, in interpret mode on CPU; there is no TPU kernel, so on TPU (and any other
  platform) "pallas" runs the "xla" path. The platform is the one the program is lowered for
  (jaxspec/models/platform.py), not the tracing host's. "auto" picks "xla" everywhere until the
  kernel has been compiled and checked on a GPU.

The XLA path reads any state kind through the protocol of jaxspec/state (`read_range` for the
slots to visit, `read_chunk` for float K/V, the position each slot holds and which ones the
block may see), so a full cache, a ring of recent positions (read by stored position) or a
drafter's context store are read by the same loop; the Pallas path asks the kind for the
arrays the kernel reads (`kernel_operands`). Nothing here knows the kinds.

Without a state (training, `TargetModel.logits`) the block attends to itself only.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp

from jaxspec.errors import ConfigError
from jaxspec import sharding
from jaxspec.models.platform import kernel_or_reference

NEG_INF = -1e30  # large finite negative: fully masked rows stay NaN-free

IMPLS = ("auto", "xla", "pallas")


def resolve_impl(impl: str) -> str:
  """ "auto" → "xla" (the Pallas kernel is opt-in until it has been checked on hardware)."""
  if impl not in IMPLS:
    raise ConfigError(f"attention_impl={impl!r}; expected one of {IMPLS}")
  return "xla" if impl == "auto" else impl


def block_visibility(block_mask: jax.Array | None, batch: int, t: int) -> jax.Array:
  """bool [B, T, T]: which block tokens each block query sees (causal when block_mask is None)."""
  if block_mask is None:
    causal = jnp.arange(t)[:, None] >= jnp.arange(t)[None, :]
    return jnp.broadcast_to(causal, (batch, t, t))
  return jnp.broadcast_to(block_mask.astype(bool), (batch, t, t))


class OnlineSoftmax:
  """Online-softmax accumulation over key chunks (flash attention's running max m, normaliser
  l and unnormalised output acc, all float32). Scores are [..., Q, S] for any leading query
  layout; values are matched by the caller's einsum."""

  @staticmethod
  def init(lead: tuple[int, ...], d: int):
    return (
      jnp.full(lead, NEG_INF, jnp.float32),
      jnp.zeros(lead, jnp.float32),
      jnp.zeros((*lead, d), jnp.float32),
    )

  @staticmethod
  def weights(carry, scores: jax.Array, visible: jax.Array):
    """→ (new m, rescale factor for the old l/acc, p [..., S]): masked keys get weight 0."""
    m, _, _ = carry
    scores = jnp.where(visible, scores, NEG_INF)
    m_new = jnp.maximum(m, jnp.max(scores, axis=-1))
    p = jnp.where(visible, jnp.exp(scores - m_new[..., None]), 0.0)
    return m_new, jnp.exp(m - m_new), p

  @staticmethod
  def add(carry, m_new: jax.Array, alpha: jax.Array, p: jax.Array, pv: jax.Array):
    """Folds one chunk's weights p and weighted values pv [..., D] into the carry."""
    _, l, acc = carry
    return m_new, alpha * l + jnp.sum(p, axis=-1), alpha[..., None] * acc + pv

  @staticmethod
  def finish(carry) -> jax.Array:
    _, l, acc = carry
    return acc / jnp.maximum(l, 1e-30)[..., None]


def _update(carry, scores: jax.Array, visible: jax.Array, v: jax.Array):
  """One GQA chunk: scores [B, K, G, T, S], v [B, S, K, D]."""
  m_new, alpha, p = OnlineSoftmax.weights(carry, scores, visible)
  pv = jnp.einsum("bkgts,bskd->bkgtd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
  return OnlineSoftmax.add(carry, m_new, alpha, p, pv)


def _scores(qg: jax.Array, k: jax.Array, scale: float) -> jax.Array:
  return jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32) * scale


class Selection(NamedTuple):
  """Which keys each block query keeps (DeepSeek Sparse Attention's top-k, models/dsa.py), on
  top of what it may see: `cache` bool [B, T, S] over a state entry's slots (None without a
  state) and `block` bool [B, T, T] over the block's own keys."""

  cache: jax.Array | None
  block: jax.Array


class Window(NamedTuple):
  """A sliding window (gpt-oss): a key at position p is seen by a query at position q iff
  p > q − size. `size` may be traced (it differs between the layers of one scan); positions
  [B, T] are the block's RoPE positions (tree nodes sit at start + depth). `in_block` False
  applies it to the state's keys only (DFlash: a block sees all of itself)."""

  size: jax.Array
  positions: jax.Array
  in_block: bool = True


def attend_xla(
  q: jax.Array,
  k_block: jax.Array,
  v_block: jax.Array,
  kv: Any,
  layer: jax.Array,
  start: jax.Array,
  block_mask: jax.Array | None,
  scale: float,
  chunk: int,
  window: Window | None = None,
  sinks: jax.Array | None = None,
  select: Selection | None = None,
) -> jax.Array:
  """q [B,T,H,D]; k/v_block [B,T,K,D] as stored; kv a state entry (or None) → [B,T,H,Dv].

  The block attends to itself as `block_mask` says, then to the entry's slots that
  `kv.read_chunk` marks visible, chunk by chunk over `kv.read_range`. `window` restricts every
  query to the keys of its sliding window (the entry is then read from the first chunk a window
  reaches, so a sliding layer's cost is bounded by its window, not the context); `sinks` [H] are
  per-head logits that join each softmax's denominator and carry no value (gpt-oss): the
  running max and normaliser start from them; `select` (DSA) drops the keys a query's indexer
  did not choose. The output's head dim is V's (Dv).
  """
  b, t, h, d = q.shape
  kv_heads, dv = k_block.shape[2], v_block.shape[-1]
  groups = h // kv_heads
  qg = q.reshape(b, t, kv_heads, groups, d)
  carry = OnlineSoftmax.init((b, kv_heads, groups, t), dv)
  if sinks is not None:
    m0 = jnp.broadcast_to(
      sinks.astype(jnp.float32).reshape(kv_heads, groups)[None, :, :, None], carry[0].shape
    )
    carry = (m0, jnp.ones_like(m0), carry[2])
  inside = block_visibility(block_mask, b, t)  # [B, T, T]
  if window is not None and window.in_block:
    pos = window.positions
    inside = inside & (pos[:, None, :] > pos[:, :, None] - window.size)
  if select is not None:
    inside = inside & select.block
  carry = _update(
    carry, _scores(qg, k_block.astype(q.dtype), scale), inside[:, None, None], v_block
  )

  if kv is not None:
    size = min(chunk, kv.max_len)
    lowest = None  # no query sees a position ≤ (its own − window)
    if window is not None:
      lowest = jnp.min(window.positions) - window.size + 1
    lo, hi = kv.read_range(start, lowest)
    first_chunk, num_chunks = lo // size, (hi + size - 1) // size

    def body(c, carry):
      # The last chunk may be clamped to end at max_len; `first` drops slots read before.
      first = c * size
      offset = jnp.minimum(first, kv.max_len - size)
      read = kv.read_chunk(layer, offset, size, start)  # [B, S, K, D], split as the entry is
      k = sharding.constrain_activation(read.k, "kv_heads", "head_dim")
      v = sharding.constrain_activation(read.v, "kv_heads", "head_dim")
      fresh = offset + jnp.arange(size) >= first
      visible = (read.visible & fresh[None, :])[:, None, :]  # [B, 1, S]: for every query
      if window is not None:
        key_pos = read.positions[:, None, :]
        visible = visible & (key_pos > window.positions[:, :, None] - window.size)
      if select is not None:  # [B, T, S]: the indexer's choice among this chunk's slots
        chosen = jax.lax.dynamic_slice_in_dim(select.cache, offset, size, axis=2)
        visible = visible & chosen
      scores = _scores(qg, k.astype(q.dtype), scale)
      return _update(carry, scores, visible[:, None, None], v.astype(q.dtype))

    carry = jax.lax.fori_loop(first_chunk, num_chunks, body, carry)

  out = OnlineSoftmax.finish(carry)  # [B, K, G, T, D]
  out = jnp.moveaxis(out, 3, 1).reshape(b, t, h, dv).astype(q.dtype)
  return sharding.constrain_activation(out, "heads", "head_dim")


def attend_pallas(
  q: jax.Array,
  kv: Any,
  layer: jax.Array,
  start: jax.Array,
  block_mask: jax.Array | None,
  scale: float,
  reference: Callable[[], jax.Array],
) -> jax.Array:
  """The Pallas tree-attention kernel over the stacked cache (block already written).

  The kernel runs on CPU (interpret mode), CUDA and ROCm; on other platforms (TPU: no kernel)
  `reference()` (the XLA path) runs, chosen when the program is lowered."""
  # pylint: disable=import-outside-toplevel
  from pallas_kernels.tree_attention import tree_attention

  operands = kv.kernel_operands()  # k, v (and FP8 scales) as the kernel reads them
  if operands is None:
    pages = getattr(kv, "page_size", 0)
    why = f" with pages of {pages} slots (it reads pages of a power of two ≥ 16)" if pages else ""
    raise ConfigError(
      f"the Pallas attention kernel does not read {kv.format} caches{why}; use "
      "attention_impl='xla'"
    )

  def kernel(interpret: bool) -> jax.Array:
    out = tree_attention(
      q,
      start=start,
      block_mask=block_mask,
      scale=scale,
      impl="pallas",
      interpret=interpret,
      layer=layer,
      **operands,
    )
    return out.astype(q.dtype)

  return kernel_or_reference(kernel, lambda: reference().astype(q.dtype))


class SharedSource(NamedTuple):
  """What a KV-shared layer (Gemma 4) attends to: its source layer's state entry before and
  after that layer wrote the block (None without a state), the source's index in the entry,
  and the block's K/V as the source stored them [B, T, K, D]."""

  before: Any
  after: Any
  layer: jax.Array
  k: jax.Array
  v: jax.Array


def attention_block(
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  kv: Any,
  layer: jax.Array,
  start: jax.Array,
  block_mask: jax.Array | None,
  scale: float,
  impl: str = "auto",
  chunk: int = 256,
  window: Window | None = None,
  sinks: jax.Array | None = None,
  select: Selection | None = None,
) -> tuple[jax.Array, Any, SharedSource]:
  """`attention`, also returning what a KV-shared layer reading this one needs (the entry
  before and after the write and the block's K/V as stored): (out, kv, source)."""
  extras = dict(window=window, sinks=sinks, select=select)
  if kv is None:
    out = attend_xla(q, k, v, None, layer, start, block_mask, scale, chunk, **extras)
    return out, None, SharedSource(None, None, layer, k, v)
  before = kv
  kv, k_block, v_block = kv.write(layer, start, k, v)
  source = SharedSource(before, kv, layer, k_block, v_block)
  if resolve_impl(impl) == "pallas":
    if window is not None or sinks is not None or select is not None:
      raise ConfigError("the Pallas attention kernel has no sinks, sliding windows or DSA")
    xla = lambda: attend_xla(q, k_block, v_block, kv, layer, start, block_mask, scale, chunk)
    return attend_pallas(q, kv, layer, start, block_mask, scale, reference=xla), kv, source
  out = attend_shared(q, source, start, block_mask, scale, chunk, **extras)
  return out, kv, source


def attend_shared(
  q: jax.Array,
  source: SharedSource,
  start: jax.Array,
  block_mask: jax.Array | None,
  scale: float,
  chunk: int = 256,
  **extras: Any,
) -> jax.Array:
  """q attends to a block already written into `source.after` (XLA path): the prefix is read
  from the written entry (no copy of it kept), unless the block is wide enough to displace keys
  of its own window in a sliding ring (state/sliding.py), which is then read as it was."""
  before, after = source.before, source.after
  read = after if before is None or before.reads_after_write(q.shape[1]) else before
  return attend_xla(
    q, source.k, source.v, read, source.layer, start, block_mask, scale, chunk, **extras
  )


def attention(
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  kv: Any,
  layer: jax.Array,
  start: jax.Array,
  block_mask: jax.Array | None,
  scale: float,
  impl: str = "auto",
  chunk: int = 256,
  window: Window | None = None,
  sinks: jax.Array | None = None,
  select: Selection | None = None,
) -> tuple[jax.Array, Any]:
  """Writes the block's k/v [B,T,K,D] into `kv` (if any) and attends; returns (out, kv).

  A latent entry (MLA, state/latent.py) takes the block's vectors as k and no v."""
  out, kv, _ = attention_block(
    q, k, v, kv, layer, start, block_mask, scale, impl, chunk, window, sinks, select
  )
  return out, kv
