"""Recurrent form (with per-position states) vs chunked form of the gated delta rule, per call.

One layer's worth (B=1, 16 value heads, Dk = Dv = 128, float32) for blocks of T tokens; the
minimum over repeats, since CPUs here are shared. Then the Pallas kernel
(pallas_kernels/gated_delta) once per block of 16 tokens or more, on CPU in interpret mode: its
largest difference from `chunked` is printed, its time is not (interpret mode runs the kernel
body as ordinary XLA ops, one program after another, so says nothing of its speed on a GPU; on a
GPU backend it runs compiled and is timed like the others). Usage:
python launch/bench.py gdn
"""

from __future__ import annotations

import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.models import gated_deltanet as gdn
from pallas_kernels.gated_delta import gated_delta_pallas


def define_flags() -> None:
  """This benchmark has no flags of its own."""


def min_ms(f, args: tuple, kwargs: dict, repeats: int) -> float:
  jax.block_until_ready(f(*args, **kwargs))
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(f(*args, **kwargs))
    times.append(time.perf_counter() - t0)
  return min(times) * 1e3


def main(argv: Sequence[str]) -> None:
  del argv
  b, h, dk, dv = 1, 16, 128, 128
  rec = jax.jit(gdn.recurrent)
  chk = jax.jit(gdn.chunked, static_argnames="chunk_size")
  for t in (1, 4, 8, 16, 64, 256):
    rng = np.random.default_rng(0)
    q = gdn.l2norm(jnp.asarray(rng.normal(size=(b, t, h, dk)), jnp.float32)) * dk**-0.5
    k = gdn.l2norm(jnp.asarray(rng.normal(size=(b, t, h, dk)), jnp.float32))
    v = jnp.asarray(rng.normal(size=(b, t, h, dv)), jnp.float32)
    g = -jnp.asarray(rng.uniform(0.01, 1.0, size=(b, t, h)), jnp.float32)
    beta = jax.nn.sigmoid(jnp.asarray(rng.normal(size=(b, t, h)), jnp.float32))
    s0 = jnp.zeros((b, h, dk, dv), jnp.float32)
    args = (q, k, v, g, beta, s0)
    res = {
      "recurrent": min_ms(rec, args, {}, 15 if t <= 64 else 5),
      "chunked": min_ms(chk, args, {"chunk_size": 64}, 15 if t <= 64 else 5),
    }
    line = f"T={t:4d}  recurrent {res['recurrent']:8.2f} ms   chunked(64) {res['chunked']:8.2f} ms"
    if t >= 16:
      interpret = jax.default_backend() == "cpu"
      out, s = gated_delta_pallas(*args, chunk_size=64, interpret=interpret)
      ref_out, ref_s = chk(*args, chunk_size=64)
      err = max(float(jnp.max(jnp.abs(out - ref_out))), float(jnp.max(jnp.abs(s - ref_s))))
      if interpret:
        line += f"   pallas (interpret) runs, max |Δ| vs chunked {err:.1e}"
      else:
        ms = min_ms(gated_delta_pallas, args, {"chunk_size": 64}, 15 if t <= 64 else 5)
        line += f"   pallas {ms:8.2f} ms (max |Δ| {err:.1e})"
    print(line)

