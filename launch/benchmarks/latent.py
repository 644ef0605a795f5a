"""One decode step's attention over MLA's latent cache against an equivalent GQA cache.

MLA (models/mla.py, absorbed form) caches one vector of kv_lora_rank + qk_rope_head_dim values
per token and layer (state/latent.py) and scores it with every head; the equivalent per-head
cache keeps K and V for each of the `--heads` heads (MLA has as many KV heads as query heads),
at head_dim qk_nope_head_dim + qk_rope_head_dim (one width for K and V, as jaxspec's KV kinds
keep it; v_head_dim ≤ that). Both run through the same reader (models/attention.py) for one
token of one sequence over a context of N committed tokens, float32; the latent step also
pays the absorption (q_nope · W_UK) and the output's W_UV, which read kv_b_proj's weight once.

Printed per context: bytes each step reads (cache up to the context, plus kv_b_proj for MLA),
the minimum time over `--repeats`, and the GQA / latent time ratio. Defaults: DeepSeek-V3's
head dims with 16 heads (its 128 would need 3 GB of GQA cache per layer at 32K on CPU).

  python launch/bench.py latent
  python launch/bench.py latent --contexts=1024,32768 --heads=16
"""

from __future__ import annotations

import time
import types
from typing import Sequence

from absl import flags
import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.models import attention as attention_lib
from jaxspec.state import KV_FORMATS, LATENT_FORMATS

FLAGS = flags.FLAGS


def define_flags() -> None:
  """This benchmark's flags (defined when it runs)."""
  flags.DEFINE_list("contexts", ["1024", "32768"], "Committed tokens before the decode step.")
  flags.DEFINE_integer("heads", 16, "Query heads (= the GQA cache's KV heads, as in MLA).")
  flags.DEFINE_integer("kv_lora_rank", 512, "MLA's latent width r.")
  flags.DEFINE_integer("qk_nope_head_dim", 128, "Non-positional query/key width per head.")
  flags.DEFINE_integer("qk_rope_head_dim", 64, "RoPE width (shared key in MLA).")
  flags.DEFINE_integer("v_head_dim", 128, "Value width per head.")
  flags.DEFINE_integer("repeats", 5, "Timed steps per cache (the minimum is reported).")


def _geometry(heads: int, r: int, dn: int, dr: int, dv: int) -> tuple:
  """(GQA geometry, latent geometry): the attributes the cache kinds' `create` reads."""
  gqa = types.SimpleNamespace(num_kv_heads=heads, head_dim=dn + dr, dtype="float32")
  latent = types.SimpleNamespace(
    is_mla=True, latent_dim=r + dr, kv_lora_rank=r, dtype="float32", architecture="bench"
  )
  del dv
  return gqa, latent


def _filled(cache, rng: np.random.Generator):
  """The cache with random contents (the reader's cost does not depend on them)."""
  return jax.tree_util.tree_map(
    lambda x: jnp.asarray(rng.standard_normal(x.shape), x.dtype), cache
  )


def cache_bytes_per_token(heads: int, r: int, dn: int, dr: int) -> tuple[int, int]:
  """float32 bytes per token and layer: (GQA K + V, latent)."""
  return 2 * heads * (dn + dr) * 4, (r + dr) * 4


def steps(heads: int, r: int, dn: int, dr: int, dv: int):
  """(gqa_step, latent_step): jitted single-token attention, the cache donated and returned."""
  scale = (dn + dr) ** -0.5
  layer = jnp.int32(0)

  def gqa(q, k, v, cache, start):
    out, cache = attention_lib.attention(q, k, v, cache, layer, start, None, scale)
    return out, cache

  def latent(q, k_block, w_up, cache, start):
    q_nope, q_rope = q[..., :dn], q[..., dn:]
    w_uk, w_uv = w_up[..., :dn], w_up[..., dn:]
    q_abs = jnp.concatenate([jnp.einsum("bthd,rhd->bthr", q_nope, w_uk), q_rope], axis=-1)
    out_lat, cache = attention_lib.attention(
      q_abs, k_block, None, cache, layer, start, None, scale
    )
    return jnp.einsum("bthr,rhd->bthd", out_lat, w_uv), cache

  return jax.jit(gqa, donate_argnums=(3,)), jax.jit(latent, donate_argnums=(3,))


