"""The entry of a run of KV-shared layers (Gemma 4): it stores nothing.

Gemma 4's last `num_kv_shared_layers` layers compute queries only and attend to the K/V of the
last earlier layer of their type (`ModelConfig.kv_source`). Their run keeps this empty entry,
so that the state still has one entry per run; the decoder hands those layers the source run's
entry and its block K/V instead (models/decoder.py). Assistant drafters that read the target's
K/V (drafters/gemma4_assistant.py) read the source runs' entries the same way.
"""

from __future__ import annotations

from typing import ClassVar

import flax.struct
import jax

from jaxspec.state.base import Kind


@flax.struct.dataclass
class SharedKV(Kind):
  """No arrays: `source` is the index of the run whose last layer's K/V these layers read."""

  source: int = flax.struct.field(pytree_node=False, default=0)

  AXES: ClassVar[dict] = {}
  holds_every_position: ClassVar[bool] = False  # it bounds no text length
  format: ClassVar[str] = "shared"

  @property
  def max_len(self) -> int:
    return 0

  def commit_path(self, start: jax.Array, path: jax.Array) -> "SharedKV":
    del start, path
    return self
