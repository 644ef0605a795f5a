"""The Pallas dense quantized matmuls (pallas_kernels/qmatmul/kernel_gpu.py, kernel_tpu.py).

Each kernel runs in interpret mode on CPU for every format against `qmatmul_reference`, on small
shapes whose N and K are not multiples of the tiles (so edge tiles are masked), and is lowered
(not compiled) for its platform. No GPU or TPU was available: nothing here runs on hardware.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from jaxspec.quant import codecs
from pallas_kernels.qmatmul.kernel_gpu import e4m3_to_f32, qmatmul_gpu
from pallas_kernels.qmatmul.kernel_tpu import qmatmul_tpu
from pallas_kernels.qmatmul.reference import FORMATS, dequantize, qmatmul_reference

BLOCK = (32, 32)  # fp8_block's scale block: small, so the shapes below span several
SHAPES = {1: (96, 72), 5: (160, 200), 16: (288, 136)}  # M → (K, N), none tile aligned
# TPU tiles below N and K (multiples of 128; 256 for mxfp4) so that partial tiles occur.
TPU_TILES = {"block_n": 128, "block_k": 128}
TPU_TILES_MXFP4 = {"block_n": 128, "block_k": 256}


def _weight(fmt, k, n, seed=0, fp8_dtype=jnp.uint8):
  """Random stored arrays: every non-NaN fp8 byte (subnormals and signs included), every E2M1
  code, E8M0 scales around 2^0."""
  rng = np.random.default_rng(seed)
  if fmt == "float":
    return jnp.asarray(rng.normal(size=(k, n)), jnp.float32), None
  if fmt == "mxfp4":
    values = rng.integers(0, 256, size=(n, k // 32, 16), dtype=np.uint8)
    return jnp.asarray(values), jnp.asarray(rng.integers(118, 131, size=(n, k // 32)), jnp.uint8)
  shape = (k, n) if fmt == "fp8" else (n, k)
  bytes_ = rng.integers(0, 256, size=shape, dtype=np.uint8)
  bytes_[(bytes_ & 0x7F) == 0x7F] = 0x38  # no NaN (1.0 instead)
  values = jnp.asarray(bytes_)
  if fp8_dtype != jnp.uint8:
    values = codecs.fp8_values(values)
  if fmt == "fp8":
    return values, jnp.asarray(rng.uniform(0.25, 4.0, size=n), jnp.float32)
  grid = (-(-n // BLOCK[0]), -(-k // BLOCK[1]))
  return values, jnp.asarray(rng.uniform(0.25, 4.0, size=grid), jnp.float32)


def _x(m, k, seed=0):
  return jnp.asarray(np.random.default_rng(seed + 1).normal(size=(m, k)), jnp.float32)


def _assert_matches(got, x, values, scales, fmt, rtol=1e-5):
  """|got − oracle| <= rtol · (|x| @ |W|): the summation-order error bound, elementwise."""
  want = np.asarray(qmatmul_reference(x, values, scales, fmt, BLOCK), np.float64)
  w = np.abs(np.asarray(dequantize(values, scales, fmt, BLOCK), np.float64))
  bound = np.abs(np.asarray(x, np.float64)) @ w
  got = np.asarray(got, np.float64)
  assert got.shape == want.shape
  err = np.abs(got - want)
  assert np.all(err <= rtol * bound + 1e-30), f"max error / bound = {np.max(err / bound):.3g}"


def _tpu_tiles(fmt):
  return TPU_TILES_MXFP4 if fmt == "mxfp4" else TPU_TILES


def test_e4m3_decode_is_exact_for_every_byte():
  bytes_ = jnp.arange(256, dtype=jnp.int32)
  got = np.asarray(e4m3_to_f32(bytes_))
  want = np.asarray(codecs.fp8_values(bytes_.astype(jnp.uint8)).astype(jnp.float32))
  np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
  ok = ~np.isnan(want)
  np.testing.assert_array_equal(got[ok].view(np.uint32), want[ok].view(np.uint32))  # ±0 too


@pytest.mark.parametrize("m", sorted(SHAPES))
@pytest.mark.parametrize("fmt", FORMATS)
def test_gpu_kernel_matches_reference(fmt, m):
  k, n = SHAPES[m]
  values, scales = _weight(fmt, k, n, seed=m)
  x = _x(m, k, seed=m)
  got = qmatmul_gpu(x, values, scales, fmt, BLOCK, True)
  assert got.dtype == jnp.float32
  _assert_matches(got, x, values, scales, fmt)


@pytest.mark.parametrize("m", sorted(SHAPES))
@pytest.mark.parametrize("fmt", FORMATS)
def test_tpu_kernel_matches_reference(fmt, m):
  k, n = SHAPES[m]
  values, scales = _weight(fmt, k, n, seed=m)
  x = _x(m, k, seed=m)
  got = qmatmul_tpu(x, values, scales, fmt, BLOCK, True, **_tpu_tiles(fmt))
  assert got.dtype == jnp.float32
  _assert_matches(got, x, values, scales, fmt)


@pytest.mark.parametrize("fmt", FORMATS)
def test_tpu_kernel_under_the_tpu_interpreter(fmt):
  # The TPU interpreter fills uninitialized buffers (the accumulator, partial tiles) with NaN.
  k, n = SHAPES[5]
  values, scales = _weight(fmt, k, n, seed=7)
  x = _x(5, k, seed=7)
  got = qmatmul_tpu(x, values, scales, fmt, BLOCK, pltpu.InterpretParams(), **_tpu_tiles(fmt))
  _assert_matches(got, x, values, scales, fmt)


@pytest.mark.parametrize("impl", ["gpu", "tpu"])
def test_e4m3_values_bfloat16_x_and_default_block(impl):
  # float8_e4m3fn values (not their bytes), bfloat16 activations, fp8_block's default 128 × 128.
  k, n, m = 160, 200, 3
  fn = qmatmul_gpu if impl == "gpu" else qmatmul_tpu
  x = _x(m, k).astype(jnp.bfloat16)
  values, scales = _weight("fp8", k, n, fp8_dtype=codecs.FP8_DTYPE)
  _assert_matches(fn(x, values, scales, "fp8", BLOCK, True), x, values, scales, "fp8")
  bytes_ = np.random.default_rng(3).integers(0, 127, (n, k), dtype=np.uint8)  # positive, no NaN
  values = codecs.fp8_values(jnp.asarray(bytes_))
  scales = jnp.asarray([[0.5, 2.0], [4.0, 0.125]], jnp.float32)
  got = fn(x, values, scales, "fp8_block", (128, 128), True)
  want = qmatmul_reference(x, values, scales, "fp8_block", (128, 128))
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * float(jnp.max(jnp.abs(want))))


def test_errors():
  k, n = SHAPES[1]
  x = _x(1, k)
  for fn in (qmatmul_gpu, qmatmul_tpu):
    values, scales = _weight("fp8", k, n)
    with pytest.raises(ValueError):
      fn(x[:, :-1], values, scales, "fp8", BLOCK, True)  # K mismatch
    with pytest.raises(ValueError):
      fn(x, values, scales[:-1], "fp8", BLOCK, True)  # scales not [N]
    with pytest.raises(ValueError):
      fn(x[0], values, scales, "fp8", BLOCK, True)  # x not a matrix
    values, scales = _weight("mxfp4", k, n)
    with pytest.raises(ValueError):
      fn(x, values[:, :, :8], scales, "mxfp4", BLOCK, True)  # not 16 bytes a block
    with pytest.raises(ValueError):
      fn(x, values, scales[:, :-1], "mxfp4", BLOCK, True)
    values, scales = _weight("fp8_block", k, n)
    with pytest.raises(ValueError):
      fn(x, values, scales[:-1], "fp8_block", BLOCK, True)  # wrong scale grid
    with pytest.raises(ValueError):
      fn(x, values, scales, "int4", BLOCK, True)
  values, scales = _weight("fp8_block", k, n)
  with pytest.raises(ValueError):
    qmatmul_gpu(x, values, scales, "fp8", BLOCK, True, block_n=24)  # not a power of two
  with pytest.raises(ValueError):  # a 24 × 24 scale block has no 16-wide power-of-two tile
    qmatmul_gpu(x, values, jnp.ones((3, 4), jnp.float32), "fp8_block", (24, 24), True)
  with pytest.raises(ValueError):
    qmatmul_tpu(x, values, scales, "fp8_block", BLOCK, True, block_n=100, block_k=64)


def _abstract(fmt, m=16, k=320, n=200, block=(128, 128)):
  s = jax.ShapeDtypeStruct
  x = s((m, k), jnp.bfloat16)
  if fmt == "float":
    return x, s((k, n), jnp.bfloat16), None
  if fmt == "fp8":
    return x, s((k, n), codecs.FP8_DTYPE), s((n,), jnp.float32)
  if fmt == "fp8_block":
    return x, s((n, k), codecs.FP8_DTYPE), s((-(-n // block[0]), -(-k // block[1])), jnp.float32)
  return x, s((n, k // 32, 16), jnp.uint8), s((n, k // 32), jnp.uint8)


@pytest.mark.parametrize("fmt", FORMATS)
def test_gpu_kernel_lowers_to_triton(fmt):
  fn = jax.jit(lambda x, v, s: qmatmul_gpu(x, v, s, fmt))
  text = fn.trace(*_abstract(fmt)).lower(lowering_platforms=("cuda",)).as_text()
  assert "xla.gpu.triton" in text


@pytest.mark.parametrize("fmt", FORMATS)
def test_tpu_kernel_lowers_to_mosaic(fmt):
  fn = jax.jit(lambda x, v, s: qmatmul_tpu(x, v, s, fmt))
  args = _abstract(fmt, k=1088, n=400)  # several (partial) 256 × 512 tiles
  text = fn.trace(*args).lower(lowering_platforms=("tpu",)).as_text()
  assert "tpu_custom_call" in text
