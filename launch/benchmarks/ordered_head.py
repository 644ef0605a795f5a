"""The Gemma 4 assistant's ordered-embedding head against the full vocabulary projection.

A random head of Gemma 4's vocabulary (262,144 tokens) at each assistant width in --hiddens:
per draft step (rows of one token each), the time of the full head (h · Eᵀ over every token,
then the argmax) and of the ordered head (`drafters.gemma4_assistant.ordered_logits`: the
cluster scores, the top-k clusters' rows, their logits scattered into a vocabulary-wide row
filled with the smallest − 1, then the argmax), fastest of --repeats calls, and the bytes of
table each reads. Float32 on this machine's backend. Usage:
python launch/bench.py ordered-head [--hiddens=512,1536] [--batch=1]
"""

from __future__ import annotations

import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags

from jaxspec.drafters.gemma4_assistant import ordered_logits

FLAGS = flags.FLAGS


def define_flags() -> None:
  flags.DEFINE_list("hiddens", ["512", "1536"], "assistant widths to measure")
  flags.DEFINE_integer("vocab", 262144, "vocabulary size (Gemma 4's)")
  flags.DEFINE_integer("centroids", 2048, "num_centroids (transformers' default)")
  flags.DEFINE_integer("top_k", 32, "centroid_intermediate_top_k (transformers' default)")
  flags.DEFINE_integer("batch", 1, "rows per draft step")
  flags.DEFINE_integer("repeats", 20, "calls timed; the fastest is reported")


def fastest_ms(f, args: tuple, repeats: int) -> float:
  jax.block_until_ready(f(*args))
  best = float("inf")
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(f(*args))
    best = min(best, time.perf_counter() - t0)
  return best * 1e3


def main(argv: Sequence[str]) -> None:
  del argv
  v, c, k, b = FLAGS.vocab, FLAGS.centroids, FLAGS.top_k, FLAGS.batch
  full = jax.jit(lambda h, t: jnp.argmax(jnp.einsum("bth,vh->btv", h, t), -1))
  ordered = jax.jit(
    lambda h, cen, order, t: jnp.argmax(ordered_logits(h, cen, order, t, k), -1)
  )
  kept = c + k * (v // c)  # rows the ordered head reads: centroids and the kept clusters
  print(
    f"vocab {v}, {c} clusters of {v // c}, top {k} kept; batch {b}; float32 on "
    f"{jax.default_backend()}; fastest of {FLAGS.repeats}"
  )
  for hidden in map(int, FLAGS.hiddens):
    rng = np.random.default_rng(0)
    table = jnp.asarray(rng.normal(0, 0.02, (v, hidden)), jnp.float32)
    centroids = jnp.asarray(rng.normal(0, 0.02, (hidden, c)), jnp.float32)
    order = jnp.asarray(rng.permutation(v), jnp.int32)
    h = jnp.asarray(rng.normal(size=(b, 1, hidden)), jnp.float32)
    t_full = fastest_ms(full, (h, table), FLAGS.repeats)
    t_ordered = fastest_ms(ordered, (h, centroids, order, table), FLAGS.repeats)
    print(
      f"hidden {hidden:5d}: full {t_full:8.3f} ms ({v * hidden * 4 / 2**20:7.1f} MiB read)   "
      f"ordered {t_ordered:8.3f} ms ({kept * hidden * 4 / 2**20:6.1f} MiB read)   "
      f"full / ordered {t_full / t_ordered:5.1f}×"
    )
