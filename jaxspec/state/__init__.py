"""The decoding state a forward reads and writes: one entry per layer segment.

The decoder scans each maximal run of same-kind layers (`ModelConfig.segments()`); each run owns
one entry of `DecodingState.segments`, stacked over its layers (leading axis `layers`). An entry
is a *layer-state kind*: a pytree class that answers the questions below itself, so attention,
the decoder, the engine and the drafters use an entry without asking which kind it is (no
`isinstance` on kinds, no branching on `format` outside the kinds).

The protocol (`Kind` gives the defaults; `start` [B] is a block's first position):

  ====================================  =========================================================
  `Kind.create(config, L, B, max_len)`  a zero entry for L layers and B rows
  `max_len`                             slots per row (the read extent of one layer)
  `begin_block(start, t, keep)`         before a forward writes a block of t tokens: with `keep`
                                        the block may be accepted only in part, so a kind that
                                        cannot rewind (recurrent) keeps every prefix's state;
                                        attention kinds write scratch slots: themselves
  `write(layer, start, k, v)`           a block's K/V → (entry, k, v as stored): the block reads
                                        its own K/V exactly as later queries will
  `read_range(start, lowest)`           (lo, hi): the slots a block may need, from the first a
                                        sliding window reaches (`lowest`: the lowest position a
                                        query's window sees, or None) to past the last live one
  `read_chunk(layer, off, size, start)` `KVChunk`: float K/V of slots off..off+size−1, the
                                        position each slot holds and which ones a block at
                                        `start` may see (empty, floored, later slots: not)
  `kernel_operands()`                   the stored arrays the Pallas tree-attention kernel reads
                                        (k, v and FP8 scales), or None where it cannot
  `commit_path(start, path)`            the accepted chain prefix or tree path (node indices
                                        [B, n], root first) moved to positions start..start+n−1
  `committed(lengths)`                  what advancing to `lengths` committed tokens means for
                                        the kind (recurrent: keep that prefix's snapshot)
  `with_bounds(floor, limit)`           a ring's read floor / write limit; kinds that hold every
                                        position have none and return themselves
  `AXES`                                the logical axis of every dimension of every array field
  `format`, `kv_format`                 its name (messages); the `EngineConfig.kv_format` it
                                        stores (full-length KV kinds) or None
  ====================================  =========================================================

`write`, `read_range`, `read_chunk` and `kernel_operands` are what attention asks (the K/V
kinds answer them); the recurrent kind is read and written by its own mixer instead
(models/gated_deltanet.py: `initial`, `write_snapshots`, `write_final`), as a new mixer's kind
would be. Everything else every kind answers, so the decoder and the engine treat entries alike.

Attention kinds keep the rule "slots at or past `lengths` are scratch": a block writes past the
committed length, and only the accepted prefix becomes part of the text when `lengths`
advances. Attention reads an entry chunk by chunk through `read_range` / `read_chunk` only (the
shared online-softmax reader, models/attention.py), so a kind is free in how it stores: a full
cache maps slot = position, a ring records the position of each slot.

Kinds here:

  FloatKV, FP8KV, Q4KV   full-length K/V in float, E4M3 (+ a scale per token and head) or
                         llama.cpp's Q4_0; `KV_FORMATS` maps `EngineConfig.kv_format` to them
  RingKV                 float K/V of the most recent positions in a ring, a position per slot
                         and layer (EAGLE-3's draft layer over long contexts)
  ContextRing            float K/V per layer of context positions, one position per slot
                         shared by the layers, written by its owner for all layers at once
                         (DFlash's target-feature store, injected into every drafter layer)
  SharedKV               a run of Gemma 4's KV-shared layers: nothing stored, its layers read
                         the K/V of the run `source` names (state/shared.py)
  LinearState            the fixed-size recurrent state of Gated DeltaNet layers, read by its
                         mixer (`initial`), with per-prefix snapshots while a block is pending
  LatentKV, LatentFP8,   MLA's cache (state/latent.py): one vector per token and layer, the
  LatentQ4               KV latent and the shared RoPE key, read as one KV head (k: all of it,
                         v: the latent) by absorbed-form queries; `LATENT_FORMATS` maps
                         `kv_format` to them for MLA targets
  IndexerKeys            DeepSeek Sparse Attention's lightning-indexer keys [L, B, S, D], one
                         small key per position, read whole by the indexer (models/dsa.py:
                         `write`, `read`) to choose each query's top-k keys
  SparseLatent           a DSA layer run's entry: its latent cache beside its indexer keys
  SlidingKV              a sliding-window layer run's K/V (state/sliding.py): a ring of
                         window + slack slots in any `KV_FORMATS` storage, read by stored
                         position; `DecodingState.create` gives it to every sliding run whose
                         ring is smaller than max_len

  PagedKV                a full-length kind's storage (K/V, MLA latents, DSA indexer keys) in
                         pages of one pool shared by the rows, each row with a page table
                         (state/paged.py); `DecodingState.create(..., paging=Paging(page_size,
                         num_pages))` gives it to every full-attention K/V run, every latent run
                         and both halves of a `SparseLatent`. Four more protocol answers serve
                         it (other kinds: nothing to do): `with_table(table)` (new page
                         tables), `adopt_row(slot, row)` (a one-row entry's pages copied into
                         the pool before the row is spliced in), `load_pages(source, pages)`
                         (a cached prefix read from another state's pools) and `paged_part`
                         (the paged entry whose table and pool size answer for the entry)

Logical axes: each kind's `AXES` table names the logical axis of every dimension of its arrays
(`layers`, `batch`, `length`, `kv_heads`, `head_dim`); `logical_axes` reads those tables for a
whole state pytree (the engine's, the drafters' states), so the state can be placed and kept on a
device mesh by the rules of jaxspec/sharding.py.
"""

