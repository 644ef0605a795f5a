"""Dense quantized matmul as a Pallas GPU kernel (Triton lowering), reading the stored bytes.

  y[M, N] = x[M, K] @ W[K, N]   (float32 out; formats and layouts as in reference.py)

Grid (ceil(N / bn), rows / bm): program (j, i) owns output columns j·bn .. j·bn + bn − 1 of row
tile i and walks K in tiles of bk (a `fori_loop`). Per K tile it loads the stored weight bytes
with masked loads (`pallas.triton.load(..., mask=, other=0)`), so N and K need not be multiples
of the tiles and the weight is never padded or copied; it dequantizes the tile in registers and
accumulates x[bm, bk] · tile in float32:

* "float":     values [K, N] tile [bk, bn], cast to float32.
* "fp8":       bytes [K, N] (e4m3 is viewed as uint8 outside, a bitcast) tile [bk, bn], decoded
               by integer arithmetic (`e4m3_to_f32`), times the column scales [bn].
* "fp8_block": bytes [N, K] tile [bn, bk], decoded, times one scalar scale: bn divides bo and bk
               divides bi, so a tile lies inside one scale block (scales read by a scalar load);
               the dot contracts both operands' last axes (no transpose of the weight).
* "mxfp4":     packed bytes [N, K/32, 16] tile [bn, bk/32, 16] and E8M0 scales [bn, bk/32],
               decoded by mxfp4_gmm's `dequantize_tile` (no lookup, no gather) into [bn, bk].

Masked-off weight elements load as byte 0, which every format decodes to 0.0; x is padded with
zeros to (rows, ceil(K / bk) · bk), rows a power of two >= 16 (Triton dot operands are at least
16 wide) or a multiple of bm; this is the only copy made (x is small in decode / verify), and the
output is computed into [rows, ceil(N / bn) · bn] and sliced. Tiles are powers of two:
bm, bn >= 16, bk >= 16 (>= 32 for mxfp4); for fp8_block, bn and bk are lowered to divide the
scale block.

Each dequantized product is the same float32 operation as the oracle's (`dequantize`), so the
result differs from `qmatmul_reference` only by the dot's summation order.

Bytes read per call (HBM): the weight once per row tile, ceil(rows / bm) · (K · N · b + scale
bytes) with b = 4 / 2 (float32 / bfloat16), 1 (fp8, plus 4 N scale bytes), 1 (fp8_block, plus
4 · ceil(N/bo) · ceil(K/bi)), 17/32 (mxfp4: K/2 + K/32 bytes per column); x, padded, once per
column tile (L2-shared), rows · K' · itemsize · ceil(N / bn); the float32 output once. In the
decode / verify regime (M <= 64: one row tile) the weight bytes are read exactly once. The
dequantized weight exists only as a [bk, bn] register tile, never in HBM.

Status: checked only in interpret mode (`interpret=True`, on CPU) against reference.py and lowered
to Triton IR on CPU (`.lower(lowering_platforms=("cuda",))`); never compiled to PTX nor run on a
GPU. `pallas.triton.CompilerParams` is passed explicitly so that JAX lowers with Triton rather
than Mosaic GPU (see mxfp4_gmm/kernel_gpu.py).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from jaxspec.quant import codecs
from pallas_kernels.mxfp4_gmm.decode import dequantize_tile
from pallas_kernels.mxfp4_gmm.kernel_gpu import check_pow2, pow2_at_least, pow2_dividing
from pallas_kernels.qmatmul.reference import DEFAULT_BLOCK, check_inputs

MX_BLOCK = 32  # elements per MXFP4 scale
MIN_TILE = 16  # Triton dot operands are at least 16 wide


def e4m3_to_f32(bits: jax.Array) -> jax.Array:
  """int32 E4M3 bytes (0..255) → exact float32, by integer arithmetic and one bitcast.

  Used instead of an in-kernel float8 convert, which neither lowering is relied on to support.
  Normal values rebias the exponent (7 → 127); subnormals are m · 2^−9 (a normal float32);
  0x7F / 0xFF are NaN (E4M3FN has no infinities).
  """
  exp = (bits >> 3) & 15
  man = bits & 7
  normal = jax.lax.bitcast_convert_type(((exp + 120) << 23) | (man << 20), jnp.float32)
  sub = man.astype(jnp.float32) * (2.0**-9)
  mag = jnp.where(exp == 0, sub, normal)
  mag = jnp.where((bits & 0x7F) == 0x7F, jnp.float32(jnp.nan), mag)
  return jnp.where((bits & 0x80) != 0, -mag, mag)


def as_bytes(values: jax.Array) -> jax.Array:
  """fp8 values (float8_e4m3fn or uint8) as their uint8 bytes (a bitcast; XLA:CPU was seen to
  copy such a bitcast feeding a custom call, so check the GPU HLO when this runs there)."""
  if values.dtype == codecs.FP8_DTYPE:
    return jax.lax.bitcast_convert_type(values, jnp.uint8)
  return values


def _kernel(*refs, fmt, k_dim, n_dim, block_k, num_k, scale_block, scale_cols):
  if fmt == "float":
    x_ref, v_ref, o_ref = refs
    s_ref = None
  else:
    x_ref, v_ref, s_ref, o_ref = refs
  bm, bn = o_ref.shape
  n0 = pl.program_id(0) * bn
  n_ok = n0 + jax.lax.broadcasted_iota(jnp.int32, (bn,), 0) < n_dim
  nt = (((1,), (1,)), ((), ()))  # [bm, bk] · [bn, bk]ᵀ

  if fmt == "fp8":
    col_scale = pltriton.load(s_ref.at[pl.ds(n0, bn)], mask=n_ok, other=0.0)

  def k_step(kt, acc):
    k0 = pl.multiple_of(kt * block_k, block_k)
    x = x_ref[:, pl.ds(k0, block_k)].astype(jnp.float32)  # [bm, bk], zero padded
    k_ok = k0 + jax.lax.broadcasted_iota(jnp.int32, (block_k,), 0) < k_dim
    if fmt in ("float", "fp8"):
      mask = k_ok[:, None] & n_ok[None, :]
      w = pltriton.load(v_ref.at[pl.ds(k0, block_k), pl.ds(n0, bn)], mask=mask, other=0)
      if fmt == "float":
        w = w.astype(jnp.float32)
      else:
        w = e4m3_to_f32(w.astype(jnp.int32)) * col_scale[None, :]
      return acc + jnp.dot(x, w, preferred_element_type=jnp.float32)
    if fmt == "fp8_block":
      mask = n_ok[:, None] & k_ok[None, :]
      w = pltriton.load(v_ref.at[pl.ds(n0, bn), pl.ds(k0, block_k)], mask=mask, other=0)
      bo, bi = scale_block
      s = s_ref[(n0 // bo) * scale_cols + k0 // bi]  # one scale for the whole tile
      w = e4m3_to_f32(w.astype(jnp.int32)) * s
    else:  # mxfp4
      nb = block_k // MX_BLOCK
      b0 = pl.multiple_of(kt * nb, nb)
      b_ok = b0 + jax.lax.broadcasted_iota(jnp.int32, (nb,), 0) < k_dim // MX_BLOCK
      smask = n_ok[:, None] & b_ok[None, :]
      vmask = jnp.broadcast_to(smask[:, :, None], (bn, nb, MX_BLOCK // 2))
      packed = pltriton.load(v_ref.at[pl.ds(n0, bn), pl.ds(b0, nb), :], mask=vmask, other=0)
      sc = pltriton.load(s_ref.at[pl.ds(n0, bn), pl.ds(b0, nb)], mask=smask, other=0)
      w = dequantize_tile(packed, sc)  # [bn, bk]
    return acc + jax.lax.dot_general(x, w, nt, preferred_element_type=jnp.float32)

  acc = jax.lax.fori_loop(0, num_k, k_step, jnp.zeros((bm, bn), jnp.float32))
  o_ref[...] = acc


_STATIC = ("fmt", "block", "interpret", "block_m", "block_n", "block_k", "num_warps")


@functools.partial(jax.jit, static_argnames=_STATIC)
def qmatmul_gpu(
  x: jax.Array,
  values: jax.Array,
  scales: Any,
  fmt: str,
  block: tuple[int, int] = DEFAULT_BLOCK,
  interpret: bool = False,
  *,
  block_m: int = 64,
  block_n: int = 32,
  block_k: int = 64,
  num_warps: int = 4,
) -> jax.Array:
  """x [M, K] @ the stored weight → float32 [M, N] (reference.py's formats and contract).

  block is fp8_block's scale block (bo, bi). block_m / block_n (powers of two >= 16) and block_k
  (a power of two >= 16, >= 32 for mxfp4) are the tiles; for fp8_block, bn and bk are lowered to
  the largest power of two dividing bo and bi (ValueError if that is below 16). Only checked in
  interpret mode and by lowering to Triton IR: see the module docstring.
  """
  m, k_dim, n = check_inputs(x, values, scales, fmt, block)
  check_pow2("block_m", block_m, MIN_TILE)
  check_pow2("block_n", block_n, MIN_TILE)
  check_pow2("block_k", block_k, MX_BLOCK if fmt == "mxfp4" else MIN_TILE)
  bn, bk = block_n, block_k
  bo, bi = block
  if fmt == "fp8_block":
    bn, bk = pow2_dividing(bo, block_n), pow2_dividing(bi, block_k)
    if min(bn, bk) < MIN_TILE:
      raise ValueError(f"fp8_block scale block {block} needs power-of-two factors >= {MIN_TILE}")
  bk = min(bk, pow2_at_least(k_dim))  # no tile much wider than K itself
  if fmt == "mxfp4":
    bk = max(bk, MX_BLOCK)
  bm = min(block_m, pow2_at_least(max(m, MIN_TILE)))
  rows = -(-m // bm) * bm
  num_k = -(-k_dim // bk)
  tiles_n = -(-n // bn)
  x = jnp.pad(x, ((0, rows - m), (0, num_k * bk - k_dim)))

  if fmt == "float":
    operands = (x, values)
  elif fmt == "fp8":
    operands = (x, as_bytes(values), scales.astype(jnp.float32))
  elif fmt == "fp8_block":
    operands = (x, as_bytes(values), scales.astype(jnp.float32).reshape(-1))
  else:
    operands = (x, values, scales)

  def whole(a: jax.Array) -> pl.BlockSpec:  # the whole array: a base pointer in Triton
    return pl.BlockSpec(a.shape, lambda j, i: (0,) * a.ndim)

  in_specs = [pl.BlockSpec((bm, x.shape[1]), lambda j, i: (i, 0))]
  in_specs += [whole(a) for a in operands[1:]]
  kernel = functools.partial(
    _kernel, fmt=fmt, k_dim=k_dim, n_dim=n, block_k=bk, num_k=num_k, scale_block=(bo, bi),
    scale_cols=-(-k_dim // bi),
  )
  out = pl.pallas_call(
    kernel,
    grid=(tiles_n, rows // bm),
    in_specs=in_specs,
    out_specs=pl.BlockSpec((bm, bn), lambda j, i: (i, j)),
    out_shape=jax.ShapeDtypeStruct((rows, tiles_n * bn), jnp.float32),
    compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=2),
    interpret=interpret,
    name=f"qmatmul_{fmt}",
  )(*operands)
  return out[:m, :n]
