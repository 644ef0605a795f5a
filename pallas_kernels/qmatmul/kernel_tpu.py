"""Dense quantized matmul as a Mosaic-TPU-style Pallas kernel, reading the stored bytes.

  y[M, N] = x[M, K] @ W[K, N]   (float32 out; formats and layouts as in reference.py)

Grid (ceil(N / bn), rows / bm, ceil(K / bk)), K innermost: BlockSpecs DMA the x tile and the
stored weight tile into VMEM, the kernel dequantizes the weight tile in VMEM / vregs and adds its
dot with the x tile to a float32 VMEM scratch [bm, bn], zeroed at k = 0 and written out at the
last k. The n and m axes are "parallel", k "arbitrary".

* "float":     values [K, N] tile [bk, bn], cast to float32.
* "fp8":       bytes [K, N] tile [bk, bn] (e4m3 viewed as uint8, a bitcast), decoded by integer
               arithmetic (kernel_gpu.e4m3_to_f32), times the column scales [1, bn] (VMEM).
* "fp8_block": bytes [N, K] tile [bn, bk], decoded, times its per-element scale. The scales
               (float32, flattened) sit whole in SMEM; the tile's scale is built by a static loop
               over the scale blocks it can touch (range compares and selects: no gather, no
               division), so the tiles need not align with the scale blocks (bo × bi).
* "mxfp4":     as mxfp4_gmm/kernel_tpu.py: bytes viewed as [N, K/2] (lane dense), x split in jnp
               into even and odd columns [rows, K/2], the E8M0 scale row [bn, K/32] widened to one
               per byte with an exact one-hot matmul, codes decoded by mxfp4_gmm's `mxfp4_to_f32`,
               and y = x_even · W_loᵀ + x_odd · W_hiᵀ.

Tiling ((8, 128) rule): bn = N when N <= block_n, else block_n (a multiple of 128); bk likewise
(a multiple of 128; of 256 for mxfp4, whose tile is bk/2 bytes wide). N and K need not be
multiples of the tiles: the last weight tile is partial, and its elements past K (whatever the
DMA left there) are replaced by 0 after decoding; columns past N are dropped on the write. x is
cast to float32 and padded with zeros to rows × ceil(K / bk) · bk, rows = M rounded up to 8
(sublanes), or to a multiple of bm (<= block_m) for large M; that is the only copy.

Bytes read per call (HBM): the weight once per row tile, ceil(rows / bm) · (K · N · b + scales)
with b = 4 / 2 (float32 / bfloat16), 1 (fp8; + 4 N scale bytes, once per row tile and n tile),
1 (fp8_block; + the whole scale array, 4 · ceil(N/bo) · ceil(K/bi), into SMEM per program), 17/32
(mxfp4: K/2 + K/32 bytes per column); x (float32, padded) once per n tile, 4 · rows · K' ·
ceil(N / bn); the float32 output once. In decode / verify (M <= block_m) the weight bytes are
read once. The dequantized weight exists only as a [bk, bn] VMEM tile, never in HBM.

Status: NOT run on a TPU and NOT compiled by Mosaic (that needs a TPU). Checked in interpret mode
on CPU against reference.py (`interpret=True` and `pltpu.InterpretParams()`, whose buffers start
as NaN) and lowered to Mosaic MLIR on CPU (`.lower(lowering_platforms=("tpu",))`). Unknowns for
hardware: Mosaic's acceptance of the uint8 → int32 arithmetic, the one-hot matmul's small
contraction (mxfp4), and an SMEM scale array for very large fp8_block weights (a 7168 × 18432
weight with 128 × 128 blocks has 8064 scales, 32 KiB).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.mxfp4_gmm.decode import mxfp4_to_f32
from pallas_kernels.qmatmul.kernel_gpu import as_bytes, e4m3_to_f32
from pallas_kernels.qmatmul.reference import DEFAULT_BLOCK, check_inputs

MX_BLOCK = 32  # elements per MXFP4 scale
SUBLANES = 8
LANES = 128
HIGHEST = jax.lax.Precision.HIGHEST
NT = (((1,), (1,)), ((), ()))  # [bm, c] · [bn, c]ᵀ


def _iota(shape: tuple[int, int], axis: int) -> jax.Array:
  return jax.lax.broadcasted_iota(jnp.int32, shape, axis)


def _kernel(*refs, fmt, k_dim, block_k, num_k, scale_block, scale_grid):
  if fmt == "float":
    x_ref, v_ref, o_ref, acc_ref = refs
  elif fmt == "mxfp4":
    x_ref, xo_ref, v_ref, s_ref, o_ref, acc_ref = refs
  else:
    x_ref, v_ref, s_ref, o_ref, acc_ref = refs
  kt = pl.program_id(2)
  k0 = kt * block_k

  @pl.when(kt == 0)
  def _():
    acc_ref[...] = jnp.zeros_like(acc_ref)

  x = x_ref[...]  # float32 [bm, bk] (bk/2 for mxfp4), zero padded
  if fmt in ("float", "fp8"):
    v = v_ref[...]  # [bk, bn]
    w = v.astype(jnp.float32) if fmt == "float" else e4m3_to_f32(v.astype(jnp.int32))
    if fmt == "fp8":
      w = w * s_ref[...]  # [1, bn]
    w = jnp.where(k0 + _iota(w.shape, 0) < k_dim, w, 0.0)
    acc_ref[...] += jnp.dot(x, w, preferred_element_type=jnp.float32, precision=HIGHEST)
  elif fmt == "fp8_block":
    w = e4m3_to_f32(v_ref[...].astype(jnp.int32))  # [bn, bk]
    bn = w.shape[0]
    bo, bi = scale_block
    nbo, nbi = scale_grid
    n0 = pl.program_id(0) * bn
    row = n0 + _iota(w.shape, 0)
    col = k0 + _iota(w.shape, 1)
    scale = jnp.zeros(w.shape, jnp.float32)
    for da in range((bn - 1) // bo + 2):  # the scale blocks this tile can overlap
      a = jnp.minimum(jax.lax.div(n0, bo) + da, nbo - 1)  # n0 >= 0: no floor sign fixup
      in_a = (row >= a * bo) & (row < (a + 1) * bo)
      for db in range((block_k - 1) // bi + 2):
        b = jnp.minimum(jax.lax.div(k0, bi) + db, nbi - 1)
        hit = in_a & (col >= b * bi) & (col < (b + 1) * bi)
        scale = jnp.where(hit, s_ref[a * nbi + b], scale)
    w = jnp.where(col < k_dim, w * scale, 0.0)
    acc_ref[...] += jax.lax.dot_general(
      x, w, NT, preferred_element_type=jnp.float32, precision=HIGHEST
    )
  else:  # mxfp4
    half = block_k // 2  # bytes of the tile, two elements each
    n_scales = s_ref.shape[1]
    blk = _iota((n_scales, half), 0)
    byte = _iota((n_scales, half), 1)
    onehot = (blk == kt * (block_k // MX_BLOCK) + (byte >> 4)).astype(jnp.float32)
    s = s_ref[...].astype(jnp.int32).astype(jnp.float32)  # [bn, K/32]
    s = jnp.dot(s, onehot, preferred_element_type=jnp.float32).astype(jnp.int32)  # exact
    b = v_ref[...].astype(jnp.int32)  # [bn, bk/2]
    inside = kt * half + _iota(b.shape, 1) < k_dim // 2
    w_lo = jnp.where(inside, mxfp4_to_f32(b & 0x0F, s), 0.0)  # elements 2p
    w_hi = jnp.where(inside, mxfp4_to_f32((b >> 4) & 0x0F, s), 0.0)  # elements 2p + 1
    dot = functools.partial(
      jax.lax.dot_general, dimension_numbers=NT, preferred_element_type=jnp.float32,
      precision=HIGHEST,
    )
    acc_ref[...] += dot(x, w_lo) + dot(xo_ref[...], w_hi)

  @pl.when(kt == num_k - 1)
  def _():
    o_ref[...] = acc_ref[...]


def _tile(name: str, dim: int, want: int, multiple: int) -> int:
  """The whole axis when it fits in `want`, else `want` (which must be a multiple)."""
  if dim <= want:
    return dim
  if want < multiple or want % multiple:
    raise ValueError(f"{name}={want} must be a positive multiple of {multiple}")
  return want


_STATIC = ("fmt", "block", "interpret", "block_m", "block_n", "block_k")


@functools.partial(jax.jit, static_argnames=_STATIC)
def qmatmul_tpu(
  x: jax.Array,
  values: jax.Array,
  scales: Any,
  fmt: str,
  block: tuple[int, int] = DEFAULT_BLOCK,
  interpret: Any = False,
  *,
  block_m: int = 256,
  block_n: int = 256,
  block_k: int = 512,
) -> jax.Array:
  """x [M, K] @ the stored weight → float32 [M, N] (reference.py's formats and contract).

  block is fp8_block's scale block (bo, bi). block_m (a multiple of 8), block_n (a multiple of
  128) and block_k (of 128; of 256 for mxfp4) are the tiles, used whole-axis when the axis is no
  larger. `interpret`: False, True or a `pltpu.InterpretParams`. Never run on a TPU: see the
  module docstring.
  """
  m, k_dim, n = check_inputs(x, values, scales, fmt, block)
  if block_m < SUBLANES or block_m % SUBLANES:
    raise ValueError(f"block_m={block_m} must be a positive multiple of {SUBLANES}")
  rows = -(-m // SUBLANES) * SUBLANES
  bm = min(block_m, rows)
  rows = -(-rows // bm) * bm
  bn = _tile("block_n", n, block_n, LANES)
  bk = _tile("block_k", k_dim, block_k, 2 * LANES if fmt == "mxfp4" else LANES)
  num_k = -(-k_dim // bk)
  x = jnp.pad(x.astype(jnp.float32), ((0, rows - m), (0, num_k * bk - k_dim)))
  grid = (-(-n // bn), rows // bm, num_k)
  bo, bi = block
  scale_grid = (-(-n // bo), -(-k_dim // bi))

  if fmt == "mxfp4":
    pairs = x.reshape(rows, -1, 2)
    operands = (pairs[..., 0], pairs[..., 1], values.reshape(n, k_dim // 2), scales)
    in_specs = [
      pl.BlockSpec((bm, bk // 2), lambda j, i, k: (i, k)),
      pl.BlockSpec((bm, bk // 2), lambda j, i, k: (i, k)),
      pl.BlockSpec((bn, bk // 2), lambda j, i, k: (j, k)),
      pl.BlockSpec((bn, k_dim // MX_BLOCK), lambda j, i, k: (j, 0)),
    ]
  else:
    x_spec = pl.BlockSpec((bm, bk), lambda j, i, k: (i, k))
    if fmt == "fp8_block":
      w_spec = pl.BlockSpec((bn, bk), lambda j, i, k: (j, k))
    else:
      w_spec = pl.BlockSpec((bk, bn), lambda j, i, k: (k, j))
    if fmt == "float":
      operands, in_specs = (x, values), [x_spec, w_spec]
    elif fmt == "fp8":
      s = scales.astype(jnp.float32).reshape(1, n)
      operands = (x, as_bytes(values), s)
      in_specs = [x_spec, w_spec, pl.BlockSpec((1, bn), lambda j, i, k: (0, j))]
    else:
      s = scales.astype(jnp.float32).reshape(-1)
      operands = (x, as_bytes(values), s)
      in_specs = [x_spec, w_spec, pl.BlockSpec(memory_space=pltpu.SMEM)]

  kernel = functools.partial(
    _kernel, fmt=fmt, k_dim=k_dim, block_k=bk, num_k=num_k, scale_block=(bo, bi),
    scale_grid=scale_grid,
  )
  out = pl.pallas_call(
    kernel,
    grid=grid,
    in_specs=in_specs,
    out_specs=pl.BlockSpec((bm, bn), lambda j, i, k: (i, j)),
    out_shape=jax.ShapeDtypeStruct((rows, n), jnp.float32),
    scratch_shapes=[pltpu.VMEM((bm, bn), jnp.float32)],
    compiler_params=pltpu.CompilerParams(
      dimension_semantics=("parallel", "parallel", "arbitrary")
    ),
    interpret=interpret,
    name=f"qmatmul_{fmt}_tpu",
  )(*operands)
  return out[:m]
