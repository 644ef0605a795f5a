"""MXFP4 grouped expert matmul as a Mosaic-TPU-style Pallas kernel (megablox-like).

  y[m, :] = x[m, :] @ W[g(m)],   x [M, K], W [E, K, N] in MXFP4, rows grouped by expert

Grid (N / bn, V, K / bk) with V = ceil(M / bm) + E − 1 "visits". A visit is one (row tile,
group) pair: a row tile that straddles a group boundary is visited once per group in it, and
the tiles past sum(group_sizes) are visited once with no group; V bounds the count (each
nonempty group but the first adds at most one shared tile), and unused visits at the end repeat
the last tile and change nothing. The visit list is computed in jnp outside the kernel from
group_sizes and handed to the kernel as scalar prefetch (`pltpu.PrefetchScalarGridSpec`): the
groups' first and end rows, and per visit its expert, its row tile and two flags (compute: a
group visit; first: the tile's first visit). The BlockSpec index maps read them, so the x tile
(row tile, k), the packed weight tile (expert, n tile, k) and the output tile (row tile, n tile)
are DMA'd by Pallas' pipeline. Visits without a group keep the previous visit's expert and the
last k tile as their block indices, so they fetch no weights. The k axis is innermost: a VMEM
float32 scratch [bm, bn] accumulates the dots, zeroed at k = 0 and stored at the last k.

Output masking: the visits of one row tile are consecutive (groups are in row order), so its
output block stays in VMEM across them and is written back once. Each group visit stores its
own rows (start_g <= row < end_g) and keeps the others, except that the tile's first visit
writes zeros there instead (the buffer starts uninitialized), so rows of later groups are
filled by their visits and rows past sum(group_sizes) stay 0. The grid's n axis is "parallel"
(megacore may split it); visits and k are "arbitrary" (sequential: the revisits rely on it).

Data layout: TPU has no FP4 or E8M0 type. The packed values are viewed as uint8 [E, N, K/2]
(a free reshape: byte p of a row holds elements 2p (low nibble) and 2p + 1 (high nibble)), so a
weight tile [bn, bk/2] is lane dense. Interleaving the two nibbles back into K order would be a
lane shuffle, so instead x is split once in jnp into its even and odd columns, x_even and
x_odd [M, K/2] (an activation copy, M · K elements, which XLA may fuse into the gather that
builds the sorted rows), and the kernel computes x_even · W_loᵀ + x_odd · W_hiᵀ. The E8M0 scales
([E, N, K/32], one per 32 elements) must be widened along the lanes to one per byte: the
kernel reads the n tile's whole scale row [bn, K/32] (constant across k, fetched once per
visit) and widens it with a one-hot matmul, scales [bn, K/32] · onehot [K/32, bk/2] with
onehot[b, p] = (b == k · bk/32 + p // 16), exact on the MXU (integers 0..255 times 0/1, one
nonzero term: exact even in a single bfloat16 pass). The per-element float32 bit pattern is then
built by integer arithmetic from code and scale (decode.py; E2M1 sign / exponent / mantissa bits,
exponent s − 127 added in the integer domain, one bitcast), cast to x's dtype (exact) and fed to
the MXU with float32 accumulation. TPUs flush subnormals, so the scale s = 0 (2^−127) and any
product below 2^−126 act as 0 on hardware (decode.py builds them exactly; interpret mode on CPU
flushes them in the dot, as the oracle's dot does).

Tiling (Mosaic's (8, 128) rule): bn a multiple of 128 dividing N, or N itself; bk a multiple of
256 dividing K (bk/2 lane-dense bytes), or K itself; bm a multiple of 16 (bfloat16 sublane
packing). gpt-oss's 2880 (= 2^6 · 45) admits neither a 128-multiple n tile nor a 256-multiple k
tile: there bn = N and bk = K would be whole-matrix blocks, far too large for VMEM; such
weights need N padded to a multiple of 128 at load (not done here). x is padded (a copy) to a
whole number of bm-row tiles.

Bytes moved per call (HBM): per n tile, each visit's expert weight tile once over k: at most
(ceil(M / bm) + E − 1) · N · K · 17/32 bytes (values K/2 + scales K/32 per column: 4.25 bits per
weight), and only the experts that received rows; x_even / x_odd once per visit and n tile;
the output once. The dequantized weights exist only as a [bn, bk] VMEM tile; the [E, K, N] stack
that the XLA path materializes never reaches HBM.

Status: NOT run on a TPU, and NOT compiled by Mosaic (layout inference and the TPU compiler run
only with a TPU). Checked in interpret mode on CPU against reference.py, both with
`interpret=True` (the generic interpreter) and with `interpret=pltpu.InterpretParams()` (the
TPU interpreter: simulated DMAs and VMEM with uninitialized buffers filled with NaN, which
exercises the first-visit zeroing), and lowered to Mosaic MLIR on CPU
(`.lower(lowering_platforms=("tpu",))`). Whether Mosaic accepts the one-hot matmul's small
contraction (K/32) and the uint8 → int32 nibble arithmetic on a given TPU generation is not
known until it runs on one.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.mxfp4_gmm.decode import mxfp4_to_f32
from pallas_kernels.mxfp4_gmm.reference import MX_BLOCK, check_inputs, out_dtype

COMPUTE = 1  # visit flag: a group visit (dot and store its rows)
FIRST = 2  # visit flag: the row tile's first visit (zero the rows it does not own)


def group_metadata(
  group_sizes: jax.Array, rows: int, block_m: int
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array]:
  """The visit list: (starts [E], ends [E], group_ids [V], row_tiles [V], flags [V]), int32.

  rows is the true M; V = ceil(rows / bm) + E − 1. Group g owns rows starts[g] .. ends[g] − 1
  (clipped to [0, rows]). Visits are the (row tile, group) pairs in row order, then the tiles
  past sum(group_sizes) (no group), then repeats of the last tile (flags 0).
  """
  e = group_sizes.shape[0]
  tiles_m = -(-rows // block_m)
  num_visits = tiles_m + e - 1
  sizes = jnp.maximum(group_sizes.astype(jnp.int32), 0)
  cum = jnp.cumsum(sizes)
  ends = jnp.minimum(cum, rows)
  starts = jnp.minimum(cum - sizes, rows)
  first_tile = starts // block_m
  count = jnp.where(ends > starts, (ends - 1) // block_m - first_tile + 1, 0)
  ccount = jnp.cumsum(count)
  n_group = ccount[-1]
  v = jnp.arange(num_visits, dtype=jnp.int32)
  gv = jnp.minimum(jnp.searchsorted(ccount, v, side="right"), e - 1).astype(jnp.int32)
  is_group = v < n_group
  tile_group = first_tile[gv] + v - (ccount[gv] - count[gv])
  covered = -(-ends[-1] // block_m)  # tiles holding a row < sum(group_sizes)
  tail = v - n_group
  is_tail = ~is_group & (tail < tiles_m - covered)
  row_tiles = jnp.where(is_group, tile_group, jnp.where(is_tail, covered + tail, tiles_m - 1))
  last_gid = jnp.minimum(jnp.searchsorted(ccount, n_group - 1, side="right"), e - 1)
  group_ids = jnp.where(is_group, gv, last_gid).astype(jnp.int32)
  first = jnp.concatenate([jnp.ones((1,), bool), row_tiles[1:] != row_tiles[:-1]])
  flags = jnp.where(is_group, COMPUTE, 0) | jnp.where(first, FIRST, 0)
  return starts, ends, group_ids, row_tiles.astype(jnp.int32), flags.astype(jnp.int32)


def _kernel(
  starts_ref,
  ends_ref,
  gid_ref,
  tile_ref,
  flags_ref,
  xe_ref,
  xo_ref,
  v_ref,
  s_ref,
  o_ref,
  acc_ref,
  *,
  block_k,
  num_k,
):
  vi = pl.program_id(1)
  kt = pl.program_id(2)
  flags = flags_ref[vi]
  compute = (flags & COMPUTE) != 0

  @pl.when(kt == 0)
  def _():
    acc_ref[...] = jnp.zeros_like(acc_ref)

  @pl.when(compute)
  def _():
    half = block_k // 2  # bytes of the tile (two elements each)
    n_scales = s_ref.shape[1]
    # Widen the scales [bn, K/32] to one per byte of this k tile: [bn, bk/2] (exact, see above).
    blk = jax.lax.broadcasted_iota(jnp.int32, (n_scales, half), 0)
    byte = jax.lax.broadcasted_iota(jnp.int32, (n_scales, half), 1)
    onehot = (blk == kt * (block_k // MX_BLOCK) + (byte >> 4)).astype(jnp.float32)  # byte // 16
    s = s_ref[...].astype(jnp.int32).astype(jnp.float32)
    s = jnp.dot(s, onehot, preferred_element_type=jnp.float32).astype(jnp.int32)
    b = v_ref[...].astype(jnp.int32)  # [bn, bk/2]
    xe = xe_ref[...]
    xo = xo_ref[...]
    w_lo = mxfp4_to_f32(b & 0x0F, s).astype(xe.dtype)  # elements 2p
    w_hi = mxfp4_to_f32((b >> 4) & 0x0F, s).astype(xo.dtype)  # elements 2p + 1
    nt = (((1,), (1,)), ((), ()))  # [bm, bk/2] · [bn, bk/2]ᵀ
    acc_ref[...] += jax.lax.dot_general(
      xe, w_lo, nt, preferred_element_type=jnp.float32
    ) + jax.lax.dot_general(xo, w_hi, nt, preferred_element_type=jnp.float32)

  @pl.when(kt == num_k - 1)
  def _():
    bm, bn = o_ref.shape
    g = gid_ref[vi]
    row = tile_ref[vi] * bm + jax.lax.broadcasted_iota(jnp.int32, (bm, bn), 0)
    mine = compute & (row >= starts_ref[g]) & (row < ends_ref[g])
    first = (flags & FIRST) != 0
    keep = jnp.where(first, jnp.zeros((bm, bn), o_ref.dtype), o_ref[...])
    o_ref[...] = jnp.where(mine, acc_ref[...].astype(o_ref.dtype), keep)


def _pick_tile(name: str, dim: int, want: int, multiple: int) -> int:
  """want if it divides dim and is a multiple of `multiple`, else the largest such tile below
  want, else dim itself (a whole-axis block, always legal)."""
  if want < 1:
    raise ValueError(f"{name}={want} must be positive")
  for t in range(min(want, dim) // multiple * multiple, 0, -multiple):
    if dim % t == 0:
      return t
  return dim


_STATIC = ("preferred_element_type", "block_m", "block_n", "block_k", "interpret")


@functools.partial(jax.jit, static_argnames=_STATIC)
def mxfp4_gmm_tpu(
  x: jax.Array,
  values: jax.Array,
  scales: jax.Array,
  group_sizes: jax.Array,
  *,
  preferred_element_type: Any = None,
  block_m: int = 128,
  block_n: int = 128,
  block_k: int = 512,
  interpret: Any = False,
) -> jax.Array:
  """Same contract as `reference.mxfp4_gmm_reference` (x [M, K], values uint8 [E, N, K/32, 16],
  scales uint8 [E, N, K/32], group_sizes int [E] → [M, N]).

  block_m: a multiple of 16. block_n / block_k: lowered to the largest multiple of 128 / 256
  dividing N / K, or the whole axis when there is none (see the module docstring). `interpret`
  is passed to pallas_call: False, True (generic interpreter) or a `pltpu.InterpretParams`.
  Never run on a TPU: see the module docstring.
  """
  m, k_dim, n, e = check_inputs(x, values, scales, group_sizes)
  if block_m < 16 or block_m % 16:
    raise ValueError(f"block_m={block_m} must be a positive multiple of 16")
  bn = _pick_tile("block_n", n, block_n, 128)
  bk = _pick_tile("block_k", k_dim, block_k, 2 * 128)
  bm = min(block_m, -(-m // 16) * 16)
  tiles_m = -(-m // bm)
  rows = tiles_m * bm
  num_k = k_dim // bk
  dtype = out_dtype(x, preferred_element_type)

  meta = group_metadata(group_sizes, m, bm)
  num_visits = meta[2].shape[0]
  pairs = jnp.pad(x, ((0, rows - m), (0, 0))).reshape(rows, k_dim // 2, 2)
  x_even, x_odd = pairs[..., 0], pairs[..., 1]
  packed = values.reshape(e, n, k_dim // 2)  # free: byte p holds elements 2p, 2p + 1

  def kk(k, flags_ref, vi):  # non-group visits stay on the last k tile: nothing re-fetched
    return jnp.where((flags_ref[vi] & COMPUTE) != 0, k, num_k - 1)

  def x_map(j, vi, k, starts, ends, gid, tile, flags):
    return tile[vi], kk(k, flags, vi)

  def w_map(j, vi, k, starts, ends, gid, tile, flags):
    return gid[vi], j, kk(k, flags, vi)

  def s_map(j, vi, k, starts, ends, gid, tile, flags):
    return gid[vi], j, 0

  def o_map(j, vi, k, starts, ends, gid, tile, flags):
    return tile[vi], j

  grid_spec = pltpu.PrefetchScalarGridSpec(
    num_scalar_prefetch=5,
    grid=(n // bn, num_visits, num_k),
    in_specs=[
      pl.BlockSpec((bm, bk // 2), x_map),
      pl.BlockSpec((bm, bk // 2), x_map),
      pl.BlockSpec((None, bn, bk // 2), w_map),
      pl.BlockSpec((None, bn, k_dim // MX_BLOCK), s_map),
    ],
    out_specs=pl.BlockSpec((bm, bn), o_map),
    scratch_shapes=[pltpu.VMEM((bm, bn), jnp.float32)],
  )
  out = pl.pallas_call(
    functools.partial(_kernel, block_k=bk, num_k=num_k),
    grid_spec=grid_spec,
    out_shape=jax.ShapeDtypeStruct((rows, n), dtype),
    compiler_params=pltpu.CompilerParams(
      dimension_semantics=("parallel", "arbitrary", "arbitrary")
    ),
    interpret=interpret,
    name="mxfp4_gmm_tpu",
  )(*meta, x_even, x_odd, packed, scales)
  return out[:m] if rows > m else out
