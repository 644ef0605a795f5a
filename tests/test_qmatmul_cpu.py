"""The CPU kernels of pallas_kernels/qmatmul (kernel_cpu.cc through the XLA FFI) against the jnp
oracle, and the seam that sends Dense products to them (jaxspec.models.matmul)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.models import matmul
from jaxspec.quant import codecs
from jaxspec.quant.formats import E2M1_VALUES, QTensor, materialize, quantize_weight
from pallas_kernels.qmatmul import cpu, qmatmul, qmatmul_reference

ROWS = (1, 2, 3, 5, 7, 16, 32)


@pytest.fixture(scope="module", autouse=True)
def kernels():
  if cpu._compiler() is None:  # pylint: disable=protected-access
    pytest.skip("no C++ compiler on PATH")
  assert cpu.available(), cpu.unavailable_reason()


def _operands(fmt: str, k: int, n: int, seed: int = 0):
  rng = np.random.default_rng(seed)
  w = jnp.asarray(rng.standard_normal((k, n)), jnp.float32)
  if fmt == "float":
    return w, None, (128, 128)
  if fmt == "fp8_block":
    values, _ = codecs.fp8_quantize(w.T, (-1,))
    block = (32, 48)
    scales = rng.uniform(0.25, 4.0, (-(-n // block[0]), -(-k // block[1])))
    return values, jnp.asarray(scales, jnp.float32), block
  q = quantize_weight(w, fmt, (-2,))
  return q.values, q.scales, (128, 128)


def _close(got: jax.Array, want: jax.Array) -> None:
  scale = float(jnp.max(jnp.abs(want))) + 1e-6
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=2e-6 * scale * 8)


_kernel = jax.jit(cpu.qmatmul_cpu, static_argnames=("fmt", "block"))


@pytest.mark.parametrize("fmt", ["float", "fp8", "fp8_block", "mxfp4"])
@pytest.mark.parametrize("k, n", [(96, 200), (160, 72), (512, 1030)])
def test_kernel_equals_reference(fmt, k, n):
  values, scales, block = _operands(fmt, k, n)
  rng = np.random.default_rng(1)
  for m in ROWS:
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
    got = _kernel(x, values, scales, fmt=fmt, block=block)
    _close(got, qmatmul_reference(x, values, scales, fmt, block))


@pytest.mark.parametrize("fmt", ["float", "fp8", "fp8_block", "mxfp4"])
def test_a_row_does_not_depend_on_its_neighbours(fmt):
  """Each output is accumulated in one order whatever M is: verify rows equal decode rows."""
  values, scales, block = _operands(fmt, 320, 144, seed=2)
  x = jnp.asarray(np.random.default_rng(3).standard_normal((32, 320)), jnp.float32)
  full = np.asarray(_kernel(x, values, scales, fmt=fmt, block=block))
  for m in (1, 2, 5, 17):
    part = np.asarray(_kernel(x[:m], values, scales, fmt=fmt, block=block))
    np.testing.assert_array_equal(part, full[:m])


def test_fp8_decodes_every_code_exactly():
  """One-hot rows read out each stored E4M3 byte: normals, subnormals, zeros, both signs."""
  codes = np.array([c for c in range(256) if c & 0x7F != 0x7F], np.uint8)  # all but NaN
  k = len(codes)
  values = np.zeros((k, 16), np.uint8)
  values[:, 3] = codes
  scales = np.full(16, 1.0, np.float32)
  x = jnp.eye(k, dtype=jnp.float32)[:32]
  want = codecs.fp8_values(jnp.asarray(codes)).astype(jnp.float32)
  for start in range(0, k, 32):
    xs = jnp.eye(k, dtype=jnp.float32)[start : start + 32]
    got = _kernel(xs, jnp.asarray(values), jnp.asarray(scales), fmt="fp8", block=(128, 128))
    np.testing.assert_array_equal(np.asarray(got[:, 3]), np.asarray(want[start : start + 32]))
  del x


def test_mxfp4_decodes_every_code_and_scale():
  codes = np.arange(32, dtype=np.uint8) % 16
  packed = (codes[0::2] | (codes[1::2] << 4)).astype(np.uint8)
  # From 2^-125 (0.5 · 2^-125 is still a normal float32; XLA flushes subnormal results) up.
  scale_bytes = np.array([2, 100, 127, 130, 200], np.uint8)
  values = np.broadcast_to(packed, (len(scale_bytes), 1, 16)).copy()
  scales = scale_bytes[:, None]
  x = jnp.eye(32, dtype=jnp.float32)
  got = np.asarray(_kernel(x, jnp.asarray(values), jnp.asarray(scales), fmt="mxfp4", block=(1, 1)))
  want = E2M1_VALUES[codes][:, None] * np.exp2(scale_bytes.astype(np.float64) - 127)[None, :]
  np.testing.assert_array_equal(got, want.astype(np.float32))


def test_mxfp4_grouped_along_k():
  """An output projection [heads, head_dim, hidden] blocked along head_dim: G groups along K."""
  w = jax.random.normal(jax.random.key(0), (3, 64, 40))
  q = quantize_weight(w, "mxfp4", (-3, -2))
  values, scales = q.values, q.scales  # [3, 40, 2, 16], [3, 40, 2]
  x = jax.random.normal(jax.random.key(1), (5, 192))
  want = x @ q.dequantize().reshape(192, 40)
  _close(_kernel(x, values, scales, fmt="mxfp4", block=(128, 128)), want)
  _close(qmatmul_reference(x, values, scales, "mxfp4"), want)


def test_auto_differentiates_through_the_reference():
  w = jax.random.normal(jax.random.key(0), (64, 48))
  x = jax.random.normal(jax.random.key(1), (3, 64))
  got = jax.grad(lambda x, w: jnp.sum(qmatmul(x, w, None, "float") ** 2), (0, 1))(x, w)
  want = jax.grad(lambda x, w: jnp.sum((x @ w) ** 2), (0, 1))(x, w)
  for g, h in zip(got, want):
    _close(g, h)


def test_auto_lowers_the_kernel_for_cpu_only():
  values, scales, block = _operands("fp8", 64, 48)
  f = jax.jit(lambda x: qmatmul(x, values, scales, "fp8"))
  x = jnp.ones((4, 64), jnp.float32)
  assert cpu.TARGET_PREFIX + "fp8" in f.lower(x).as_text()
  for platform in ("cuda", "tpu"):
    text = f.trace(x).lower(lowering_platforms=(platform,)).as_text()
    assert cpu.TARGET_PREFIX not in text
  # Past MAX_KERNEL_ROWS (a prefill) XLA's GEMM takes the product.
  assert cpu.TARGET_PREFIX not in f.lower(jnp.ones((33, 64), jnp.float32)).as_text()


@pytest.mark.parametrize(
  "fmt, axes, shape",
  [
    ("fp8", (-3,), (48, 4, 16)),  # q_proj: [hidden, heads, head_dim]
    ("fp8", (-3, -2), (4, 16, 48)),  # o_proj: [heads, head_dim, hidden]
    ("mxfp4", (-2,), (64, 48)),
    ("mxfp4", (-3, -2), (4, 32, 48)),
    ("float", (), (4, 16, 48)),
  ],
)
def test_dense_seam_equals_dequantize_then_dot(fmt, axes, shape):
  w = jax.random.normal(jax.random.key(2), shape)
  weight = w if fmt == "float" else quantize_weight(w, fmt, axes)
  in_dims = len(axes) or 2
  assert matmul.kernel_operands(weight, in_dims) is not None
  x = jax.random.normal(jax.random.key(3), (2, 3, *shape[:in_dims]))
  f = jax.jit(lambda x, w: matmul.dense(x, w, in_dims, jnp.float32))
  assert cpu.TARGET_PREFIX in f.lower(x, weight).as_text()
  want = jax.lax.dot_general(
    x, materialize(weight, jnp.float32), ((tuple(range(2, 2 + in_dims)), tuple(range(in_dims))), ((), ()))
  )
  _close(f(x, weight), want)


def test_dense_seam_leaves_other_layouts_to_xla():
  w = quantize_weight(jax.random.normal(jax.random.key(0), (64, 48)), "fp8", (-1,))
  assert matmul.kernel_operands(w, 1) is None
  bf16 = jnp.ones((64, 48), jnp.bfloat16)
  x = jnp.ones((2, 64), jnp.bfloat16)
  text = jax.jit(lambda x: matmul.dense(x, bf16, 1, jnp.bfloat16)).lower(x).as_text()
  assert cpu.TARGET_PREFIX not in text


def test_fp8_block_seam_reads_the_hf_layout():
  rng = np.random.default_rng(4)
  w = jnp.asarray(rng.standard_normal((80, 4, 16)), jnp.float32)  # [hidden, heads, head_dim]
  values, _ = codecs.fp8_quantize(w.reshape(80, 64).T, (-1,))
  scales = jnp.asarray(rng.uniform(0.5, 2, (1, 1)), jnp.float32)
  q = QTensor(values, scales, "fp8_block", (-3,), layout=("out_heads", (80, 4, 16), (128, 128)))
  x = jnp.asarray(rng.standard_normal((3, 80)), jnp.float32)
  got = jax.jit(lambda x: matmul.dense(x, q, 1, jnp.float32))(x)
  _close(got, jnp.einsum("mh,hnd->mnd", x, q.dequantize()))


def test_bad_operands_raise():
  values, scales, _ = _operands("mxfp4", 64, 48)
  with pytest.raises(ValueError, match="K=96"):
    qmatmul(jnp.ones((2, 96)), values, scales, "mxfp4")
  with pytest.raises(ValueError, match="unknown format"):
    qmatmul(jnp.ones((2, 64)), values, scales, "int4")
  with pytest.raises(ValueError, match="scales"):
    qmatmul(jnp.ones((2, 64)), values, scales[:, :1], "mxfp4")


PORTABLE_CHECK = """
import jax, jax.numpy as jnp, numpy as np
from jaxspec.quant.formats import quantize_weight
from pallas_kernels.qmatmul import cpu, qmatmul_reference
assert cpu.available(), cpu.unavailable_reason()
w = jax.random.normal(jax.random.key(0), (160, 72))
for fmt in ("fp8", "mxfp4"):
  q = quantize_weight(w, fmt, (-2,))
  for m in (1, 5):
    x = jax.random.normal(jax.random.key(m), (m, 160))
    got = cpu.qmatmul_cpu(x, q.values, q.scales, fmt, (128, 128))
    want = qmatmul_reference(x, q.values, q.scales, fmt)
    assert float(jnp.max(jnp.abs(got - want))) < 1e-4 * float(jnp.max(jnp.abs(want))), fmt
print("portable ok")
"""


@pytest.mark.skipif(
  __import__("platform").machine() not in ("x86_64", "AMD64"), reason="x86 -march names"
)
def test_portable_decoders(tmp_path):
  """The decoders other processors compile (no AVX-512, no F16C) agree with the oracle too."""
  import os  # pylint: disable=import-outside-toplevel
  import subprocess  # pylint: disable=import-outside-toplevel
  import sys  # pylint: disable=import-outside-toplevel

  env = dict(os.environ, JAXSPEC_CPU_MARCH="x86-64-v2", JAXSPEC_KERNEL_CACHE=str(tmp_path))
  env["PYTHONPATH"] = os.pathsep.join([os.getcwd(), env.get("PYTHONPATH", "")])
  done = subprocess.run(
    [sys.executable, "-c", PORTABLE_CHECK], env=env, capture_output=True, text=True, timeout=300
  )
  assert done.returncode == 0, done.stderr[-3000:]
  assert "portable ok" in done.stdout