from __future__ import annotations

from typing import Any, ClassVar, NamedTuple, Optional

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from jaxspec.errors import ConfigError
from jaxspec.state.base import (
  KV_AXES,
  NO_LIMIT,
  POS_AXES,
  RING_EMPTY,
  ROW_AXES,
  SCALE_AXES,
  KVChunk,
)
from jaxspec.state.indexer import INDEXER_AXES, IndexerKeys
from jaxspec.state.kv import FP8KV, KV_FORMATS, FloatKV, Q4KV
from jaxspec.state.latent import LATENT_FORMATS, LatentFP8, LatentKV, LatentQ4, SparseLatent
from jaxspec.state.linear import LINEAR_STATE_AXES, LinearState
from jaxspec.state.paged import PagedKV
from jaxspec.state.ring import ContextRing, RingKV
from jaxspec.state.shared import SharedKV
from jaxspec.state.sliding import SlidingKV

# Ring slots past the window a sliding-window entry keeps when its creator does not say: covers
# verify blocks of up to 64 tokens (chains of γ ≤ 63, trees of budget ≤ 63).
DEFAULT_SLACK = 64

__all__ = [
  "INDEXER_AXES",
  "KV_AXES",
  "KV_FORMATS",
  "LINEAR_STATE_AXES",
  "NO_LIMIT",
  "PagedKV",
  "Paging",
  "POS_AXES",
  "RING_EMPTY",
  "ROW_AXES",
  "SCALE_AXES",
  "ContextRing",
  "DecodingState",
  "FP8KV",
  "FloatKV",
  "IndexerKeys",
  "KVChunk",
  "LATENT_FORMATS",
  "LatentFP8",
  "LatentKV",
  "LatentQ4",
  "LinearState",
  "Q4KV",
  "RingKV",
  "SharedKV",
  "SlidingKV",
  "SparseLatent",
  "DEFAULT_SLACK",
  "KVGeometry",
  "logical_axes",
]


