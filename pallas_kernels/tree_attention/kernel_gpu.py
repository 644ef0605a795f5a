"""Tree attention as a Pallas kernel (GPU-style: one program per (sequence, query head)).

Each program holds the block's queries for one head, [Tp, D] (T padded to a power of two), and
streams that head's KV group over tiles of `block_k` slots with an online softmax (running max m,
normaliser l, accumulator acc, all float32). Only the tiles up to the end of the block are
visited: a dynamic trip count cdiv(start + T, block_k) per sequence, so short prefixes cost
little. Visibility per tile: slot < start (prefix), or slot = start + u with block_mask[t, u].
The ancestor-mask lookup is a small matmul, mask[Tp, Tp] @ onehot(slot − start)[Tp, block_k],
so the kernel needs no gather.

Status: checked only in interpret mode (`interpret=True`, on CPU) against reference.py; no GPU
was available when it was written. It uses backend-neutral Pallas (BlockSpecs, ref slicing,
`jnp.dot`, a `fori_loop`), i.e. the Triton lowering; a Hopper (Mosaic GPU) version with TMA
copies and wgmma is future work. Triton needs power-of-two tiles and dot operands ≥ 16 wide:
Tp ≥ 16 is enforced here; head_dim must be ≥ 16 on hardware (tests use 8 in interpret mode).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.tree_attention.reference import MASK_VALUE


def _kernel(
  start_ref, q_ref, k_ref, v_ref, mask_ref, o_ref, *, scale: float, block_len: int, block_k: int
):
  b = pl.program_id(0)
  start = start_ref[b]
  q = q_ref[...].astype(jnp.float32) * scale  # [Tp, D]
  mask = mask_ref[...].astype(jnp.float32)  # [Tp, Tp]
  tp, d = q.shape
  u_ids = jax.lax.broadcasted_iota(jnp.int32, (tp, block_k), 0)
  col = jax.lax.broadcasted_iota(jnp.int32, (tp, block_k), 1)

  def body(j, carry):
    m, l, acc = carry
    off = j * block_k
    k = k_ref[pl.ds(off, block_k), :].astype(jnp.float32)  # [bk, D]
    v = v_ref[pl.ds(off, block_k), :].astype(jnp.float32)
    s = jnp.dot(q, k.T, preferred_element_type=jnp.float32)  # [Tp, bk]
    slot = off + col
    onehot = (slot - start == u_ids).astype(jnp.float32)  # [Tp(u), bk]: slot = start + u
    in_tree = jnp.dot(mask, onehot, preferred_element_type=jnp.float32) > 0.5
    visible = (slot < start) | in_tree
    s = jnp.where(visible, s, MASK_VALUE)
    m_new = jnp.maximum(m, jnp.max(s, axis=1))
    alpha = jnp.exp(m - m_new)
    p = jnp.exp(s - m_new[:, None])
    l = alpha * l + jnp.sum(p, axis=1)
    acc = alpha[:, None] * acc + jnp.dot(p, v, preferred_element_type=jnp.float32)
    return m_new, l, acc

  n_tiles = jnp.minimum((start + block_len + block_k - 1) // block_k, k_ref.shape[0] // block_k)
  init = (
    jnp.full((tp,), MASK_VALUE, jnp.float32),
    jnp.zeros((tp,), jnp.float32),
    jnp.zeros((tp, d), jnp.float32),
  )
  _, l, acc = jax.lax.fori_loop(0, n_tiles, body, init)
  o_ref[...] = (acc / l[:, None]).astype(o_ref.dtype)


def _pow2_at_least(n: int, floor: int) -> int:
  p = floor
  while p < n:
    p *= 2
  return p


@functools.partial(jax.jit, static_argnames=("scale", "block_k", "interpret"))
def tree_attention_pallas(
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  start: jax.Array,
  block_mask: jax.Array,
  scale: float | None = None,
  block_k: int = 64,
  interpret: bool = False,
) -> jax.Array:
  """Same contract as `reference.tree_attention_reference` (q [B,T,H,D], k/v [B,S,K,D]).

  `block_k` (a power of two) is the KV tile; the cache is padded to a multiple of it when
  needed (a copy: size caches in multiples of block_k to avoid it).
  """
  b, t, h, d = q.shape
  s_len, kv_heads = k.shape[1], k.shape[2]
  if h % kv_heads:
    raise ValueError(f"{h} query heads are not a multiple of {kv_heads} KV heads")
  group = h // kv_heads
  scale = d**-0.5 if scale is None else float(scale)
  tp = _pow2_at_least(t, 16)
  block_k = min(block_k, _pow2_at_least(s_len, 16))
  if block_mask.ndim == 2:
    block_mask = jnp.broadcast_to(block_mask, (b, t, t))
  # Padded query rows see nothing (their outputs are dropped); padded columns are never seen.
  mask = jnp.zeros((b, tp, tp), jnp.int32).at[:, :t, :t].set(block_mask.astype(jnp.int32))
  q_pad = jnp.pad(q, ((0, 0), (0, tp - t), (0, 0), (0, 0)))
  s_pad = -(-s_len // block_k) * block_k
  if s_pad != s_len:
    k = jnp.pad(k, ((0, 0), (0, s_pad - s_len), (0, 0), (0, 0)))
    v = jnp.pad(v, ((0, 0), (0, s_pad - s_len), (0, 0), (0, 0)))

  kernel = functools.partial(_kernel, scale=scale, block_len=t, block_k=block_k)
  out = pl.pallas_call(
    kernel,
    grid=(b, h),
    in_specs=[
      pl.BlockSpec((b,), lambda i, j: (0,)),  # start
      pl.BlockSpec((None, tp, None, d), lambda i, j: (i, 0, j, 0)),  # q
      pl.BlockSpec((None, s_pad, None, d), lambda i, j: (i, 0, j // group, 0)),  # k
      pl.BlockSpec((None, s_pad, None, d), lambda i, j: (i, 0, j // group, 0)),  # v
      pl.BlockSpec((None, tp, tp), lambda i, j: (i, 0, 0)),  # mask
    ],
    out_specs=pl.BlockSpec((None, tp, None, d), lambda i, j: (i, 0, j, 0)),
    out_shape=jax.ShapeDtypeStruct((b, tp, h, d), q.dtype),
    interpret=interpret,
    name="tree_attention",
  )(start.astype(jnp.int32), q_pad, k, v, mask)
  return out[:, :t]
