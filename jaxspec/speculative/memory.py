"""How much memory a generation needs, estimated before anything is allocated.

One place for the arithmetic of a run's memory: the weights, the target's decoding state (its
KV cache, whatever the `kv_format`), the drafter's state and the engine's token buffers. The
state sizes come from the state builders themselves traced abstractly (`jax.eval_shape`), so
a new cache layout is counted the moment it exists, and nothing is allocated to count it.

`SpecEngine` calls `check_fits` at construction: a `max_len` or `batch_size` whose state cannot
fit is refused with the numbers, instead of failing deep inside `generate` with the backend's
RESOURCE_EXHAUSTED. Long-context and scale-out planning extend this module.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Optional, Sequence

import jax
import numpy as np

from jaxspec.errors import ConfigError
from jaxspec.state import DEFAULT_SLACK, DecodingState, Paging


def tree_bytes(tree: Any) -> int:
  """Bytes of every array (or ShapeDtypeStruct) leaf of a pytree."""
  return int(
    sum(
      int(np.prod(x.shape, dtype=np.int64)) * np.dtype(x.dtype).itemsize
      for x in jax.tree_util.tree_leaves(tree)
      if hasattr(x, "shape") and hasattr(x, "dtype")
    )
  )


def human_bytes(n: float) -> str:
  """1536 → '1.5 KiB'."""
  for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
    if abs(n) < 1024 or unit == "PiB":
      return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
    n /= 1024
  raise AssertionError("unreachable")


def decoding_state_bytes(
  config: Any,
  batch: int,
  max_len: int,
  kv_format: str = "float",
  slack: int = DEFAULT_SLACK,
  paging: Optional[Paging] = None,
) -> int:
  """Bytes of the target's decoding state (`jaxspec.state.DecodingState`) for these shapes
  (sliding-window rings of window + `slack` slots; full-attention K/V in `paging`'s pool)."""
  shapes = jax.eval_shape(
    lambda: DecodingState.create(config, batch, max_len, kv_format, slack=slack, paging=paging)
  )
  return tree_bytes(shapes)


def drafter_state_bytes(drafter: Any, batch: int, max_len: int) -> int:
  """Bytes of a drafter's generation state (its caches, feature stores) for these shapes."""
  if drafter is None:
    return 0
  shapes = jax.eval_shape(lambda p: drafter.init_state(p, batch, max_len), drafter.params)
  return tree_bytes(shapes)


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
  """What one engine holds on its devices, in bytes, and what those devices have free."""

  weights: int
  target_state: int
  drafter_state: int
  buffers: int
  free: Optional[int]  # None when the backend does not say

  @property
  def state(self) -> int:
    """Bytes the engine allocates per generation (the weights are already resident)."""
    return self.target_state + self.drafter_state + self.buffers

  def describe(self) -> str:
    parts = [
      f"target decoding state {human_bytes(self.target_state)}",
      f"drafter state {human_bytes(self.drafter_state)}",
      f"token buffers {human_bytes(self.buffers)}",
    ]
    return f"{human_bytes(self.state)} ({', '.join(parts)})"


def free_bytes(devices: Sequence[jax.Device]) -> Optional[int]:
  """Memory free on these devices together; host memory available for CPU devices.

  None when the backend reports nothing usable.
  """
  total = 0
  cpu_counted = False
  for d in devices:
    if d.platform == "cpu":
      if not cpu_counted:  # CPU devices share the host's memory
        host = _host_available_bytes()
        if host is None:
          return None
        total += host
        cpu_counted = True
      continue
    stats = d.memory_stats() or {}
    if "bytes_limit" not in stats:
      return None
    total += int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))
  return total


def _host_available_bytes() -> Optional[int]:
  """MemAvailable from /proc/meminfo (Linux), else free physical pages."""
  try:
    with open("/proc/meminfo") as f:
      for line in f:
        if line.startswith("MemAvailable:"):
          return int(line.split()[1]) * 1024
  except OSError:
    pass
  try:
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
  except (ValueError, OSError, AttributeError):
    return None


