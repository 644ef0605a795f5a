"""The shapes and layout of an engine's state: what a prefill returns, never run.

`SpecEngine` traces its prefill with `jax.eval_shape` once per batch size: the 1- and 2-row
shapes tell each SpecState leaf's batch axis (the one whose size follows the rows), which
`insert` and the compacted row loop slice along, and with the `AXES` tables of the state
structs give every leaf's logical axes (`SpecEngine.state_axes`), by which the state is laid
out on a mesh (`SpecEngine.state_shardings`).
"""

from __future__ import annotations

import functools
from typing import Any, Optional

import jax
import jax.numpy as jnp

from jaxspec import sampling, sharding
from jaxspec.drafters.base import Drafter
from jaxspec.models.target import TargetModel
from jaxspec.speculative import placement
from jaxspec.speculative import request as request_lib
from jaxspec.speculative import step as step_lib
from jaxspec.speculative.engine_config import EngineConfig
from jaxspec.speculative.step import SpecState
from jaxspec.state import Paging, logical_axes


class StateShapes:
  """The SpecState of an engine's prefill as shapes, per batch size (traced once each).

  target, drafter: the engine's (placed, as it runs them); slack, tree_ranks, prefix_width:
  the engine's prefill arguments (`step.prefill`).
  """

  def __init__(
    self,
    target: TargetModel,
    drafter: Optional[Drafter],
    config: EngineConfig,
    *,
    slack: int,
    tree_ranks: Any,
    prefix_width: int,
  ):
    self._target = target
    self._drafter = drafter
    self._config = config
    self._prefill = functools.partial(
      step_lib.prefill,
      target.config,
      drafter,
      chunk=min(config.min_prompt_bucket, config.max_len),
      kv_format=config.kv_format,
      slack=slack,
      tree_ranks=tree_ranks,
      top_k=config.top_logprobs,
      prefix_width=prefix_width,
      # A pool that does not grow with the rows, so that comparing 1- and 2-row states finds
      # the rows' axes (the pool's size is not one; `axes`, `batch_axes`).
      paging=Paging(config.page_size, config.pages_per_row) if config.page_size else None,
    )
    self._traced: dict[int, SpecState] = {}

  def abstract(self, batch: int) -> SpecState:
    """The SpecState a prefill of `batch` rows returns, as shapes (nothing runs; traced once
    per batch size)."""
    if batch not in self._traced:
      self._traced[batch] = self._trace(batch)
    return self._traced[batch]

  def _trace(self, batch: int) -> SpecState:
    cfg = self._config
    i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)
    params = sampling.make_sampling_params(batch, 0.0, 0, 1.0)
    keys = jax.ShapeDtypeStruct((batch, 2), jnp.uint32)
    penalty_rows = None
    if cfg.penalties:
      f32 = jax.ShapeDtypeStruct((batch,), jnp.float32)
      bias = (batch, request_lib.MAX_LOGIT_BIAS)
      penalty_rows = (f32, f32, f32, i32(*bias), jax.ShapeDtypeStruct(bias, jnp.float32))
    drafter_params = self._drafter.params if self._drafter is not None else None
    return jax.eval_shape(
      self._prefill,
      self._target.params,
      drafter_params,
      i32(batch, cfg.max_len),
      i32(batch),
      i32(batch),
      jax.ShapeDtypeStruct((batch,), jnp.bool_),
      params,
      keys,
      i32(batch, cfg.max_stop_ids),
      i32(),
      penalty_rows,
    )

  def axes(self) -> SpecState:
    """The logical axes of every SpecState leaf: the `AXES` tables of the state structs,
    checked against the batch axes that 1- and 2-row states show (jaxspec.state.logical_axes)."""
    return logical_axes(self.abstract(1), self.abstract(2))

  def shardings(self, batch: int, mesh: jax.sharding.Mesh, rules: Any) -> SpecState:
    """The NamedSharding of every SpecState leaf of a `batch`-row state on `mesh`: what
    `axes` gives under `rules` (an axis that does not divide its mesh axes is replicated)."""
    return sharding.shardings_for(self.abstract(batch), self.axes(), mesh, rules)

  def batch_axes(self) -> Any:
    """Per SpecState leaf, its batch axis (the one whose size follows the batch), or None for
    a leaf shared by every row: found by comparing the shapes of 1- and 2-row states."""
    return placement.batch_axes(self.abstract(1), self.abstract(2))
