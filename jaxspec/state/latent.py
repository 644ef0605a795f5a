"""Multi-head Latent Attention's cache: one latent vector per token and layer (models/mla.py).

An MLA layer stores, per token, the normalised KV latent c (kv_lora_rank values) and the shared
RoPE key (qk_rope_head_dim values) as one vector of `config.latent_dim` values: 576 for
DeepSeek-V3, against 2 × 128 heads × 128 = 32768 for per-head K/V of the same model. Queries in
the absorbed form ([q_nope · W_UK; q_rope], per head) score it as a single shared key head, and
its first kv_lora_rank values are the single shared value head (the output is multiplied by W_UV
afterwards), so attention reads each cached token once for all heads.

`read_chunk` therefore answers with one KV head: k = the whole vector [B, S, 1, latent_dim],
v = its latent part [B, S, 1, kv_lora_rank]; attention's shared reader (models/attention.py)
needs nothing else. `write` takes the block's vectors as k (v is ignored: it is part of k).

Formats, as for the K/V kinds: float; FP8 (E4M3 bytes + one float32 scale per token vector);
Q4_0 (llama.cpp blocks of 32 along the vector; kv_lora_rank + qk_rope_head_dim must be a
multiple of 32, as 512 + 64 is). Bytes per token and layer: latent_dim × (4 | 2 | 1 + 4/latent_dim
| 18/32).
"""

from __future__ import annotations

from typing import Any, ClassVar

import flax.struct
import jax
import jax.numpy as jnp

from jaxspec.errors import ConfigError
from jaxspec.quant.codecs import (
  Q4_BLOCK,
  fp8_bits,
  fp8_dequantize,
  fp8_quantize,
  fp8_values,
  q4_0_dequantize,
  q4_0_quantize,
)
from jaxspec.state.base import Kind, block_slots, move_path, put_slots, read_slots, take_slots
from jaxspec.state.kv import FullLengthKV

LATENT_AXES = ("layers", "batch", "length", "kv_lora")
LATENT_SCALE_AXES = ("layers", "batch", "length")


class _LatentCache(FullLengthKV):
  """What the latent formats share: a full-length cache of one vector per token (slot s holds
  position s; `FullLengthKV` answers the range and chunk questions through `read`), stored as
  `encode` makes it (`c`, `scale`) and read back through `decode`.

  A subclass is a flax struct with fields c, scale (None for float), rank and dtype, and
  defines `encode(x) -> (stored, scale)`, `decode(stored, scale, dtype)` and `create`.
  """

  @property
  def max_len(self) -> int:
    return self.c.shape[2]

  @classmethod
  def _check(cls, config) -> None:
    if not config.is_mla:
      raise ConfigError(f"{config.architecture}: a latent cache is for MLA targets only")

  def write(self, layer: jax.Array, start: jax.Array, k: jax.Array, v: Any = None):
    """k [B, T, 1, latent_dim] (latent ‖ RoPE key) → (entry, k as stored, its latent part)."""
    del v  # the value is the latent part of k
    return self.put(layer, *block_slots(start, k.shape[1]), k)

  def put(self, layer: jax.Array, rows: jax.Array, slots: jax.Array, k: jax.Array, v: Any = None):
    """As `write`, at explicit rows and slots [B, T] (out of range: dropped): a paged pool's
    pages (state/paged.py)."""
    del v
    stored, scale = self.encode(k[:, :, 0])
    entry = self.replace(
      c=put_slots(self.c, layer, rows, slots, stored),
      scale=None if scale is None else put_slots(self.scale, layer, rows, slots, scale),
    )
    k = self.decode(stored, scale, self.dtype)[:, :, None]
    return entry, k, k[..., : self.rank]

  def take(self, layer: jax.Array, rows: jax.Array, slots: jax.Array):
    """As `read`, at explicit rows and slots [B, T] (out of range: zeros); `put`'s inverse."""
    piece = lambda x: None if x is None else take_slots(x, layer, rows, slots)
    k = self.decode(piece(self.c), piece(self.scale), self.dtype)[:, :, None]
    return k, k[..., : self.rank]

  def read(self, layer: jax.Array, offset: jax.Array, size: int) -> tuple[jax.Array, jax.Array]:
    """Slots offset..offset+size−1 as one KV head: k [B, S, 1, latent_dim], v its latent part."""
    piece = lambda x: None if x is None else read_slots(x, layer, offset, size)
    k = self.decode(piece(self.c), piece(self.scale), self.dtype)[:, :, None]
    return k, k[..., : self.rank]

  def commit_path(self, start: jax.Array, path: jax.Array):
    return self.replace(
      c=move_path(self.c, start, path),
      scale=None if self.scale is None else move_path(self.scale, start, path),
    )

  def values(self) -> jax.Array:
    """The float vectors this cache stands for [L, B, S, latent_dim] (tests)."""
    return self.decode(self.c, self.scale, self.dtype)


@flax.struct.dataclass
class LatentKV(_LatentCache):
  """MLA latent cache in a float dtype: c [L, B, S, kv_lora_rank + qk_rope_head_dim]."""

  c: jax.Array
  scale: Any = None
  rank: int = flax.struct.field(pytree_node=False, default=0)
  dtype: str = flax.struct.field(pytree_node=False, default="float32")

  format: ClassVar[str] = "float"
  AXES: ClassVar[dict] = {"c": LATENT_AXES}

  @staticmethod
  def encode(x: jax.Array):
    return x, None

  @staticmethod
  def decode(stored: jax.Array, scale: Any, dtype: Any) -> jax.Array:
    del scale
    return stored.astype(dtype)

  @classmethod
  def create(cls, config, num_layers: int, batch: int, max_len: int) -> "LatentKV":
    cls._check(config)
    shape = (num_layers, batch, max_len, config.latent_dim)
    return cls(jnp.zeros(shape, jnp.dtype(config.dtype)), None, config.kv_lora_rank, config.dtype)


