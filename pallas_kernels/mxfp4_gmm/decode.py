"""MXFP4 decoding by integer arithmetic, for use inside kernels (no table lookup, no gather).

Neither GPU (Triton) nor TPU (Mosaic) kernels have an FP4 or E8M0 type here, and a 16-entry
lookup would be a gather, so both kernels build each dequantized weight's float32 bit pattern
with integer ops and one same-width bitcast, which both lowerings support. There is no float
multiply by the scale: XLA:CPU (hence interpret mode) treats subnormal operands as zero, so
element · 2^−127 (the scale s = 0) would come out 0 instead of exact. Per element, with E2M1 code
c (sign = bit 3, exponent e = bits 2–1, mantissa m = bit 0) and E8M0 scale s (2^(s − 127)):

* c is 0 or 8: ±0 (code 8 is −0.0, as in `jaxspec.quant.formats.E2M1_VALUES`).
* otherwise the value is (1 + f/2) · 2^u with f = m, u = e − 1 for e > 0, and f = 0, u = −1 for
  the E2M1 subnormal 0.5 (e = 0, m = 1); the product's exponent is t = u + s − 127.
* −126 <= t <= 127: the normal float32 ((t + 127) << 23) | (f << 22).
* t < −126 (only s <= 1): the float32 subnormal (2 + f) << (t + 148); t >= −128 always, so this
  is exact (2^−127 itself is 1 << 22, not the 0 that bitcasting s << 23 would give).
* t > 127: ±inf, as the oracle's ldexp overflows (6 · 2^127 is past float32's range).
* s = 255 (NaN in E8M0): a quiet NaN. The oracle (`mxfp4_dequantize`, ldexp(v, 128)) gives ±inf
  or ±0 there instead; checkpoints holding 0xFF are refused at load (`check_mxfp4_scales`) and
  the tests draw s in 0..254.

So the dequantized tile is bit-identical to the exact E2M1 · 2^(s − 127) (numpy's ldexp) for
every byte and every s in 0..254 (tests/test_mxfp4_gmm.py checks all of them), and a cast to
bfloat16 keeps every normal value exact (float32's exponent range, 8 significant bits). The
oracle `mxfp4_dequantize` agrees bit for bit wherever the product is a normal float32 (always
for s >= 2): under XLA:CPU its ldexp flushes subnormal products to zero. What a dot then does
with subnormal weights is the machine's business: XLA:CPU (the oracle's dot and interpret mode
alike) and TPUs treat them as zero. Real checkpoints' scales sit near 2^−7, far from there.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

QNAN_BITS = 0x7FC00000
INF_BITS = 0x7F800000


def mxfp4_to_f32(codes: jax.Array, scales: jax.Array) -> jax.Array:
  """int32 E2M1 codes (0..15) and int32 E8M0 scales (0..255, broadcastable) → exact float32."""
  exp = (codes >> 1) & 3
  man = codes & 1
  frac = jnp.where(exp == 0, 0, man)  # 0.5 = 1.0 · 2^-1
  t = jnp.where(exp == 0, -1, exp - 1) + scales - 127
  normal = ((t + 127) << 23) | (frac << 22)
  subnormal = (2 + frac) << jnp.clip(t + 148, 0, 22)
  bits = jnp.where(t >= -126, normal, subnormal)
  bits = jnp.where(t > 127, INF_BITS, bits)
  bits = jnp.where((codes & 7) == 0, 0, bits)
  bits = jnp.where(scales == 255, QNAN_BITS, bits)
  bits = bits | ((codes & 8) << 28)  # the sign bit (int32 wraps to bit 31)
  return jax.lax.bitcast_convert_type(bits, jnp.float32)


def split_nibbles(packed: jax.Array) -> tuple[jax.Array, jax.Array]:
  """uint8 bytes → int32 (low nibble: the even element, high nibble: the odd element)."""
  b = packed.astype(jnp.int32)
  return b & 0x0F, (b >> 4) & 0x0F


def dequantize_tile(packed: jax.Array, scales: jax.Array) -> jax.Array:
  """values [R, nb, 16] uint8 + scales [R, nb] uint8 → float32 [R, nb · 32], K order restored.

  The two nibbles of byte i are elements 2i and 2i + 1 of their block: they are interleaved
  with a last-axis stack (Triton lowers a two-operand last-axis stack to tt.join) and a
  row-major reshape.
  """
  lo, hi = split_nibbles(packed)
  codes = jnp.stack([lo, hi], axis=-1)  # [R, nb, 16, 2]
  rows, nb = scales.shape
  s = scales.astype(jnp.int32)[:, :, None, None]
  return mxfp4_to_f32(codes, s).reshape(rows, nb * 32)
