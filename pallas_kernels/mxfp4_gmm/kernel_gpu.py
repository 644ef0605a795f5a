"""MXFP4 grouped expert matmul as a Pallas kernel (GPU-style: Triton lowering).

  y[m, :] = x[m, :] @ W[g(m)],   x [M, K], W [E, K, N] in MXFP4, rows grouped by expert

Grid (E, N / block_n): program (g, j) computes output columns j·bn .. j·bn + bn − 1 for the rows
of group g. The group's first row and end (an exclusive cumsum of group_sizes, clipped to M,
computed in jnp outside the kernel) come in as two small int32 operands read with scalar loads;
scalar prefetch, which would let a BlockSpec index_map use them, is not implemented by the
Triton lowering. The program walks its group's rows in tiles of block_m rows (a dynamic trip
count, ceil(size / bm); zero for an empty group) and, per row tile, K in tiles of block_k
(a multiple of 32): it loads the packed bytes [bn, bk/32, 16] and E8M0 scales [bn, bk/32] of
expert g, dequantizes them in registers by integer arithmetic (decode.py: no lookup table, no
gather; the nibbles are interleaved back into K order with a last-axis stack, Triton's tt.join),
casts the [bn, bk] tile to x's dtype (exact: E2M1 times a power of two) and accumulates
x[bm, bk] · tileᵀ in float32 (`lax.dot_general` contracting both operands' last axes).

Masking: groups are not tile aligned, so each row tile is written with a masked store
(`pallas.triton.store(..., mask=)`) of the rows that are in the group and not yet written; the
rows of other groups in the same tile are left to their own programs, so no two programs write
the same row and there is no read-modify-write race. A row tile that would run past M is loaded
from row M − bm instead (clamped, as tree_attention clamps its last KV tile) with its rows
before the intended start masked out; so x is never padded or copied except when M < 16 (a toy
input, padded to one 16-row tile). Rows past sum(group_sizes) belong to no group: the last
group's program writes zeros there (a store, no dot), so every output row is written exactly
once per column tile and the output needs no zero fill.

Tiling constraints (Triton): every loaded shape is a power of two and dot operands are at least
16 wide, so block_m, block_n >= 16 and block_k >= 32 are powers of two; block_n must divide N
and block_k must divide K (they are lowered to the largest power of two that does, which is
< 16 for N not a multiple of 16: refused). block_m is lowered to a power of two <= M.

Bytes moved per call (HBM): for each group with rows, its expert's packed weights once per row
tile of the group and column tile: ceil(size_g / bm) · N · K · 17/32 bytes (values K/2 + scales
K/32 per output column: 4.25 bits per weight), re-reads of a large group's expert by its later
row tiles may hit L2; x's rows once per column tile, M · K · itemsize · N / bn (L2-shared
between the column programs of a group); the output once, M · N · itemsize. The dequantized
weights exist only as a [bn, bk] register tile: the [E, K, N] stack that the XLA path
materializes (E · K · N · itemsize bytes, written and read back unless XLA fuses the
dequantization into its dot) never reaches HBM. In the
decode / verify regime (a few rows per expert, one row tile each), the weight bytes are those
of the experts that received a token, at 4.25 bits per weight.

Output dtype: preferred_element_type, else x's dtype; x may be float32 or bfloat16. float32
dots lower to IEEE (not TF32) precision with Triton's default.

Status: checked only in interpret mode (`interpret=True`, on CPU) against reference.py, and
lowered to Triton IR on CPU (`jax.jit(...).trace(...).lower(lowering_platforms=("cuda",))`),
which catches unsupported primitives and shapes but does not compile to PTX; no GPU was
available when it was written. The pallas_call passes `pallas.triton.CompilerParams`
explicitly: without compiler params JAX 0.10 lowers pallas_call on GPU with Mosaic GPU, not
Triton (`jax_pallas_use_mosaic_gpu` defaults to True), and this kernel is written for Triton.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.mxfp4_gmm.decode import dequantize_tile
from pallas_kernels.mxfp4_gmm.reference import MX_BLOCK, PACKED, check_inputs, out_dtype

MIN_ROWS = 16  # Triton dot operands are at least 16 wide


def _kernel(
  starts_ref, ends_ref, x_ref, v_ref, s_ref, o_ref, *, num_groups, rows, block_m, block_k, k_dim
):
  g = pl.program_id(0)
  start = starts_ref[g]
  end = ends_ref[g]
  bn = o_ref.shape[1]
  nb = block_k // MX_BLOCK
  row_ids = jax.lax.broadcasted_iota(jnp.int32, (block_m, bn), 0)

  def k_step(kt, acc, r0):
    k0 = pl.multiple_of(kt * block_k, block_k)
    b0 = pl.multiple_of(kt * nb, nb)
    x = x_ref[pl.ds(r0, block_m), pl.ds(k0, block_k)]  # [bm, bk]
    w = dequantize_tile(v_ref[:, pl.ds(b0, nb), :], s_ref[:, pl.ds(b0, nb)]).astype(x.dtype)
    return acc + jax.lax.dot_general(
      x, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32
    )  # [bm, bk] · [bn, bk]ᵀ

  def row_tile(i, carry):
    first = start + i * block_m  # this tile's rows are first .. first + bm − 1, up to end
    r0 = jnp.minimum(first, rows - block_m)  # clamped: never reads or writes past M
    acc = jax.lax.fori_loop(
      0, k_dim // block_k, functools.partial(k_step, r0=r0), jnp.zeros((block_m, bn), jnp.float32)
    )
    row = r0 + row_ids
    mask = (row >= first) & (row < end)
    pltriton.store(o_ref.at[pl.ds(r0, block_m), :], acc.astype(o_ref.dtype), mask=mask)
    return carry

  jax.lax.fori_loop(0, pl.cdiv(end - start, block_m), row_tile, 0)

  # Rows past sum(group_sizes): zeros, written by the last group's program.
  def tail_tile(i, carry):
    first = end + i * block_m
    r0 = jnp.minimum(first, rows - block_m)
    mask = r0 + row_ids >= first
    pltriton.store(
      o_ref.at[pl.ds(r0, block_m), :], jnp.zeros((block_m, bn), o_ref.dtype), mask=mask
    )
    return carry

  n_tail = jnp.where(g == num_groups - 1, pl.cdiv(rows - end, block_m), 0)
  jax.lax.fori_loop(0, n_tail, tail_tile, 0)


def pow2_at_most(n: int) -> int:
  p = 1
  while p * 2 <= n:
    p *= 2
  return p


def pow2_at_least(n: int) -> int:
  p = 1
  while p < n:
    p *= 2
  return p


def pow2_dividing(n: int, cap: int) -> int:
  """The largest power of two <= cap that divides n."""
  p = 1
  while p * 2 <= cap and n % (p * 2) == 0:
    p *= 2
  return p


def check_pow2(name: str, value: int, floor: int) -> None:
  if value < floor or value & (value - 1):
    raise ValueError(f"{name}={value} must be a power of two >= {floor}")


def group_bounds(group_sizes: jax.Array, rows: int) -> tuple[jax.Array, jax.Array]:
  """int32 [E] first row and end row of each group (an exclusive cumsum), clipped to [0, rows]."""
  ends = jnp.cumsum(jnp.maximum(group_sizes.astype(jnp.int32), 0))
  starts = ends - jnp.maximum(group_sizes.astype(jnp.int32), 0)
  return jnp.minimum(starts, rows), jnp.minimum(ends, rows)


_STATIC = ("preferred_element_type", "block_m", "block_n", "block_k", "interpret", "num_warps")


@functools.partial(jax.jit, static_argnames=_STATIC)
def mxfp4_gmm_gpu(
  x: jax.Array,
  values: jax.Array,
  scales: jax.Array,
  group_sizes: jax.Array,
  *,
  preferred_element_type: Any = None,
  block_m: int = 64,
  block_n: int = 64,
  block_k: int = 128,
  interpret: bool = False,
  num_warps: int = 4,
) -> jax.Array:
  """Same contract as `reference.mxfp4_gmm_reference`: x [M, K] float32/bfloat16, values uint8
  [E, N, K/32, 16], scales uint8 [E, N, K/32], group_sizes int [E] → [M, N].

  block_m (power of two >= 16, lowered to <= M), block_n (power of two >= 16, lowered to the
  largest power of two dividing N) and block_k (power of two >= 32, lowered to the largest
  power of two dividing K) are the tiles. Only checked in interpret mode and by lowering to
  Triton IR (no GPU was available): see the module docstring.
  """
  m, k_dim, n, e = check_inputs(x, values, scales, group_sizes)
  check_pow2("block_m", block_m, MIN_ROWS)
  check_pow2("block_n", block_n, MIN_ROWS)
  check_pow2("block_k", block_k, MX_BLOCK)
  bn = pow2_dividing(n, block_n)
  if bn < MIN_ROWS:
    raise ValueError(f"N={n} must be a multiple of {MIN_ROWS} for the Pallas kernel")
  bk = pow2_dividing(k_dim, block_k)  # >= 32: K is a multiple of 32
  dtype = out_dtype(x, preferred_element_type)

  rows = max(m, MIN_ROWS)
  if rows > m:  # toy input: pad to one 16-row tile (the only copy of x)
    x = jnp.pad(x, ((0, rows - m), (0, 0)))
  bm = min(block_m, pow2_at_most(rows))
  starts, ends = group_bounds(group_sizes, m)
  # Small int32 operands, padded to a power-of-two length (Triton loads); read by scalar loads.
  e_pad = pow2_at_least(e)
  starts = jnp.pad(starts, (0, e_pad - e))
  ends = jnp.pad(ends, (0, e_pad - e))

  n_blocks = k_dim // MX_BLOCK
  kernel = functools.partial(_kernel, num_groups=e, rows=rows, block_m=bm, block_k=bk, k_dim=k_dim)
  out = pl.pallas_call(
    kernel,
    grid=(e, n // bn),
    in_specs=[
      pl.BlockSpec((e_pad,), lambda g, j: (0,)),
      pl.BlockSpec((e_pad,), lambda g, j: (0,)),
      pl.BlockSpec((rows, k_dim), lambda g, j: (0, 0)),  # whole x: a base pointer in Triton
      pl.BlockSpec((None, bn, n_blocks, PACKED), lambda g, j: (g, j, 0, 0)),
      pl.BlockSpec((None, bn, n_blocks), lambda g, j: (g, j, 0)),
    ],
    out_specs=pl.BlockSpec((rows, bn), lambda g, j: (0, j)),
    out_shape=jax.ShapeDtypeStruct((rows, n), dtype),
    compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=2),
    interpret=interpret,
    name="mxfp4_gmm",
  )(starts, ends, x, values, scales)
  return out[:m] if rows > m else out
