"""Tree attention as a Pallas kernel (GPU-style, flash-decoding with GQA grouping).

Grid (B, K, num_splits): one program per (sequence, KV head, KV split). A program holds the
block's queries of all G = H / K query heads that share its KV head, stacked as R rows
(row r = g * T + t, padded to a power of two R >= 16), so each K/V tile is read once per KV
group instead of once per query head. The KV length is cut into `num_splits` partitions of
whole `block_k` tiles (flash-decoding / split-K): the program streams the tiles of its partition
that lie below start + T (a dynamic trip count per sequence; a partition entirely past the live
length runs zero iterations) with an online softmax (running max m, normaliser l, accumulator
acc, float32) and writes its partial (m, l, acc). A small jnp step merges the partials with a
log-sum-exp (`combine_splits`).

Visibility per tile: slot < start (prefix), or slot = start + u with block_mask[t, u]. The
ancestor-mask lookup is a small matmul, mask[R, Tp] @ onehot(slot − start)[Tp, block_k], so the
kernel needs no gather; with `block_mask=None` (causal in the block) it is one compare,
slot <= start + t, and no mask operand.

Cache layout: k, v are [B, S, K, D] or the stacked cache of all layers [L, B, S, K, D] with an
int32 `layer` (traced) that the kernel reads from a 1-element operand and uses to index its ref,
`k_ref[layer, pl.ds(off, block_k), :]`, so no copy of one layer is made. (Scalar prefetch, which
would let a BlockSpec index_map pick the layer, is not implemented by the Triton lowering; each
BlockSpec block is only a base pointer there, so whole-L / whole-S blocks cost nothing; interpret
mode does copy each program's block, which only matters for its speed.) The cache is never
padded (except a toy cache shorter than 16 slots): the last tile is loaded from slot S − block_k
and its slots already seen by the previous tile are masked out. V rows of slots that are not live
(>= start + T) are zeroed before p @ v, so stale cache contents (even NaN) never reach the result.

Paged caches: with `page_table` [B, W] (int32 pool page ids) k, v are page pools [L, P, page, K,
D] (or [P, page, K, D]) and a sequence's logical slot s lives in slot s mod page of pool page
page_table[b, s // page]. The tile is then at most a page and divides it (page a power of two
>= 16), so a tile never crosses a page: the program reads the tile's page id from the table
(a full-array operand, like `layer`) and loads `k_ref[layer, page, pl.ds(s mod page,
block_k), :]`. An id past the pool (unmapped) is clamped: only slots past a sequence's live
length, which are masked, may sit on one.

FP8: with k_scale / v_scale ([B, S, K] or [L, B, S, K] float32) the cache holds float8_e4m3fn and
each tile is dequantized in the kernel, k.astype(f32) * k_scale[slot, None].

Status: checked only in interpret mode (`interpret=True`, on CPU) against reference.py; no GPU
was available when it was written. It uses backend-neutral Pallas (BlockSpecs, ref slicing,
`jnp.dot`, a `fori_loop`) written for the Triton lowering, which the pallas_call pins with
`pallas.triton.CompilerParams` (without compiler params JAX 0.10 lowers pallas_call on GPU with
Mosaic GPU, which rejects this kernel); a Hopper (Mosaic GPU) version with TMA copies and wgmma
is future work. There is no TPU version. Triton needs power-of-two loads and dot operands >= 16 wide:
R >= 16 and block_k >= 16 are enforced here; head_dim must be >= 16 on hardware (tests use 8 in
interpret mode). On hardware, float32 `jnp.dot` may run as TF32, so expect a looser match than
the 2e-5 of the interpret-mode tests. Degenerate rows that see no slot at all (only possible with a user mask that
hides the token from itself, at start = 0) average V over the visited tiles instead of over all
S slots as the reference does.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.tree_attention.reference import MASK_VALUE

DEFAULT_SPLIT_LEN = 512  # auto num_splits = ceil(S / DEFAULT_SPLIT_LEN)


def _kernel(
  *refs,
  scale,
  block_len,
  block_k,
  cache_len,
  tiles_per_split,
  causal,
  k_quant,
  v_quant,
  page_size=0,
  num_pages=0,
):
  refs = list(refs)
  layer_ref, start_ref, q_ref, k_ref, v_ref = refs[:5]
  del refs[:5]
  table_ref = refs.pop(0) if page_size else None
  ks_ref = refs.pop(0) if k_quant else None
  vs_ref = refs.pop(0) if v_quant else None
  mask_ref = None if causal else refs.pop(0)
  acc_ref, m_ref, l_ref = refs

  b = pl.program_id(0)
  split = pl.program_id(2)
  layer = layer_ref[0]
  start = start_ref[b]
  q = q_ref[...].astype(jnp.float32) * scale  # [R, D]: row r = g * T + t
  rows, d = q.shape
  col = jax.lax.broadcasted_iota(jnp.int32, (rows, block_k), 1)
  if causal:
    row_t = jax.lax.broadcasted_iota(jnp.int32, (rows, block_k), 0) % block_len
  else:
    mask = mask_ref[...]  # [R, Tp] float32 0/1
    u_ids = jax.lax.broadcasted_iota(jnp.int32, (mask.shape[1], block_k), 0)
    u_col = jax.lax.broadcasted_iota(jnp.int32, (mask.shape[1], block_k), 1)
  slot_1d = jax.lax.broadcasted_iota(jnp.int32, (block_k, 1), 0)
  live_end = start + block_len

  def body(j, carry):
    m, l, acc = carry
    first = j * block_k  # the tile's slots are first..first+block_k-1, clipped to S
    off = jnp.minimum(first, cache_len - block_k)  # the last tile is loaded from S − block_k
    where = (layer, pl.ds(off, block_k))
    if page_size:  # the tile's page (S is whole pages: the tile is never clamped)
      page = jnp.minimum(table_ref[b, off // page_size], num_pages - 1)
      where = (layer, page, pl.ds(off % page_size, block_k))
    k = k_ref[where + (slice(None),)].astype(jnp.float32)  # [bk, D]
    v = v_ref[where + (slice(None),)].astype(jnp.float32)
    if k_quant:
      k = k * ks_ref[where][:, None]
    if v_quant:
      v = v * vs_ref[where][:, None]
    # Slots past the block may hold stale values (NaN for FP8): 0 * NaN must not reach acc.
    v_slot = off + slot_1d
    v = jnp.where((v_slot >= first) & (v_slot < live_end), v, 0.0)
    s = jnp.dot(q, k.T, preferred_element_type=jnp.float32)  # [R, bk]
    slot = off + col
    if causal:
      visible = slot <= start + row_t  # prefix, or block slot start + u with u <= t
    else:
      onehot = (off + u_col - start == u_ids).astype(jnp.float32)  # [Tp(u), bk]: slot = start + u
      in_tree = jnp.dot(mask, onehot, preferred_element_type=jnp.float32) > 0.5
      visible = (slot < start) | in_tree
    visible = visible & (slot >= first)  # not already seen by the previous (clamped) tile
    s = jnp.where(visible, s, MASK_VALUE)
    m_new = jnp.maximum(m, jnp.max(s, axis=1))
    alpha = jnp.exp(m - m_new)
    p = jnp.exp(s - m_new[:, None])
    l = alpha * l + jnp.sum(p, axis=1)
    acc = alpha[:, None] * acc + jnp.dot(p, v, preferred_element_type=jnp.float32)
    return m_new, l, acc

  n_tiles = pl.cdiv(cache_len, block_k)
  live_tiles = jnp.minimum((live_end + block_k - 1) // block_k, n_tiles)
  lo = split * tiles_per_split
  hi = jnp.minimum(lo + tiles_per_split, live_tiles)  # hi <= lo: partition past the live length
  init = (
    jnp.full((rows,), MASK_VALUE, jnp.float32),
    jnp.zeros((rows,), jnp.float32),
    jnp.zeros((rows, d), jnp.float32),
  )
  m, l, acc = jax.lax.fori_loop(lo, hi, body, init)
  acc_ref[...] = acc
  m_ref[...] = m
  l_ref[...] = l


def combine_splits(acc: jax.Array, m: jax.Array, l: jax.Array) -> jax.Array:
  """Log-sum-exp merge of per-split partials: acc [..., N, R, D], m/l [..., N, R] -> [..., R, D].

  An empty partition has m = MASK_VALUE, l = 0, acc = 0 and so weight exp(MASK_VALUE − m_max) = 0
  (or l = 0 when every partition is empty for a row, which cannot happen: partition 0 always
  visits the first tile).
  """
  m_max = jnp.max(m, axis=-2, keepdims=True)
  w = jnp.exp(m - m_max)  # [..., N, R]
  l_tot = jnp.sum(w * l, axis=-2)
  acc_tot = jnp.sum(w[..., None] * acc, axis=-3)
  return acc_tot / l_tot[..., None]


def _pow2_at_least(n: int, floor: int) -> int:
  p = floor
  while p < n:
    p *= 2
  return p


def _pow2_at_most(n: int) -> int:
  p = 1
  while p * 2 <= n:
    p *= 2
  return p


def choose_num_splits(cache_len: int, block_k: int, split_len: int = DEFAULT_SPLIT_LEN) -> int:
  """Auto split count: ceil(S / split_len), at least 1 and at most the number of tiles."""
  n_tiles = -(-cache_len // block_k)
  return max(1, min(-(-cache_len // split_len), n_tiles))


def _as_stack(x: jax.Array, ndim: int, stacked: bool, name: str) -> jax.Array:
  if x.ndim != ndim + int(stacked):
    raise ValueError(f"{name} has rank {x.ndim}; expected {ndim + int(stacked)} (as k, v)")
  return x if stacked else x[None]  # a free reshape: [1, ...]


_STATIC = ("scale", "block_k", "interpret", "num_splits", "split_len")


@functools.partial(jax.jit, static_argnames=_STATIC)
def tree_attention_pallas(
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  start: jax.Array,
  block_mask: jax.Array | None,
  scale: float | None = None,
  block_k: int = 64,
  interpret: bool = False,
  *,
  layer: jax.Array | int | None = None,
  k_scale: jax.Array | None = None,
  v_scale: jax.Array | None = None,
  num_splits: int | None = None,
  split_len: int = DEFAULT_SPLIT_LEN,
  page_table: jax.Array | None = None,
) -> jax.Array:
  """Same contract as `reference.tree_attention_reference` (`page_table`: paged pools, see the
  module docstring).

  q [B, T, H, D]; k, v [B, S, K, D] or stacked [L, B, S, K, D] with `layer` (int32 scalar, may
  be traced; clamped into [0, L)); optional FP8 scales k_scale / v_scale [B, S, K] or
  [L, B, S, K]; block_mask [T, T], [B, T, T] or None (causal in the block).

  `block_k` (a power of two >= 16) is the KV tile, lowered to the largest power of two <= S for
  short caches. `num_splits` partitions the tiles over that many programs per (sequence, KV
  head) (flash-decoding); None picks ceil(S / split_len), capped at the number of tiles. Only
  checked in interpret mode (no GPU was available): see the module docstring.
  """
  b, t, h, d = q.shape
  acc, m, l = tree_attention_partials(
    q,
    k,
    v,
    start,
    block_mask,
    scale,
    block_k,
    interpret,
    layer=layer,
    k_scale=k_scale,
    v_scale=v_scale,
    num_splits=num_splits,
    split_len=split_len,
    page_table=page_table,
  )
  kv_heads = k.shape[-2]
  group = h // kv_heads
  out = combine_splits(acc, m, l)[:, :, : group * t]  # [B, K, G*T, D]
  out = out.reshape(b, kv_heads, group, t, d).transpose(0, 3, 1, 2, 4).reshape(b, t, h, d)
  return out.astype(q.dtype)


@functools.partial(jax.jit, static_argnames=_STATIC)
def tree_attention_partials(
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  start: jax.Array,
  block_mask: jax.Array | None,
  scale: float | None = None,
  block_k: int = 64,
  interpret: bool = False,
  *,
  layer: jax.Array | int | None = None,
  k_scale: jax.Array | None = None,
  v_scale: jax.Array | None = None,
  num_splits: int | None = None,
  split_len: int = DEFAULT_SPLIT_LEN,
  page_table: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """The kernel's per-split partials (m, l, acc), before `combine_splits`.

  Same arguments as `tree_attention_pallas`. Returns acc [B, K, N, R, D] (unnormalised) and
  m, l [B, K, N, R] for N partitions, row r = g * T + t of KV head k holding query head
  k * G + g (rows >= G * T are padding). A partition past a sequence's live length has
  m = MASK_VALUE, l = 0, acc = 0. For tests, and for callers that merge with other partials.
  """
  b, t, h, d = q.shape
  stacked = k.ndim == 5
  if stacked and layer is None:
    raise ValueError("k, v are a stacked [L, B, S, K, D] cache: pass layer=")
  if not stacked and layer is not None:
    raise ValueError("layer given but k, v have rank 4 (a single layer)")
  k = _as_stack(k, 4, stacked, "k")
  v = _as_stack(v, 4, stacked, "v")
  n_layers, s_len, kv_heads = k.shape[0], k.shape[2], k.shape[3]
  if v.shape != k.shape:
    raise ValueError(f"k {k.shape} and v {v.shape} differ")
  page_size = num_pages = 0
  if page_table is not None:  # k, v are pools [L, P, page, K, D]: S is the table's width
    num_pages, page_size = k.shape[1], k.shape[2]
    if page_size < 16 or page_size & (page_size - 1):
      raise ValueError(f"page size {page_size}: the paged kernel needs a power of two >= 16")
    if page_table.ndim != 2 or page_table.shape[0] != b:
      raise ValueError(f"page_table {page_table.shape}; expected [B={b}, pages per sequence]")
    s_len = page_table.shape[1] * page_size
  if h % kv_heads:
    raise ValueError(f"{h} query heads are not a multiple of {kv_heads} KV heads")
  group = h // kv_heads
  scale = d**-0.5 if scale is None else float(scale)
  layer_arr = jnp.zeros((1,), jnp.int32)
  if stacked:
    layer_arr = jnp.clip(jnp.asarray(layer, jnp.int32), 0, n_layers - 1).reshape(1)

  # Tile: a power of two <= S (the last tile is loaded from S − block_k, never out of bounds).
  if block_k < 16 or block_k & (block_k - 1):
    raise ValueError(f"block_k={block_k} must be a power of two >= 16")
  scales = [k_scale, v_scale]
  if s_len < 16 and not page_size:  # toy cache: pad (a copy) to one 16-slot tile
    pad = 16 - s_len
    k = jnp.pad(k, ((0, 0), (0, 0), (0, pad), (0, 0), (0, 0)))
    v = jnp.pad(v, ((0, 0), (0, 0), (0, pad), (0, 0), (0, 0)))
    scales = [
      None if x is None else jnp.pad(x, ((0, 0),) * (x.ndim - 2) + ((0, pad), (0, 0)))
      for x in scales
    ]
    s_len = 16
  block_k = min(block_k, _pow2_at_most(s_len), page_size or s_len)
  n_tiles = -(-s_len // block_k)
  if num_splits is None:
    num_splits = choose_num_splits(s_len, block_k, split_len)
  if num_splits < 1:
    raise ValueError(f"num_splits={num_splits} must be >= 1")
  tiles_per_split = -(-n_tiles // num_splits)
  num_splits = -(-n_tiles // tiles_per_split)  # no partition that is empty for every sequence

  # Queries of one KV group as rows r = g * T + t (a small copy of the block's queries).
  rows = _pow2_at_least(group * t, 16)
  qr = q.reshape(b, t, kv_heads, group, d).transpose(0, 2, 3, 1, 4).reshape(b, kv_heads, -1, d)
  qr = jnp.pad(qr, ((0, 0), (0, 0), (0, rows - group * t), (0, 0)))

  row_spec = lambda *shape: pl.BlockSpec(shape, lambda i, j, s: (i, j) + (0,) * (len(shape) - 2))
  kv_spec = pl.BlockSpec((n_layers, None, s_len, None, d), lambda i, j, s: (0, i, 0, j, 0))
  scale_spec = pl.BlockSpec((n_layers, None, s_len, None), lambda i, j, s: (0, i, 0, j))
  if page_size:  # the whole pool of this KV head: pages are picked in the kernel
    pool = (n_layers, num_pages, page_size)
    kv_spec = pl.BlockSpec(pool + (None, d), lambda i, j, s: (0, 0, 0, j, 0))
    scale_spec = pl.BlockSpec(pool + (None,), lambda i, j, s: (0, 0, 0, j))
  in_specs = [
    pl.BlockSpec((1,), lambda i, j, s: (0,)),  # layer
    pl.BlockSpec((b,), lambda i, j, s: (0,)),  # start
    row_spec(None, None, rows, d),  # q rows of this KV group
    kv_spec,
    kv_spec,
  ]
  operands = [layer_arr, start.astype(jnp.int32), qr, k, v]
  if page_size:
    in_specs.append(pl.BlockSpec(page_table.shape, lambda i, j, s: (0, 0)))
    operands.append(page_table.astype(jnp.int32))
  for name, x in zip(("k_scale", "v_scale"), scales):
    if x is not None:
      x = _as_stack(x, 3, stacked, name)
      if x.shape != k.shape[:4]:
        raise ValueError(f"{name} {x.shape} does not match the cache {k.shape[:4]}")
      in_specs.append(scale_spec)
      operands.append(x.astype(jnp.float32))

  causal = block_mask is None
  if not causal:
    tp = _pow2_at_least(t, 16)
    if block_mask.ndim == 2:
      block_mask = block_mask[None]
    if block_mask.shape[1:] != (t, t):
      raise ValueError(f"block_mask {block_mask.shape}; expected [T, T] or [B, T, T], T={t}")
    mb = block_mask.shape[0]
    if mb not in (1, b):
      raise ValueError(f"block_mask batch {mb} is neither 1 nor B={b}")
    # Row r = g * T + t uses mask row t; padded rows and columns see nothing.
    mask = jnp.tile(block_mask.astype(jnp.float32), (1, group, 1))
    mask = jnp.pad(mask, ((0, 0), (0, rows - group * t), (0, tp - t)))
    in_specs.append(pl.BlockSpec((None, rows, tp), lambda i, j, s: (i if mb > 1 else 0, 0, 0)))
    operands.append(mask)

  kernel = functools.partial(
    _kernel,
    scale=scale,
    block_len=t,
    block_k=block_k,
    cache_len=s_len,
    tiles_per_split=tiles_per_split,
    causal=causal,
    k_quant=k_scale is not None,
    v_quant=v_scale is not None,
    page_size=page_size,
    num_pages=num_pages,
  )
  part = (b, kv_heads, num_splits, rows)
  return pl.pallas_call(
    kernel,
    grid=(b, kv_heads, num_splits),
    in_specs=in_specs,
    out_specs=[
      pl.BlockSpec((None, None, None, rows, d), lambda i, j, s: (i, j, s, 0, 0)),
      pl.BlockSpec((None, None, None, rows), lambda i, j, s: (i, j, s, 0)),
      pl.BlockSpec((None, None, None, rows), lambda i, j, s: (i, j, s, 0)),
    ],
    out_shape=[
      jax.ShapeDtypeStruct(part + (d,), jnp.float32),
      jax.ShapeDtypeStruct(part, jnp.float32),
      jax.ShapeDtypeStruct(part, jnp.float32),
    ],
    interpret=interpret,
    # Triton, not JAX 0.10's default Mosaic GPU (jax_pallas_use_mosaic_gpu), which cannot lower
    # this kernel; Triton's default warps and stages.
    compiler_params=pltriton.CompilerParams(),
    name="tree_attention",
  )(*operands)