class Paging(NamedTuple):
  """Paged full-attention K/V (state/paged.py): pages of `page_size` slots from a pool of
  `num_pages` (None: as many as the rows would hold contiguously)."""

  page_size: int
  num_pages: Optional[int] = None


@flax.struct.dataclass
class DecodingState:
  """The model's decoding state: one entry per layer segment plus committed lengths [B].

  A forward takes it, writes its block into every entry and returns it with `lengths`
  unchanged; the caller then commits what was accepted (`commit` for a chain prefix,
  `commit_path` first for a tree path).
  """

  segments: tuple
  lengths: jax.Array  # [B] int32: committed tokens per sequence

  AXES: ClassVar[dict] = {"lengths": ROW_AXES}  # the segments name their own

  @classmethod
  def create(
    cls,
    config,
    batch: int,
    max_len: int,
    kv_format: str = "float",
    segment_layers: tuple[int, ...] | None = None,
    slack: int = DEFAULT_SLACK,
    paging: Optional[Paging] = None,
  ) -> "DecodingState":
    """A zero state for `config`'s main stack (or for runs of `segment_layers` layers, e.g.
    (1,) for one MTP or drafter layer).

    With `paging`, full-attention K/V runs, MLA latent runs and DSA indexer keys are `PagedKV`
    (one pool per run and array kind; a page id names the same positions in every pool, so one
    page table serves them all); sliding rings and recurrent entries stay per row.

    Sliding-window runs keep a ring of window + `slack` slots (`SlidingKV`) when that is fewer
    than max_len: `slack` must be at least the widest block that may be accepted only in part
    (the engine's speculative verify block); wider blocks that are accepted whole (prefill
    chunks) are fine.
    """
    if kv_format not in KV_FORMATS:
      raise ConfigError(f"kv_format={kv_format!r}; expected one of {tuple(KV_FORMATS)}")
    if not (isinstance(slack, int) and slack >= 1):
      raise ConfigError(f"slack must be a positive integer, got {slack!r}")
    page = None if paging is None else paging.page_size
    if page is not None and not (isinstance(page, int) and page >= 1 and max_len % page == 0):
      raise ConfigError(f"page_size must divide max_len={max_len}, got {paging.page_size!r}")
    if segment_layers is None:  # the main stack, run by run
      runs = [(first, n) for first, n, _ in config.segments()]
    else:  # standalone layers (MTP, drafters): full attention, their own indexer
      runs = [(None, n) for n in segment_layers]
    return cls(
      tuple(
        _entry(config, kv_format, first, n, batch, max_len, slack, paging) for first, n in runs
      ),
      jnp.zeros((batch,), jnp.int32),
    )

  @property
  def max_len(self) -> int:
    """The longest text the state holds: the slots of its full-length entries (rings of
    recent positions hold any length)."""
    full = [s.max_len for s in self.segments if s.holds_every_position]
    return min(full) if full else NO_LIMIT

  @property
  def kv_format(self) -> str:
    formats = [s.kv_format for s in self.segments if s.kv_format]
    return formats[0] if formats else "float"

  @property
  def paged(self) -> bool:
    """Whether any entry stores its K/V in pages (`Paging`)."""
    return bool(self._paged_parts)

  @property
  def _paged_parts(self) -> list[PagedKV]:
    return [s.paged_part for s in self.segments if s.paged_part is not None]

  def with_page_table(self, table: jax.Array) -> "DecodingState":
    """Every paged entry with page tables [B, W] (one table: a page id names the same
    positions in every run's pool)."""
    return self.replace(segments=tuple(s.with_table(table) for s in self.segments))

  @property
  def page_table(self) -> Optional[jax.Array]:
    """The rows' page tables [B, W] (every paged entry holds the same one), or None."""
    return next((p.table for p in self._paged_parts), None)

  @property
  def unmapped_page(self) -> int:
    """The page id that names no page (the pool's size: every paged entry has the same)."""
    return next(p.num_pages for p in self._paged_parts)

  def load_pages(self, source: "DecodingState", pages: jax.Array) -> "DecodingState":
    """Every paged entry's rows with logical page j read from `source`'s pool page
    pages[b, j] (`PagedKV.load_pages`: a cached prompt prefix); other entries unchanged."""
    pairs = zip(self.segments, source.segments)
    return self.replace(segments=tuple(s.load_pages(src, pages) for s, src in pairs))

  def adopt_row(self, slot: jax.Array, row: "DecodingState"):
    """`Kind.adopt_row` for every entry: (state, row as it will be spliced at `slot`)."""
    pairs = [s.adopt_row(slot, r) for s, r in zip(self.segments, row.segments)]
    return (
      self.replace(segments=tuple(p[0] for p in pairs)),
      row.replace(segments=tuple(p[1] for p in pairs)),
    )

  def with_lengths(self, lengths: jax.Array) -> "DecodingState":
    """The state with `lengths` committed tokens per sequence: each entry decides what that
    means for it (`committed`; a recurrent entry keeps that prefix's snapshot)."""
    lengths = lengths.astype(jnp.int32)
    segments = tuple(s.committed(lengths) for s in self.segments)
    return self.replace(segments=segments, lengths=lengths)

  def commit(self, num_new: jax.Array) -> "DecodingState":
    """Advances each sequence's committed length by num_new [B]."""
    return self.with_lengths(self.lengths + num_new)

  def commit_path(self, path: jax.Array) -> "DecodingState":
    """Moves an accepted tree path (node indices [B, n], root first) of the block written at
    slots lengths.. to slots lengths..lengths+n-1 in every segment; lengths are unchanged."""
    return self.replace(segments=tuple(s.commit_path(self.lengths, path) for s in self.segments))


