"""Mesh placement of an engine: parameters by their logical axes, states by theirs.

`place_on_mesh` puts the target's and the drafter's parameters on a device mesh (a weight the
drafter shares with the target is held once); `laid_out` constrains a state (or one of its
fields) to its logical axes inside a jitted function; `OnMesh` calls a jitted function inside
the mesh and rules, so the model code's activation constraints apply when it is traced;
`batch_axes` finds each state leaf's batch axis from the shapes of 1- and 2-row states.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import jax

from jaxspec import sharding
from jaxspec.drafters.base import Drafter
from jaxspec.errors import ConfigError
from jaxspec.models import target as target_lib
from jaxspec.models.target import TargetModel
from jaxspec.quant.formats import QTensor


def laid_out(axes: Any, field: Optional[str], tree: Any) -> Any:
  """`tree`, the state field `field` (None: the whole state), constrained to its logical axes
  in `axes` (a state of logical PartitionSpecs) on the active mesh (jaxspec/sharding.py); as
  it is when `axes` is None."""
  if axes is None:
    return tree
  return sharding.with_logical_constraints(tree, axes if field is None else getattr(axes, field))


def batch_axes(one: Any, two: Any) -> Any:
  """Per leaf of the abstract 1- and 2-row states `one` and `two`, its batch axis (the one
  whose size follows the batch), or None for a leaf shared by every row."""

  def axis(a, b):
    moved = [i for i, (x, y) in enumerate(zip(a.shape, b.shape)) if x != y]
    if len(moved) > 1 or (moved and (a.shape[moved[0]], b.shape[moved[0]]) != (1, 2)):
      raise ConfigError(f"a state leaf of shape {a.shape} has no single batch axis")
    return moved[0] if moved else None

  return jax.tree_util.tree_map(axis, one, two)


def _refuse_quantized(params: Any, what: str) -> None:
  is_q = lambda x: isinstance(x, QTensor)
  if any(is_q(x) for x in jax.tree_util.tree_leaves(params, is_leaf=is_q)):
    raise ConfigError(
      f"{what} has quantized (QTensor) weights of its own: placing a quantized drafter on a "
      "device mesh is not supported; quantize the target only, or run without a mesh"
    )


def place_on_mesh(
  target: TargetModel,
  drafter: Optional[Drafter],
  mesh: jax.sharding.Mesh,
  rules: Any = None,
) -> tuple[TargetModel, Optional[Drafter]]:
  """The target and the drafter with their parameters on `mesh`, by their logical axes
  (`target_lib.params_logical_axes`: a quantized weight's values and scales are named after the
  weight; `Drafter.param_axes`) and `rules` (jaxspec/sharding.py).

  An array already placed so is kept (pass a target restored onto the mesh and nothing moves);
  an array the drafter shares with the target (embedding, LM head, MTP layer) takes the target's
  placement, so it is held once. A drafter's own quantized weights are refused (ConfigError).
  """
  t_axes = target_lib.params_logical_axes(target.config, target.params)
  params = sharding.shard_tree(target.params, t_axes, mesh, rules)
  placed_target = dataclasses.replace(target, params=params)
  if drafter is None or drafter.params is None:
    return placed_target, drafter
  _refuse_quantized(drafter.params, f"the drafter ({drafter.name})")
  is_spec = lambda x: isinstance(x, jax.sharding.PartitionSpec)
  shared = {
    id(old): (new, spec)
    for old, new, spec in zip(
      jax.tree_util.tree_leaves(target.params),
      jax.tree_util.tree_leaves(params),
      jax.tree_util.tree_leaves(t_axes, is_leaf=is_spec),
    )
  }
  axes = drafter.param_axes()
  if axes is None:  # replicated
    axes = jax.tree_util.tree_map(lambda _: jax.sharding.PartitionSpec(), drafter.params)
  own = jax.tree_util.tree_map(
    lambda x, spec: shared[id(x)][1] if id(x) in shared else spec,
    drafter.params,
    axes,
  )
  values = jax.tree_util.tree_map(
    lambda x: shared[id(x)][0] if id(x) in shared else x, drafter.params
  )
  placed = sharding.shard_tree(values, own, mesh, rules)
  return placed_target, dataclasses.replace(drafter, params=placed)


class OnMesh:
  """A jitted function called inside `sharding.use_mesh(mesh, rules)`: the logical constraints
  of the model code and of the state apply when it is traced."""

  def __init__(self, mesh: jax.sharding.Mesh, rules: Any, fn: Any):
    self.mesh, self.rules, self.fn = mesh, rules, fn

  def __call__(self, *args: Any, **kwargs: Any) -> Any:
    with sharding.use_mesh(self.mesh, self.rules):
      return self.fn(*args, **kwargs)

  def lower(self, *args: Any, **kwargs: Any) -> Any:
    with sharding.use_mesh(self.mesh, self.rules):
      return self.fn.lower(*args, **kwargs)

  def _cache_size(self) -> int:
    return self.fn._cache_size()  # pylint: disable=protected-access


def on_mesh(mesh: Optional[jax.sharding.Mesh], rules: Any, fn: Any) -> Any:
  """`fn`, called inside `mesh` and `rules` when there is a mesh."""
  return fn if mesh is None else OnMesh(mesh, rules, fn)
