"""The chunked gated delta rule as a Pallas kernel (GPU-style: Triton lowering).

Grid (B, H, Dv / block_v): one program per (sequence, value head, block of value columns). A
program walks the chunks of C tokens of its sequence in order (a `fori_loop` inside the kernel)
and carries the state block S [Dk, block_v] in float32 as the loop's carry (registers / shared
memory on a GPU; the Triton lowering has no scratch buffers). Per chunk, with Γ the in-chunk
cumulative log-decay and L[i, j] = exp(Γ_i − Γ_j) for j ≤ i (0 above the diagonal), the same
math as `jaxspec.models.gated_deltanet.chunked`:

  A  = strictly_lower(diag(β) K Kᵀ ⊙ L)
  T  = (I + A)⁻¹            forward substitution over the C rows (a `fori_loop`, static C)
  U  = T (β ⊙ V),  W = T (β ⊙ exp(Γ) ⊙ K)
  V' = U − W S              (the delta-rule corrections given the carried state)
  O  = (exp(Γ) ⊙ Q) S + (Q Kᵀ ⊙ L) V'
  S  ← exp(Γ_C) S + (exp(Γ_C − Γ) ⊙ K)ᵀ V'

`chunked` forms T by recursive block inversion (`unit_lower_inverse`), the kernel by
substitution, once per chunk; the two value blocks and the key product are then plain matmuls.
T depends only on k, g and β, so programs of the same head that hold different value blocks
recompute it (a C×C×C substitution, small next to the C×Dk×Dv products for Dk = Dv = 128, C = 64).

Inputs stay in the caller's layout [B, T, H, D] (BlockSpecs pick one head with a squeezed axis;
each chunk is a strided `pl.ds` load), so no transposed copy is made; only a T that is not a
multiple of C is padded (with g = 0, β = 0, k = 0 tokens, which leave S unchanged).

Status: checked in interpret mode on CPU (`interpret=True`) against reference.py and the
token-by-token recurrence, and lowered (not compiled, not run) for CUDA, where it becomes a
Triton call; no GPU was available when it was written. Triton needs power-of-two loads and
dot operands at least 16 wide: C, Dk and block_v must be powers of two >= 16 (checked here
when `interpret=False`; the tests use 8-wide heads in interpret mode). On hardware float32
`jnp.dot` may run as TF32, so expect a looser match than the 1e-5 of the interpret tests. Not
checked for TPU: a Mosaic version would want [B, H, T, D] inputs (the head axis out of the
tiled last two dimensions) and S in a VMEM scratch with the chunks as a sequential grid axis.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

_dot = functools.partial(jnp.dot, preferred_element_type=jnp.float32)


def _kernel(q_ref, k_ref, v_ref, g_ref, b_ref, s0_ref, o_ref, s_ref, *, chunk, n_chunks):
  c = chunk
  rows = jax.lax.broadcasted_iota(jnp.int32, (c, c), 0)
  cols = jax.lax.broadcasted_iota(jnp.int32, (c, c), 1)
  causal = cols <= rows
  strict = cols < rows
  eye = (rows == cols).astype(jnp.float32)
  lane = jax.lax.broadcasted_iota(jnp.int32, (c,), 0)

  def chunk_step(n, s):
    off = pl.multiple_of(n * c, c)
    q = q_ref[pl.ds(off, c), :].astype(jnp.float32)  # [C, Dk]
    k = k_ref[pl.ds(off, c), :].astype(jnp.float32)  # [C, Dk]
    v = v_ref[pl.ds(off, c), :].astype(jnp.float32)  # [C, bv]
    g = g_ref[pl.ds(off, c)].astype(jnp.float32)  # [C]
    beta = b_ref[pl.ds(off, c)].astype(jnp.float32)  # [C]
    cum = jnp.sum(jnp.where(causal, g[None, :], 0.0), axis=1)  # Γ_i = Σ_{j ≤ i} g_j
    decay = jnp.exp(jnp.where(causal, cum[:, None] - cum[None, :], -jnp.inf))  # L
    k_beta = k * beta[:, None]
    a = jnp.where(strict, _dot(k_beta, k.T) * decay, 0.0)

    def substitute(i, t):  # row i of (I + A)⁻¹ from rows < i: e_i − A[i, :] T
      a_i = jnp.sum(jnp.where(rows == i, a, 0.0), axis=0)  # [C], zero from column i on
      t_i = (lane == i).astype(jnp.float32) - jnp.sum(a_i[:, None] * t, axis=0)
      return jnp.where(rows == i, t_i[None, :], t)

    t = jax.lax.fori_loop(1, c, substitute, eye)
    e_cum = jnp.exp(cum)
    corrections = _dot(t, v * beta[:, None]) - _dot(_dot(t, k_beta * e_cum[:, None]), s)
    out = _dot(q * e_cum[:, None], s) + _dot(_dot(q, k.T) * decay, corrections)
    o_ref[pl.ds(off, c), :] = out.astype(o_ref.dtype)
    last = jnp.sum(g)  # Γ_C
    k_decayed = k * jnp.exp(last - cum)[:, None]
    return s * jnp.exp(last) + _dot(k_decayed.T, corrections)

  s = jax.lax.fori_loop(0, n_chunks, chunk_step, s0_ref[...].astype(jnp.float32))
  s_ref[...] = s


def _is_hw_width(n: int) -> bool:
  return n >= 16 and not n & (n - 1)


@functools.partial(jax.jit, static_argnames=("chunk_size", "block_v", "interpret", "num_warps"))
def gated_delta_pallas(
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  g: jax.Array,
  beta: jax.Array,
  state: jax.Array | None = None,
  chunk_size: int = 64,
  block_v: int | None = None,
  interpret: bool = False,
  num_warps: int = 4,
) -> tuple[jax.Array, jax.Array]:
  """Same contract as `gated_deltanet.chunked`: (out [B, T, H, Dv] float32, final state).

  q, k [B, T, H, Dk] (normalised, scaled, repeated to the value heads), v [B, T, H, Dv], g, β
  [B, T, H], state [B, H, Dk, Dv] or None (zeros). The chunk is min(chunk_size, the smallest
  power of two >= max(T, 16)); `block_v` (None: Dv) splits the value columns over programs and
  must divide Dv; `num_warps` is Triton's (ignored in interpret mode). Only checked in
  interpret mode and by lowering: see the module docstring.
  """
  b, t, h, dk = q.shape
  dv = v.shape[-1]
  if k.shape != q.shape or v.shape[:3] != (b, t, h) or not g.shape == beta.shape == (b, t, h):
    raise ValueError(f"shapes q {q.shape} k {k.shape} v {v.shape} g {g.shape} β {beta.shape}")
  block_v = dv if block_v is None else block_v
  if dv % block_v:
    raise ValueError(f"block_v={block_v} does not divide Dv={dv}")
  c = min(chunk_size, max(16, 1 << (t - 1).bit_length()))  # no wider than T needs
  if c < 1:
    raise ValueError(f"chunk_size={chunk_size} must be >= 1")
  if not interpret:
    for name, n in (("chunk", c), ("Dk", dk), ("block_v", block_v)):
      if not _is_hw_width(n):
        raise ValueError(f"{name}={n}: the Triton kernel needs a power of two >= 16")
  s0 = jnp.zeros((b, h, dk, dv), jnp.float32) if state is None else state.astype(jnp.float32)
  pad = (-t) % c
  if pad:  # g = 0, β = 0, k = 0: the padding tokens leave the state unchanged
    padding = lambda x: jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
    q, k, v, g, beta = map(padding, (q, k, v, g, beta))
  tp = t + pad

  seq = lambda width, col: pl.BlockSpec(
    (None, tp, None, width), lambda i, j, n: (i, 0, j, n if col else 0)
  )
  scalar = pl.BlockSpec((None, tp, None), lambda i, j, n: (i, 0, j))
  state_spec = pl.BlockSpec((None, None, dk, block_v), lambda i, j, n: (i, j, 0, n))
  out, s = pl.pallas_call(
    functools.partial(_kernel, chunk=c, n_chunks=tp // c),
    grid=(b, h, dv // block_v),
    in_specs=[seq(dk, False), seq(dk, False), seq(block_v, True), scalar, scalar, state_spec],
    out_specs=[seq(block_v, True), state_spec],
    out_shape=[
      jax.ShapeDtypeStruct((b, tp, h, dv), jnp.float32),
      jax.ShapeDtypeStruct((b, h, dk, dv), jnp.float32),
    ],
    # Explicit Triton params: without them JAX 0.10 lowers pallas_call on GPU with Mosaic GPU.
    compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=1),
    interpret=interpret,
    name="gated_delta_chunked",
  )(q, k, v, g, beta, s0)
  return out[:, :t], s