def _time(step, args: tuple, cache, repeats: int) -> float:
  """Minimum seconds of one step (the first call compiles)."""
  out, cache = step(*args[:-1], cache, args[-1])
  jax.block_until_ready(out)
  best = float("inf")
  for _ in range(repeats):
    t0 = time.perf_counter()
    out, cache = step(*args[:-1], cache, args[-1])
    jax.block_until_ready(out)
    best = min(best, time.perf_counter() - t0)
  return best


def measure(
  context: int, heads: int, r: int, dn: int, dr: int, dv: int, repeats: int
) -> dict[str, float]:
  """Bytes read and seconds of one decode step over `context` tokens, GQA and latent."""
  rng = np.random.default_rng(0)
  gqa_geo, lat_geo = _geometry(heads, r, dn, dr, dv)
  gqa_step, latent_step = steps(heads, r, dn, dr, dv)
  start = jnp.array([context], jnp.int32)
  normal = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)
  q = normal(1, 1, heads, dn + dr)
  gqa_cache = _filled(KV_FORMATS["float"].create(gqa_geo, 1, 1, context + 1), rng)
  gqa_s = _time(
    gqa_step, (q, normal(1, 1, heads, dn + dr), normal(1, 1, heads, dn + dr), start),
    gqa_cache, repeats,
  )
  del gqa_cache
  w_up = normal(r, heads, dn + dv) * r**-0.5
  lat_cache = _filled(LATENT_FORMATS["float"].create(lat_geo, 1, 1, context + 1), rng)
  lat_s = _time(latent_step, (q, normal(1, 1, 1, r + dr), w_up, start), lat_cache, repeats)
  gqa_tok, lat_tok = cache_bytes_per_token(heads, r, dn, dr)
  return {
    "context": context,
    "gqa_bytes": gqa_tok * context,
    "latent_bytes": lat_tok * context + w_up.size * 4,
    "gqa_s": gqa_s,
    "latent_s": lat_s,
  }


def _mb(n: float) -> str:
  return f"{n / 2**20:8.1f} MiB"


def main(argv: Sequence[str]) -> None:
  del argv
  dims = (
    FLAGS.heads, FLAGS.kv_lora_rank, FLAGS.qk_nope_head_dim, FLAGS.qk_rope_head_dim,
    FLAGS.v_head_dim,
  )
  heads, r, dn, dr, dv = dims
  gqa_tok, lat_tok = cache_bytes_per_token(heads, r, dn, dr)
  print(
    f"one decode step's attention, 1 layer, batch 1, float32, {jax.default_backend()}: "
    f"{heads} heads, r={r}, dn={dn}, dr={dr}, dv={dv}; cache bytes/token: "
    f"GQA {gqa_tok}, latent {lat_tok} ({gqa_tok / lat_tok:.1f}× less)"
  )
  print(f"{'context':>8} {'GQA read':>13} {'latent read':>13} {'GQA ms':>9} {'latent ms':>10} "
        f"{'bytes ratio':>12} {'time ratio':>11}")
  for ctx in (int(c) for c in FLAGS.contexts):
    m = measure(ctx, *dims, FLAGS.repeats)
    print(
      f"{ctx:>8} {_mb(m['gqa_bytes']):>13} {_mb(m['latent_bytes']):>13} "
      f"{m['gqa_s'] * 1e3:9.2f} {m['latent_s'] * 1e3:10.2f} "
      f"{m['gqa_bytes'] / m['latent_bytes']:11.1f}× {m['gqa_s'] / m['latent_s']:10.1f}×"
    )