class KVGeometry(NamedTuple):
  """What a K/V kind's `create` reads of a config, for one layer run: MiMo's sliding layers
  have their own KV head count, and its values are narrower than its keys."""

  num_kv_heads: int
  head_dim: int
  value_head_dim: int
  dtype: str


def kv_geometry(config, first: int | None) -> Any:
  """The K/V geometry of the run starting at layer `first` (None: a standalone layer, which
  has the config's own); drafter configs, without per-layer fields, are their own."""
  if first is None and getattr(config, "mtp_sliding", False):  # MiMo's MTP: a sliding layer
    return KVGeometry(
      config.sliding_num_kv_heads or config.num_kv_heads,
      config.head_dim,
      config.value_head_dim,
      config.dtype,
    )
  if first is None or not hasattr(config, "layer_kv_heads"):
    return config
  return KVGeometry(
    config.layer_kv_heads(first),
    config.layer_head_dim(first),
    config.layer_value_head_dim(first),
    config.dtype,
  )


def _entry(
  config,
  kv_format: str,
  first: int | None,
  n: int,
  batch: int,
  max_len: int,
  slack: int,
  paging: Optional[Paging] = None,
):
  """The zero entry of a run of n layers from layer `first` (None: standalone layers): a
  LinearState for Gated DeltaNet runs; for MLA targets the latent cache (with the indexer's
  keys where the run has its own DSA indexer); a `SlidingKV` ring for sliding-window runs
  whose window + slack is below max_len; else K/V in `kv_format`. With `paging` the K/V, the
  latents and the indexer keys are each paged."""

  def full_length(kind: type, geometry: Any = config):
    if paging is not None:
      return PagedKV.create(kind, geometry, n, batch, max_len, *paging)
    return kind.create(geometry, n, batch, max_len)

  if first is not None and config.is_linear(first):
    return LinearState.create(config, n, batch, max_len)
  if first is not None and getattr(config, "num_kv_shared_layers", 0):
    if config.is_kv_shared(first):  # Gemma 4: the run reads its source run's entry
      return SharedKV(config.segment_of(config.kv_source(first)))
  if not getattr(config, "is_mla", False):  # (drafter configs have no MLA fields)
    geometry = kv_geometry(config, first)
    window = config.layer_windows[first] if first is not None else 0
    if window and window + slack < max_len:
      return SlidingKV.create(KV_FORMATS[kv_format], geometry, n, batch, window, slack)
    return full_length(KV_FORMATS[kv_format], geometry)
  latent = full_length(LATENT_FORMATS[kv_format])
  if config.is_dsa and (first is None or config.is_full_indexer(first)):
    return SparseLatent(latent, full_length(IndexerKeys))
  return latent


