"""Recurrent form (with per-position states) vs chunked form of the gated delta rule, per call.

One layer's worth (B=1, 16 value heads, Dk = Dv = 128, float32) for blocks of T tokens; the
minimum over repeats, since CPUs here are shared. Usage: python tools/bench_gated_deltanet.py
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.models import gated_deltanet as gdn


def _min_ms(f, args: tuple, kwargs: dict, repeats: int) -> float:
  jax.block_until_ready(f(*args, **kwargs))
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(f(*args, **kwargs))
    times.append(time.perf_counter() - t0)
  return min(times) * 1e3


def main() -> None:
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
      "recurrent": _min_ms(rec, args, {}, 15 if t <= 64 else 5),
      "chunked": _min_ms(chk, args, {"chunk_size": 64}, 15 if t <= 64 else 5),
    }
    print(f"T={t:4d}  recurrent {res['recurrent']:8.2f} ms   chunked(64) {res['chunked']:8.2f} ms")


if __name__ == "__main__":
  main()
