"""pallas_kernels/mxfp4_gmm: the MXFP4 grouped expert matmul.

The in-kernel decoding (integer bit building, decode.py) is checked bit for bit against numpy
for every byte and every scale; the reference (dequantize + ragged_dot) against a float64
per-row product; the GPU-style (Triton) kernel and the TPU-style (Mosaic, scalar prefetch)
kernel against the reference in interpret mode over group-size patterns with empty groups, one
group holding every row, rows past sum(group_sizes), float32 and bfloat16 activations and scales
spanning the E8M0 range. Both kernels are also lowered (not compiled) for their platform.

No GPU or TPU was available for these tests: the kernels run with interpret=True on CPU (the TPU
kernel also under the TPU interpreter, pltpu.InterpretParams, whose VMEM starts as NaN).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from jaxspec.quant.formats import E2M1_VALUES, mxfp4_dequantize, mxfp4_quantize
from pallas_kernels.mxfp4_gmm import (
  dequantize_tile,
  group_metadata,
  mxfp4_gmm,
  mxfp4_gmm_gpu,
  mxfp4_gmm_reference,
  mxfp4_gmm_tpu,
)

E, K, N, M = 4, 128, 64, 40
GPU_BLOCKS = dict(block_m=16, block_n=32, block_k=64)  # 2 column tiles, 2 k tiles, 3 row tiles
TPU_BLOCKS = dict(block_m=16)  # N, K below one (128, 256) tile: whole-axis blocks
PATTERNS = {
  "mixed_with_empty": [10, 0, 17, 13],
  "single_group_all_rows": [0, 0, 40, 0],
  "sum_below_m": [3, 0, 5, 9],
  "all_empty": [0, 0, 0, 0],
  "first_and_last_empty": [0, 21, 19, 0],
  "one_row_groups": [1, 1, 1, 1],
}
TPU_INTERPRET = {"generic": True, "tpu_interpreter": pltpu.InterpretParams()}


def _weights(seed, s_lo=110, s_hi=135, e=E, k=K, n=N):
  """Random packed bytes (every E2M1 code in both nibbles) and E8M0 scales in [s_lo, s_hi]."""
  rng = np.random.default_rng(seed)
  values = rng.integers(0, 256, size=(e, n, k // 32, 16), dtype=np.uint8)
  assert set(np.unique(values & 15)) == set(range(16)) == set(np.unique(values >> 4))
  scales = rng.integers(s_lo, s_hi + 1, size=(e, n, k // 32), dtype=np.uint8)
  scales[0, 0, :2] = s_lo, s_hi  # both ends of the range present
  return jnp.asarray(values), jnp.asarray(scales)


def _x(seed, dtype=jnp.float32, scale=1.0, m=M, k=K):
  rng = np.random.default_rng(seed + 1000)
  return jnp.asarray(rng.normal(size=(m, k)) * scale, jnp.float32).astype(dtype)


def _exact_weights(values, scales):
  """float64 [E, K, N]: E2M1 value · 2^(s − 127), numpy only (no jaxspec code)."""
  v = np.asarray(values)
  elems = np.stack([E2M1_VALUES[v & 15], E2M1_VALUES[v >> 4]], -1).astype(np.float64)
  elems = elems.reshape(*v.shape[:-1], 32)
  w = np.ldexp(elems, np.asarray(scales).astype(np.int64)[..., None] - 127)
  return np.swapaxes(w.reshape(*v.shape[:-2], -1), -1, -2)


def _truth(x, values, scales, sizes):
  """float64 ground truth and its error bound |x| @ |W| per row (rows past the sum: 0)."""
  w = _exact_weights(values, scales)
  w[np.abs(w) < 2.0**-126] = 0.0  # XLA:CPU treats subnormal dot operands as 0 (DAZ)
  x = np.asarray(jnp.asarray(x, jnp.float32), np.float64)
  out = np.zeros((x.shape[0], w.shape[-1]))
  bound = np.zeros_like(out)
  row = 0
  for g, size in enumerate(sizes):
    out[row : row + size] = np.einsum("mk,kn->mn", x[row : row + size], w[g])
    bound[row : row + size] = np.abs(x[row : row + size]) @ np.abs(w[g])
    row += size
  return out, bound


def _f64(a):
  return np.asarray(jnp.asarray(a, jnp.float32), np.float64)


def _close(got, want, bound, rtol):
  """|got − want| <= rtol · (|x| @ |W|) elementwise: the summation-order error bound."""
  return bool(np.all(np.abs(_f64(got) - _f64(want)) <= rtol * bound + 1e-30))


def _assert_close(got, want, bound, rtol):
  err = np.max(np.abs(_f64(got) - _f64(want)) / (bound + 1e-30))
  assert _close(got, want, bound, rtol), f"max error / bound = {err:.3g} > {rtol}"


def _swap_nibbles(values):
  return (values >> 4) | (values << 4)


# ------------------------------------------------------------------------------------------------
# Decoding and the reference
# ------------------------------------------------------------------------------------------------


def test_decode_tile_is_bit_exact_for_every_byte_and_scale():
  values = np.tile(np.arange(256, dtype=np.uint8).reshape(1, 16, 16), (255, 1, 1))
  scales = np.tile(np.arange(255, dtype=np.uint8)[:, None], (1, 16))  # s = 0..254 per row
  got = np.asarray(jax.jit(dequantize_tile)(values, scales))  # [255, 512]
  v = values.reshape(255, 16, 16)
  elems = np.stack([E2M1_VALUES[v & 15], E2M1_VALUES[v >> 4]], -1).reshape(255, 16, 32)
  with np.errstate(over="ignore"):  # s >= 253: 6 · 2^127 and up overflow to inf, as ldexp does
    want = np.ldexp(elems, scales.astype(np.int32)[..., None] - 127).astype(np.float32)
  want = want.reshape(255, 512)
  assert np.array_equal(got.view(np.uint32), want.view(np.uint32))  # −0.0, subnormals, inf
  assert got[0, 2] == np.float32(2.0**-128)  # code 1 (0.5) at s = 0: a subnormal, not 0
  # The formats module agrees bit for bit wherever its XLA:CPU ldexp does not flush (s >= 2).
  oracle = np.asarray(mxfp4_dequantize(jnp.asarray(values), jnp.asarray(scales), -1))
  assert np.array_equal(got[2:].view(np.uint32), oracle[2:].view(np.uint32))
  nan = np.asarray(dequantize_tile(values[:1], np.full((1, 16), 255, np.uint8)))
  assert np.isnan(nan).all()  # 0xFF is NaN in E8M0


def test_decode_tile_rejects_swapped_nibbles():
  # The broken variant: a decoder reading the high nibble as the even element.
  values, scales = _weights(0)
  tile_v, tile_s = values[0], scales[0]  # [N, K/32, 16], [N, K/32]
  good = np.asarray(dequantize_tile(tile_v, tile_s))
  swapped = np.asarray(dequantize_tile(_swap_nibbles(tile_v), tile_s))
  oracle = np.asarray(mxfp4_dequantize(tile_v, tile_s, -1))
  assert np.array_equal(good, oracle)
  assert not np.array_equal(swapped, oracle)


@pytest.mark.parametrize("pattern", ["mixed_with_empty", "single_group_all_rows", "sum_below_m"])
def test_reference_matches_per_row_einsum(pattern):
  sizes = PATTERNS[pattern]
  values, scales = _weights(1)
  x = _x(1)
  want, bound = _truth(x, values, scales, sizes)
  got = mxfp4_gmm_reference(x, values, scales, jnp.asarray(sizes, jnp.int32))
  assert got.shape == (M, N) and got.dtype == jnp.float32
  _assert_close(got, want, bound, 1e-5)
  assert not np.asarray(got)[sum(sizes) :].any()


def test_reference_rejects_swapped_nibbles():
  # A grouped matmul that reads the nibbles in the wrong order fails the comparison.
  sizes = PATTERNS["mixed_with_empty"]
  values, scales = _weights(2)
  x = _x(2)
  want, bound = _truth(x, values, scales, sizes)
  broken = mxfp4_gmm_reference(x, _swap_nibbles(values), scales, jnp.asarray(sizes, jnp.int32))
  assert not _close(broken, want, bound, 1e-2)


def test_reference_on_quantized_float_weights():
  # Weights made by the formats module's own quantizer (the checkpoint path), E=2.
  rng = np.random.default_rng(3)
  w = jnp.asarray(rng.normal(size=(2, K, N)) * 0.02, jnp.float32)
  values, scales = mxfp4_quantize(w, -2)
  sizes = [15, 25]
  x = _x(3)
  want, bound = _truth(x, values, scales, sizes)
  _assert_close(mxfp4_gmm_reference(x, values, scales, jnp.asarray(sizes)), want, bound, 1e-5)
  got = mxfp4_gmm_gpu(x, values, scales, jnp.asarray(sizes), interpret=True, **GPU_BLOCKS)
  _assert_close(got, want, bound, 1e-5)


# ------------------------------------------------------------------------------------------------
# GPU-style kernel (Triton lowering), interpret mode
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("pattern", list(PATTERNS))
def test_gpu_kernel_matches_reference(pattern):
  sizes = jnp.asarray(PATTERNS[pattern], jnp.int32)
  values, scales = _weights(4)
  x = _x(4)
  want = mxfp4_gmm_reference(x, values, scales, sizes)
  got = mxfp4_gmm_gpu(x, values, scales, sizes, interpret=True, **GPU_BLOCKS)
  assert got.shape == (M, N) and got.dtype == jnp.float32
  _, bound = _truth(x, values, scales, PATTERNS[pattern])
  _assert_close(got, want, bound, 1e-5)
  assert not np.asarray(got)[sum(PATTERNS[pattern]) :].any()  # rows past the sum are 0


def test_gpu_kernel_bfloat16_and_preferred_type():
  sizes = PATTERNS["mixed_with_empty"]
  values, scales = _weights(5)
  x = _x(5, jnp.bfloat16)
  _, bound = _truth(x, values, scales, sizes)
  gs = jnp.asarray(sizes, jnp.int32)
  want = mxfp4_gmm_reference(x, values, scales, gs, preferred_element_type=jnp.float32)
  got = mxfp4_gmm_gpu(
    x, values, scales, gs, interpret=True, preferred_element_type=jnp.float32, **GPU_BLOCKS
  )
  assert got.dtype == jnp.float32
  _assert_close(got, want, bound, 1e-5)  # bf16 inputs, exact bf16 weights, f32 accumulation
  got16 = mxfp4_gmm_gpu(x, values, scales, gs, interpret=True, **GPU_BLOCKS)
  assert got16.dtype == jnp.bfloat16
  _assert_close(got16, want, bound, 1e-2)  # the bf16 output's rounding


def test_gpu_kernel_default_tiles_and_tiny_m():
  # Default tiles (bm 64 → 32 <= M, bn 64, bk 128 = K); M = 5 < 16 pads x to one tile.
  values, scales = _weights(6)
  x = _x(6)
  gs = jnp.asarray([12, 0, 20, 5], jnp.int32)
  _, bound = _truth(x, values, scales, [12, 0, 20, 5])
  want = mxfp4_gmm_reference(x, values, scales, gs)
  _assert_close(mxfp4_gmm_gpu(x, values, scales, gs, interpret=True), want, bound, 1e-5)
  small = x[:5]
  gs = jnp.asarray([2, 0, 0, 3], jnp.int32)
  _, bound = _truth(small, values, scales, [2, 0, 0, 3])
  want = mxfp4_gmm_reference(small, values, scales, gs)
  got = mxfp4_gmm_gpu(small, values, scales, gs, interpret=True)
  assert got.shape == (5, N)
  _assert_close(got, want, bound, 1e-5)


def test_gpu_kernel_rejects_swapped_nibbles():
  # The kernel run on nibble-swapped bytes is the kernel with its nibble order swapped.
  sizes = PATTERNS["mixed_with_empty"]
  values, scales = _weights(7)
  x = _x(7)
  gs = jnp.asarray(sizes, jnp.int32)
  want = mxfp4_gmm_reference(x, values, scales, gs)
  _, bound = _truth(x, values, scales, sizes)
  broken = mxfp4_gmm_gpu(x, _swap_nibbles(values), scales, gs, interpret=True, **GPU_BLOCKS)
  assert not _close(broken, want, bound, 1e-2)


# ------------------------------------------------------------------------------------------------
# TPU-style kernel (Mosaic, scalar prefetch), interpret mode
# ------------------------------------------------------------------------------------------------


def test_group_metadata_visits_cover_every_row_once():
  rng = np.random.default_rng(8)
  m, bm, e = 40, 16, 5
  patterns = [rng.multinomial(int(rng.integers(0, m + 1)), np.ones(e) / e) for _ in range(30)]
  patterns += [[0] * e, [m, 0, 0, 0, 0], [0, 0, 0, 0, m], [16, 0, 16, 0, 8]]
  meta = jax.jit(group_metadata, static_argnums=(1, 2))
  for sizes in patterns:
    starts, ends, gids, tiles, flags = map(np.asarray, meta(jnp.asarray(sizes, jnp.int32), m, bm))
    assert len(gids) == -(-m // bm) + e - 1
    owner = np.full(m, -1)
    zeroed = np.zeros(m, bool)
    for g, t, f in zip(gids, tiles, flags):
      rows = np.arange(t * bm, min(t * bm + bm, m))
      if f & 2:  # first visit of the tile: rows it does not own are zeroed
        assert not zeroed[rows].any()
        zeroed[rows] = True
      assert zeroed[rows].all()  # a tile's visits are consecutive, the first one first
      if f & 1:
        mine = rows[(rows >= starts[g]) & (rows < ends[g])]
        assert mine.size and (owner[mine] == -1).all()
        owner[mine] = g
    want = np.repeat(np.arange(e), sizes)
    assert np.array_equal(owner[: len(want)], want) and (owner[len(want) :] == -1).all()
    assert zeroed.all()


@pytest.mark.parametrize("mode", list(TPU_INTERPRET))
@pytest.mark.parametrize("pattern", ["mixed_with_empty", "single_group_all_rows", "sum_below_m"])
def test_tpu_kernel_matches_reference(pattern, mode):
  sizes = jnp.asarray(PATTERNS[pattern], jnp.int32)
  values, scales = _weights(9)
  x = _x(9)
  want = mxfp4_gmm_reference(x, values, scales, sizes)
  got = mxfp4_gmm_tpu(x, values, scales, sizes, interpret=TPU_INTERPRET[mode], **TPU_BLOCKS)
  assert got.shape == (M, N) and got.dtype == jnp.float32
  _, bound = _truth(x, values, scales, PATTERNS[pattern])
  _assert_close(got, want, bound, 1e-5)
  assert not np.asarray(got)[sum(PATTERNS[pattern]) :].any()


@pytest.mark.parametrize("pattern", ["all_empty", "first_and_last_empty", "one_row_groups"])
def test_tpu_kernel_more_patterns(pattern):
  sizes = jnp.asarray(PATTERNS[pattern], jnp.int32)
  values, scales = _weights(10)
  x = _x(10)
  want = mxfp4_gmm_reference(x, values, scales, sizes)
  got = mxfp4_gmm_tpu(x, values, scales, sizes, interpret=True, **TPU_BLOCKS)
  _, bound = _truth(x, values, scales, PATTERNS[pattern])
  _assert_close(got, want, bound, 1e-5)


def test_tpu_kernel_k_tiles_and_bfloat16():
  # K = 512 in two 256-wide k tiles (the one-hot scale widening at k > 0); bf16 activations.
  values, scales = _weights(11, k=512, n=32)
  sizes = [9, 0, 20, 7]
  gs = jnp.asarray(sizes, jnp.int32)
  for dtype, out, rtol in ((jnp.float32, None, 1e-5), (jnp.bfloat16, jnp.float32, 1e-5)):
    x = _x(11, dtype, k=512)
    _, bound = _truth(x, values, scales, sizes)
    want = mxfp4_gmm_reference(x, values, scales, gs, preferred_element_type=out)
    got = mxfp4_gmm_tpu(
      x, values, scales, gs, interpret=True, preferred_element_type=out, block_m=16, block_k=256
    )
    assert got.dtype == (out or dtype)
    _assert_close(got, want, bound, rtol)


def test_tpu_kernel_rejects_swapped_nibbles():
  sizes = PATTERNS["mixed_with_empty"]
  values, scales = _weights(12)
  x = _x(12)
  gs = jnp.asarray(sizes, jnp.int32)
  want = mxfp4_gmm_reference(x, values, scales, gs)
  _, bound = _truth(x, values, scales, sizes)
  broken = mxfp4_gmm_tpu(x, _swap_nibbles(values), scales, gs, interpret=True, **TPU_BLOCKS)
  assert not _close(broken, want, bound, 1e-2)


# ------------------------------------------------------------------------------------------------
# Both kernels over the E8M0 range
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
  "s_lo, s_hi, x_scale",
  [
    (0, 12, 2.0**100),  # s = 0 (2^-127) and up; x large so that the products stay normal
    (60, 190, 1.0),  # 2^-67 .. 2^63 mixed within each dot
    # Up to s = 252, the largest at which 6 · 2^(s − 127) is finite (s = 253, 254 overflow to
    # inf, checked bit for bit by the decode test); x small so that the sums stay finite.
    (230, 252, 2.0**-110),
  ],
)
def test_kernels_over_the_scale_range(s_lo, s_hi, x_scale):
  sizes = PATTERNS["mixed_with_empty"]
  values, scales = _weights(13, s_lo, s_hi)
  assert int(scales.min()) == s_lo and int(scales.max()) == s_hi
  x = _x(13, scale=x_scale)
  gs = jnp.asarray(sizes, jnp.int32)
  want, bound = _truth(x, values, scales, sizes)
  ref = mxfp4_gmm_reference(x, values, scales, gs)
  assert np.isfinite(np.asarray(ref)).all()
  _assert_close(ref, want, bound, 1e-5)
  _assert_close(
    mxfp4_gmm_gpu(x, values, scales, gs, interpret=True, **GPU_BLOCKS), ref, bound, 1e-5
  )
  _assert_close(
    mxfp4_gmm_tpu(x, values, scales, gs, interpret=True, **TPU_BLOCKS), ref, bound, 1e-5
  )


# ------------------------------------------------------------------------------------------------
# Lowering (no compile: no GPU / TPU here)
# ------------------------------------------------------------------------------------------------


def _abstract_args(m, k, n, e, dtype):
  return (
    jax.ShapeDtypeStruct((m, k), dtype),
    jax.ShapeDtypeStruct((e, n, k // 32, 16), jnp.uint8),
    jax.ShapeDtypeStruct((e, n, k // 32), jnp.uint8),
    jax.ShapeDtypeStruct((e,), jnp.int32),
  )


def test_gpu_kernel_lowers_to_triton():
  # gpt-oss's expert shapes (K = N = 2880: 64-wide column and k tiles), bfloat16 activations.
  fn = jax.jit(lambda *a: mxfp4_gmm_gpu(*a, preferred_element_type=jnp.float32))
  text = fn.trace(*_abstract_args(48, 2880, 2880, 4, jnp.bfloat16))
  text = text.lower(lowering_platforms=("cuda",)).as_text()
  assert "xla.gpu.triton" in text


def test_tpu_kernel_lowers_to_mosaic():
  fn = jax.jit(lambda *a: mxfp4_gmm_tpu(*a, preferred_element_type=jnp.float32))
  text = fn.trace(*_abstract_args(256, 1024, 512, 4, jnp.bfloat16))
  text = text.lower(lowering_platforms=("tpu",)).as_text()
  assert "tpu_custom_call" in text


# ------------------------------------------------------------------------------------------------
# Dispatcher and errors
# ------------------------------------------------------------------------------------------------


def test_dispatcher():
  values, scales = _weights(14)
  x = _x(14)
  gs = jnp.asarray(PATTERNS["mixed_with_empty"], jnp.int32)
  ref = np.asarray(mxfp4_gmm_reference(x, values, scales, gs))
  assert np.array_equal(np.asarray(mxfp4_gmm(x, values, scales, gs)), ref)  # auto = xla
  assert np.array_equal(np.asarray(mxfp4_gmm(x, values, scales, gs, impl="xla")), ref)
  _, bound = _truth(x, values, scales, PATTERNS["mixed_with_empty"])
  got = mxfp4_gmm(x, values, scales, gs, impl="pallas", interpret=True, **GPU_BLOCKS)
  _assert_close(got, ref, bound, 1e-5)
  got = mxfp4_gmm(x, values, scales, gs, impl="pallas_tpu", interpret=True, block_m=16)
  _assert_close(got, ref, bound, 1e-5)


def test_errors():
  values, scales = _weights(15)
  x = _x(15)
  gs = jnp.asarray([10, 10, 10, 10], jnp.int32)
  with pytest.raises(ValueError, match="impl"):
    mxfp4_gmm(x, values, scales, gs, impl="triton")
  with pytest.raises(ValueError, match="multiple of the MXFP4 block"):
    mxfp4_gmm(x[:, :100], values, scales, gs)
  with pytest.raises(ValueError, match="K=64"):
    mxfp4_gmm(x[:, :64], values, scales, gs)
  with pytest.raises(ValueError, match="do not match"):
    mxfp4_gmm(x, values, scales[:, :32], gs)
  with pytest.raises(ValueError, match="group_sizes"):
    mxfp4_gmm(x, values, scales, gs[:3])
  with pytest.raises(ValueError, match="group_sizes must be integer"):
    mxfp4_gmm(x, values, scales, gs.astype(jnp.float32))
  with pytest.raises(ValueError, match="uint8"):
    mxfp4_gmm(x, values.astype(jnp.int8), scales, gs)
  with pytest.raises(ValueError, match="uint8"):
    mxfp4_gmm(x, values, scales.astype(jnp.int32), gs)
  with pytest.raises(ValueError, match="values must be"):
    mxfp4_gmm(x, values.reshape(E, N, -1), scales, gs)
  with pytest.raises(ValueError, match=r"x must be \[M, K\]"):
    mxfp4_gmm(x[None], values, scales, gs)
  with pytest.raises(ValueError, match="float"):
    mxfp4_gmm(x.astype(jnp.int32), values, scales, gs)
  with pytest.raises(ValueError, match="block_m=24"):
    mxfp4_gmm(x, values, scales, gs, impl="pallas", interpret=True, block_m=24)
  with pytest.raises(ValueError, match="block_k=16"):
    mxfp4_gmm(x, values, scales, gs, impl="pallas", interpret=True, block_k=16)
  v8, s8 = values[:, :8], scales[:, :8]  # N = 8: below Triton's 16-wide dot operands
  with pytest.raises(ValueError, match="N=8"):
    mxfp4_gmm(x, v8, s8, gs, impl="pallas", interpret=True)
  with pytest.raises(ValueError, match="block_m=8"):
    mxfp4_gmm(x, values, scales, gs, impl="pallas_tpu", interpret=True, block_m=8)