@flax.struct.dataclass
class LatentFP8(_LatentCache):
  """MLA latent cache in FP8: E4M3 bytes c [L, B, S, latent_dim] (uint8, as FP8KV keeps them)
  and one float32 scale per token vector [L, B, S]."""

  c: jax.Array
  scale: jax.Array
  rank: int = flax.struct.field(pytree_node=False, default=0)
  dtype: str = flax.struct.field(pytree_node=False, default="float32")

  format: ClassVar[str] = "fp8"
  AXES: ClassVar[dict] = {"c": LATENT_AXES, "scale": LATENT_SCALE_AXES}

  @staticmethod
  def encode(x: jax.Array):
    q, scale = fp8_quantize(x)
    return fp8_bits(q), scale

  @staticmethod
  def decode(stored: jax.Array, scale: jax.Array, dtype: Any) -> jax.Array:
    return fp8_dequantize(fp8_values(stored), scale, dtype)

  @classmethod
  def create(cls, config, num_layers: int, batch: int, max_len: int) -> "LatentFP8":
    cls._check(config)
    lead = (num_layers, batch, max_len)
    return cls(
      jnp.zeros((*lead, config.latent_dim), jnp.uint8),
      jnp.ones(lead, jnp.float32),
      config.kv_lora_rank,
      config.dtype,
    )


@flax.struct.dataclass
class LatentQ4(_LatentCache):
  """MLA latent cache in llama.cpp's Q4_0: nibbles c [L, B, S, latent_dim / 2] (uint8) and
  float16 scales [L, B, S, latent_dim / 32]."""

  c: jax.Array
  scale: jax.Array
  rank: int = flax.struct.field(pytree_node=False, default=0)
  dtype: str = flax.struct.field(pytree_node=False, default="float32")

  format: ClassVar[str] = "q4_0"
  AXES: ClassVar[dict] = {"c": LATENT_AXES, "scale": LATENT_AXES}

  encode = staticmethod(q4_0_quantize)

  @staticmethod
  def decode(stored: jax.Array, scale: jax.Array, dtype: Any) -> jax.Array:
    return q4_0_dequantize(stored, scale, dtype)

  @classmethod
  def create(cls, config, num_layers: int, batch: int, max_len: int) -> "LatentQ4":
    cls._check(config)
    if config.latent_dim % Q4_BLOCK:
      raise ConfigError(
        f"kv_format='q4_0' needs kv_lora_rank + qk_rope_head_dim to be a multiple of "
        f"{Q4_BLOCK}, got {config.latent_dim}"
      )
    lead = (num_layers, batch, max_len)
    return cls(
      jnp.zeros((*lead, config.latent_dim // 2), jnp.uint8),
      jnp.zeros((*lead, config.latent_dim // Q4_BLOCK), jnp.float16),
      config.kv_lora_rank,
      config.dtype,
    )


LATENT_FORMATS = {"float": LatentKV, "fp8": LatentFP8, "q4_0": LatentQ4}


@flax.struct.dataclass
class SparseLatent(Kind):
  """A DSA layer run's entry: the latent cache attention reads (`latent`, a LATENT_FORMATS
  kind) beside the lightning indexer's keys (`index`, state/indexer.py), slot for slot.

  Attention's questions go to the latent cache; the indexer reads and writes `index` itself
  (models/dsa.py); an accepted tree path moves both.
  """

  latent: Any
  index: Any

  @property
  def format(self) -> str:
    return self.latent.format

  @property
  def kv_format(self) -> str:
    return self.latent.kv_format

  @property
  def max_len(self) -> int:
    return self.latent.max_len

  def write(self, layer: jax.Array, start: jax.Array, k: jax.Array, v: Any = None):
    latent, k, v = self.latent.write(layer, start, k, v)
    return self.replace(latent=latent), k, v

  def read_range(self, start: jax.Array, lowest: jax.Array | None = None):
    return self.latent.read_range(start, lowest)

  def read_chunk(self, layer: jax.Array, offset: jax.Array, size: int, start: jax.Array):
    return self.latent.read_chunk(layer, offset, size, start)

  def commit_path(self, start: jax.Array, path: jax.Array) -> "SparseLatent":
    return SparseLatent(self.latent.commit_path(start, path), self.index.commit_path(start, path))

  # Paged (state/paged.py): the latents and the indexer keys each in a pool of their own, under
  # one page table; the page questions go to both.

  @property
  def paged_part(self):
    both = self.latent.paged_part is not None and self.index.paged_part is not None
    return self.latent.paged_part if both else None

  def with_table(self, table: jax.Array) -> "SparseLatent":
    return SparseLatent(self.latent.with_table(table), self.index.with_table(table))

  def load_pages(self, source: "SparseLatent", pages: jax.Array) -> "SparseLatent":
    return SparseLatent(
      self.latent.load_pages(source.latent, pages), self.index.load_pages(source.index, pages)
    )

  def adopt_row(self, slot: jax.Array, row: "SparseLatent"):
    latent, row_latent = self.latent.adopt_row(slot, row.latent)
    index, row_index = self.index.adopt_row(slot, row.index)
    return SparseLatent(latent, index), SparseLatent(row_latent, row_index)