# --------------------------------------------------------------------------------------------------
# Logical axes of a whole state pytree
# --------------------------------------------------------------------------------------------------


def _is_array(x: Any) -> bool:
  return isinstance(x, (jax.Array, jax.ShapeDtypeStruct, np.ndarray))


def _batch_axis(where: str, one: tuple, two: tuple) -> Optional[int]:
  """The axis whose size goes 1 → 2 from the 1-row to the 2-row state (None: shared by rows)."""
  moved = [i for i, (a, b) in enumerate(zip(one, two)) if a != b]
  if len(moved) > 1 or (moved and (one[moved[0]], two[moved[0]]) != (1, 2)):
    raise ConfigError(f"state leaf {where} of shape {one} has no single batch axis")
  return moved[0] if moved else None


def logical_axes(tree: Any, two_rows: Any = None) -> Any:
  """The logical axes of a state pytree: one `PartitionSpec` of logical names per array leaf,
  in `tree`'s structure (for `jaxspec.sharding.shardings_for` / `with_logical_constraints`).

  A struct whose class has an `AXES` table (field name → a logical name or None per dimension,
  as the kinds above) names those fields; its other fields and plain containers are walked. With
  `two_rows`, the same state for 2 rows while `tree` has 1 (arrays or `jax.eval_shape` shapes),
  every leaf's batch axis is found by comparing the two: a leaf nothing names gets `batch` there
  and no name elsewhere (a drafter state field without a table is still split by rows), and a
  named leaf whose `batch` is elsewhere is a ConfigError, so a wrong table cannot go unnoticed.
  Without `two_rows` an unnamed leaf is a ConfigError.
  """

  def leaf(path, x, y, names):
    where, shape = jax.tree_util.keystr(path) or "<root>", tuple(np.shape(x))
    batch = None if y is None else _batch_axis(where, shape, tuple(np.shape(y)))
    if names is None:
      if y is None:
        raise ConfigError(
          f"state leaf {where} (shape {shape}) has no logical axes: name them in the AXES "
          "table of the struct that holds it"
        )
      names = tuple("batch" if i == batch else None for i in range(len(shape)))
    names = tuple(names)
    if len(names) != len(shape):
      raise ConfigError(f"state leaf {where} of shape {shape} is named {names}: one name per axis")
    named_batch = names.index("batch") if "batch" in names else None
    if y is not None and named_batch != batch:
      raise ConfigError(
        f"state leaf {where} of shape {shape} is named {names}, but its batch axis is {batch}"
      )
    return PartitionSpec(*names)

  def walk(path, x, y, names=None):
    if x is None:
      return None
    if _is_array(x):
      return leaf(path, x, y, names)
    if names is not None:
      raise ConfigError(f"{jax.tree_util.keystr(path)}: an AXES table names a non-array field")
    kids, treedef = jax.tree_util.tree_flatten_with_path(x, is_leaf=lambda n: n is not x)
    if treedef.num_nodes == 1 and treedef.num_leaves == 1:  # not a container, not an array
      raise ConfigError(f"state leaf {jax.tree_util.keystr(path)} is not an array: {type(x)}")
    others = [None] * len(kids) if y is None else treedef.flatten_up_to(y)
    table = getattr(type(x), "AXES", {})
    out = [
      walk(path + key, kid, other, table.get(getattr(key[0], "name", None)))
      for (key, kid), other in zip(kids, others)
    ]
    return treedef.unflatten(out)

  return walk((), tree, two_rows)