def _devices_of(tree: Any) -> list[jax.Device]:
  devices: dict[Any, jax.Device] = {}
  for leaf in jax.tree_util.tree_leaves(tree):
    sharding = getattr(leaf, "sharding", None)
    if sharding is not None:
      for d in sharding.device_set:
        devices[d.id] = d
  return list(devices.values()) or jax.local_devices()[:1]


def engine_plan(
  target: Any,
  drafter: Any,
  batch: int,
  max_len: int,
  kv_format: str,
  slack: int = DEFAULT_SLACK,
  paging: Optional[Paging] = None,
  prefix_width: int = 0,
) -> MemoryPlan:
  """The memory plan of a `SpecEngine` for `target` and `drafter` at these shapes.

  The state is assumed spread over the devices holding the target's weights. `prefix_width`:
  target features kept per pool position for cached prefixes (speculative/prefix.py), counted
  with the buffers.
  """
  features = prefix_feature_bytes(target.config, batch, max_len, paging, prefix_width)
  return MemoryPlan(
    weights=tree_bytes(target.params) + (tree_bytes(drafter.params) if drafter else 0),
    target_state=decoding_state_bytes(target.config, batch, max_len, kv_format, slack, paging),
    drafter_state=drafter_state_bytes(drafter, batch, max_len),
    buffers=batch * max_len * np.dtype(np.int32).itemsize + features,
    free=free_bytes(_devices_of(target.params)),
  )


def prefix_feature_bytes(
  config: Any, batch: int, max_len: int, paging: Optional[Paging], width: int
) -> int:
  """Bytes of the target features a prefix cache keeps per pool position (`width` values of
  the activation dtype each; `SpecState.prefix_features`); 0 without paging or width."""
  if paging is None or not width:
    return 0
  pages = paging.num_pages or batch * max_len // paging.page_size
  return pages * paging.page_size * width * np.dtype(config.dtype).itemsize


def check_fits(plan: MemoryPlan, batch: int, max_len: int, kv_format: str) -> None:
  """Raises ConfigError if the plan's per-generation state cannot fit in the free memory."""
  if plan.free is None or plan.state <= plan.free:
    return
  hint = "lower max_len or batch_size"
  if kv_format == "float":
    hint += ", or store the KV cache as kv_format='fp8'"
  raise ConfigError(
    f"max_len={max_len}, batch_size={batch} needs {plan.describe()}, but the devices have "
    f"{human_bytes(plan.free)} free: {hint}"
  )


def kv_bytes_per_token(config: Any, kv_format: str = "float") -> float:
  """Decoding-state bytes one token adds in `config`'s main stack (all layers, K and V)."""
  one = decoding_state_bytes(config, 1, 1, kv_format) - 4  # less the int32 length
  two = decoding_state_bytes(config, 1, 2, kv_format) - 4
  return float(two - one)


def kv_table(config: Any, contexts: Sequence[int] = (8192, 32768, 131072)) -> list[str]:
  """Rows: each KV format's bytes per token (as if every layer held every position) and the
  state's bytes at each context length, batch 1 (sliding-window layers: their rings)."""
  from jaxspec.state import KV_FORMATS  # pylint: disable=import-outside-toplevel

  head = f"{'kv':>6} {'bytes/token':>12}" + "".join(f"{f'{n // 1024}K':>11}" for n in contexts)
  rows = [head]
  for fmt in KV_FORMATS:
    try:
      per = kv_bytes_per_token(config, fmt)
    except ConfigError as e:  # e.g. q4_0 with a head_dim that is not a multiple of 32
      rows.append(f"{fmt:>6} {'-':>12}  ({e})")
      continue
    rows.append(
      f"{fmt:>6} {per:>12,.0f}"
      + "".join(f"{human_bytes(decoding_state_bytes(config, 1, n, fmt)):>11}" for n in contexts)
    )
  return rows
