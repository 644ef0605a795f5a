"""Logical axis names, rules that map them to mesh axes, and sharding helpers.

Model code names every parameter, cache and activation axis with a *logical*
name (``embed``, ``heads``, ``expert``, ...) and never mentions a mesh axis.
A rule table, in the style of MaxText, maps logical names to the physical
mesh axes ``data``, ``expert`` and ``tensor``. Changing the parallelism of a
run is then a change of mesh shape and rules, never of model code.

Flax Linen modules declare their parameters with::

    nn.with_logical_partitioning(init_fn, ('embed', 'heads'))

and layers stacked with ``nn.scan(..., metadata_params={nn.PARTITION_NAME:
'layers'})`` gain a leading ``layers`` axis, so ``nn.get_partition_spec(
variables)`` yields a tree of *logical* ``PartitionSpec``s. Every function here
accepts that tree (or the boxed variables themselves, or plain tuples of
names) as its ``logical_tree``.

Typical use::

    mesh = sharding.make_mesh({'data': 2, 'expert': 2, 'tensor': 2})
    abstract = jax.eval_shape(model.init, rng, tokens)       # boxed shapes
    params = sharding.shard_tree(model.init(rng, tokens), None, mesh)
    with sharding.use_mesh(mesh):                            # for activations
        logits = jax.jit(model.apply)(params, tokens)

A dimension whose size is not divisible by the size of its mesh axis is
replicated instead of raising, so the same rules serve every model size
(e.g. 2 KV heads on a tensor axis of 4).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Optional, Union

import flax.linen as nn
import jax
import numpy as np
from flax.core import meta
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec
from jaxspec.errors import ConfigError

# --- Names -----------------------------------------------------------------

# Physical mesh axes, outermost first: data parallel, expert parallel, tensor
# parallel. The tensor axis is innermost so that it maps to the fastest links.
DATA = "data"
EXPERT_AXIS = "expert"
TENSOR = "tensor"
MESH_AXES: tuple[str, ...] = (DATA, EXPERT_AXIS, TENSOR)

# Logical axis names used by the model code. ``None`` marks an axis that is
# never sharded.
BATCH = "batch"
LENGTH = "length"
EMBED = "embed"
HEADS = "heads"
KV_HEADS = "kv_heads"
HEAD_DIM = "head_dim"
MLP = "mlp"
EXPERT = "expert"
VOCAB = "vocab"
LAYERS = "layers"
PAGES = "pages"  # a paged KV pool's pages (state/paged.py): shared by the rows
# MLA's low-rank widths (q_a_proj's output, the KV latent): small, never split.
Q_LORA = "q_lora"
KV_LORA = "kv_lora"
LOGICAL_AXES: tuple[str, ...] = (
  BATCH,
  LENGTH,
  EMBED,
  HEADS,
  KV_HEADS,
  HEAD_DIM,
  MLP,
  EXPERT,
  VOCAB,
  LAYERS,
  PAGES,
  Q_LORA,
  KV_LORA,
)

MeshAxes = Union[str, tuple[str, ...], None]
Rules = tuple[tuple[str, MeshAxes], ...]
LogicalAxes = Union[PartitionSpec, Sequence[Optional[str]], None]

# Rules in priority order: the first rule whose mesh axes are still free (and
# divide the dimension, when shapes are known) wins, as in Flax and MaxText.
DEFAULT_RULES: Rules = (
  (BATCH, DATA),
  (HEADS, TENSOR),
  (KV_HEADS, TENSOR),
  (MLP, TENSOR),
  (EXPERT, EXPERT_AXIS),
  (VOCAB, TENSOR),
  (EMBED, None),
  (LAYERS, None),
  (PAGES, None),
  (LENGTH, None),
  (HEAD_DIM, None),
  (Q_LORA, None),
  (KV_LORA, None),
)


# --- Rules and mesh construction -----------------------------------------


def _as_mesh_axes(value: Any) -> MeshAxes:
  if value is None or isinstance(value, str):
    return value
  if isinstance(value, (tuple, list)) and all(isinstance(v, str) for v in value):
    return tuple(value)
  raise ConfigError(f"a rule's mesh axes must be None, a name or a tuple of names; got {value!r}")


@dataclasses.dataclass(frozen=True)
class MeshConfig:
  """Device mesh shape and the logical-axis → mesh-axis rules (empty rules = the defaults)."""

  data: int = 1
  expert: int = 1
  tensor: int = 1
  rules: tuple[tuple[str, Any], ...] = ()

  @property
  def shape(self) -> dict[str, int]:
    return {"data": self.data, "expert": self.expert, "tensor": self.tensor}


def rules_from(config: Any = None) -> Rules:
  """Returns a validated rule table from a config, a rule sequence or None.

  Args:
    config: ``None`` (the defaults), a sequence of ``(logical, mesh_axes)``
      pairs, or a dict, ``ConfigDict`` or ``MeshConfig``-like object with an
      optional ``rules`` entry (missing or empty means the defaults).

  Returns:
    The rules as a tuple of ``(str, None | str | tuple[str, ...])`` pairs.
  """
  if config is None:
    return DEFAULT_RULES
  if hasattr(config, "to_dict"):  # ml_collections.ConfigDict
    config = config.to_dict()
  if isinstance(config, Mapping):
    rules = config.get("rules", ())
  elif isinstance(config, (tuple, list)):
    rules = config
  else:
    rules = getattr(config, "rules", ())
  if not rules:
    return DEFAULT_RULES
  out = []
  for rule in rules:
    if not (isinstance(rule, (tuple, list)) and len(rule) == 2 and isinstance(rule[0], str)):
      raise ConfigError(
        f"each sharding rule must be a (logical_name, mesh_axes) pair; got {rule!r}"
      )
    out.append((rule[0], _as_mesh_axes(rule[1])))
  return tuple(out)


def mesh_shape(config: Any) -> dict[str, int]:
  """Returns ``{'data': d, 'expert': e, 'tensor': t}`` from a dict or config.

  Missing axes default to 1. Unknown keys in a dict raise, because a typo
  such as ``tensors=4`` would otherwise silently run unsharded. Accepts a
  dict, an ``ml_collections.ConfigDict`` or a ``MeshConfig``-like object.
  """
  if hasattr(config, "to_dict"):  # ml_collections.ConfigDict
    config = config.to_dict()
  if isinstance(config, Mapping):
    unknown = sorted(set(config) - set(MESH_AXES) - {"rules"})
    if unknown:
      raise ConfigError(f"unknown mesh axes {unknown}; the mesh axes are {list(MESH_AXES)}")
    shape = {a: config.get(a, 1) for a in MESH_AXES}
  else:
    shape = {a: getattr(config, a, 1) for a in MESH_AXES}
  for axis, size in shape.items():
    if isinstance(size, bool) or not isinstance(size, (int, np.integer)):
      raise ConfigError(f"mesh axis {axis!r} must be an int; got {size!r}")
    if size < 1 and size != -1:
      raise ConfigError(
        f"mesh axis {axis!r} must be >= 1 (or -1 for 'all remaining devices'); got {size}"
      )
  return {a: int(s) for a, s in shape.items()}


MESH_FORM = "axis=size pairs over data, expert and tensor, e.g. data=1,expert=2,tensor=1"


def parse_mesh(spec: str, flag: Optional[str] = None) -> dict[str, int]:
  """A mesh written as ``"data=1,expert=2,tensor=1"`` (the scripts' ``--mesh``) as
  ``{axis: size}``, checked by ``mesh_shape`` (missing axes 1; -1: the remaining devices).
  A malformed string is a ConfigError naming the expected form (and ``flag``, if given)."""
  where = f"{flag}={spec}" if flag else f"mesh {spec!r}"
  out = {}
  for part in filter(None, (p.strip() for p in spec.split(","))):
    name, eq, value = part.partition("=")
    try:
      out[name.strip()] = int(value)
    except ValueError:
      raise ConfigError(f"{where}: expected {MESH_FORM}") from None
    if not eq or not name.strip():
      raise ConfigError(f"{where}: expected {MESH_FORM}")
  try:
    return mesh_shape(out)
  except (ConfigError, ValueError) as e:
    raise ConfigError(f"{where}: {e}") from None


def make_mesh(shape: Any, devices: Optional[Sequence[Any]] = None) -> Mesh:
  """Builds a ``(data, expert, tensor)`` mesh over all (or the given) devices.

  Args:
    shape: a dict such as ``{'data': 2, 'tensor': 4}`` or an object with
      ``data``, ``expert`` and ``tensor`` attributes (``MeshConfig``). Missing
      axes are 1; one axis may be -1 to take all remaining devices.
    devices: the devices to use; defaults to ``jax.devices()``.

  Returns:
    A ``jax.sharding.Mesh`` with axis names ``('data', 'expert', 'tensor')``
    and ``Auto`` axis types (sharding propagated by XLA, constraints from
    ``with_logical_constraint``).

  Raises:
    ValueError: if the product of the axis sizes differs from the number of
      devices.
  """
  sizes = mesh_shape(shape)
  devices = list(jax.devices() if devices is None else devices)
  n = len(devices)
  fill = [a for a, s in sizes.items() if s == -1]
  if len(fill) > 1:
    raise ConfigError(f"at most one mesh axis may be -1; got {sizes}")
  if fill:
    rest = math.prod(s for s in sizes.values() if s != -1)
    if n % rest:
      raise ConfigError(
        f"cannot fill mesh axis {fill[0]!r}: {n} devices are not divisible "
        f"by the other axes' product {rest} ({sizes})"
      )
    sizes[fill[0]] = n // rest
  total = math.prod(sizes.values())
  if total != n:
    desc = " x ".join(f"{a}={s}" for a, s in sizes.items())
    platform = devices[0].platform if devices else "none"
    hint = ""
    if platform == "cpu":
      hint = (
        f" On CPU, set XLA_FLAGS=--xla_force_host_platform_device_count="
        f"{total} before jax is imported to get {total} virtual devices."
      )
    raise ConfigError(
      f"mesh {desc} needs {total} devices but {n} {platform} device(s) are "
      f"available; the product of the mesh axes must equal the device "
      f"count.{hint}"
    )
  axis_shape = tuple(sizes[a] for a in MESH_AXES)
  return jax.make_mesh(
    axis_shape, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES), devices=devices
  )


def _axis_sizes(mesh: Any) -> dict[str, int]:
  """Axis name -> size for a Mesh, AbstractMesh or plain mapping."""
  if isinstance(mesh, Mapping):
    return {str(k): int(v) for k, v in mesh.items()}
  return dict(mesh.shape)


def _check_rules_against_mesh(rules: Rules, sizes: Mapping[str, int]) -> None:
  for logical, axes in rules:
    names = (axes,) if isinstance(axes, str) else (axes or ())
    missing = [a for a in names if a not in sizes]
    if missing:
      raise ConfigError(
        f"sharding rule ({logical!r}, {axes!r}) names mesh axes {missing} "
        f"that the mesh does not have (mesh axes: {list(sizes)})"
      )


# --- Logical -> physical ---------------------------------------------------


def logical_to_spec(
  logical_axes: LogicalAxes,
  rules: Optional[Rules] = None,
  *,
  shape: Optional[Sequence[int]] = None,
  mesh: Any = None,
) -> PartitionSpec:
  """Maps one array's logical axis names to a mesh ``PartitionSpec``.

  Rules apply in order; a rule assigns its mesh axes to the array dimension
  with that logical name if the dimension is still unassigned and none of
  the mesh axes is used by another dimension (Flax semantics). When ``shape``
  and ``mesh`` are given, a dimension whose size is not divisible by the
  mesh axes' total size keeps the longest dividing prefix of those axes, or
  falls to the next rule, or is replicated.

  Args:
    logical_axes: one name (or None) per array dimension, as a tuple or a
      logical ``PartitionSpec``; None means fully replicated.
    rules: the rule table; defaults to the active ``use_mesh`` /
      ``nn.logical_axis_rules`` rules, else ``DEFAULT_RULES``.
    shape: the array shape, for the divisibility fallback.
    mesh: a Mesh, AbstractMesh or ``{axis: size}`` mapping, for validation and
      the divisibility fallback.

  Returns:
    A ``PartitionSpec`` over mesh axes.
  """
  rules = _resolve_rules(rules)
  if logical_axes is None:
    return PartitionSpec()
  names = tuple(logical_axes)
  if shape is not None and len(names) > len(shape):
    raise ConfigError(
      f"logical axes {names} have {len(names)} entries but the array has "
      f"rank {len(shape)} (shape {tuple(shape)})"
    )
  dups = sorted({n for n in names if isinstance(n, str) and names.count(n) > 1})
  if dups:
    raise ConfigError(f"logical axis names {dups} occur more than once in {names}")
  sizes = None
  unavailable: set[str] = set()
  if mesh is not None:
    sizes = _axis_sizes(mesh)
    _check_rules_against_mesh(rules, sizes)
    # Axes already in manual mode (inside shard_map) cannot be constrained.
    unavailable = set(getattr(mesh, "manual_axes", ()) or ())

  result: list[Any] = [None] * len(names)
  assigned = [False] * len(names)
  used: set[str] = set()
  for logical, axes in rules:
    if logical not in names:
      continue
    pos = names.index(logical)
    if assigned[pos]:
      continue
    cand = (axes,) if isinstance(axes, str) else tuple(axes or ())
    if any(a in used or a in unavailable for a in cand):
      continue
    if shape is not None and sizes is not None and cand:
      # Keep the longest prefix of the mesh axes that divides the dimension.
      keep: tuple[str, ...] = ()
      for k in range(len(cand), 0, -1):
        if shape[pos] % math.prod(sizes[a] for a in cand[:k]) == 0:
          keep = cand[:k]
          break
      if not keep:
        continue  # Not divisible: try a later rule, else replicate.
      cand = keep
    assigned[pos] = True
    used.update(cand)
    if isinstance(axes, str) or not cand:
      result[pos] = axes
    else:
      # The rule's tuple, or the prefix of it that divides the dimension.
      result[pos] = cand
  # Non-string entries (None, PartitionSpec.UNCONSTRAINED) pass through.
  for pos, name in enumerate(names):
    if not isinstance(name, str) and name is not None:
      result[pos] = name
  return PartitionSpec(*result)


def _resolve_rules(rules: Optional[Rules]) -> Rules:
  if rules is not None:
    return rules_from(rules)
  active = nn.get_logical_axis_rules()
  return rules_from(active) if active else DEFAULT_RULES


def _is_logical_leaf(x: Any) -> bool:
  """A logical spec: None, a PartitionSpec or a non-empty tuple of names. An empty tuple is an
  empty container, as in the data (a drafter-less engine's ``drafter_state=()``); name a scalar
  by None or ``PartitionSpec()``."""
  return (
    x is None
    or isinstance(x, PartitionSpec)
    or (isinstance(x, tuple) and x != () and all(n is None or isinstance(n, str) for n in x))
  )


def _is_box(x: Any) -> bool:
  return isinstance(x, meta.AxisMetadata)


def _has_boxes(tree: Any) -> bool:
  return any(_is_box(x) for x in jax.tree_util.tree_leaves(tree, is_leaf=_is_box))


def logical_specs(tree: Any) -> Any:
  """Logical ``PartitionSpec`` tree of boxed Flax variables.

  Thin wrapper over ``nn.get_partition_spec``: params declared with
  ``nn.with_logical_partitioning`` give their logical names (with the
  leading ``layers`` axis for scanned stacks), unboxed arrays give
  ``PartitionSpec()`` (replicated).
  """
  return nn.get_partition_spec(tree)


def _normalize_logical_tree(logical_tree: Any) -> Any:
  """Turns boxes into specs and tuple/None leaves into PartitionSpecs."""
  if _has_boxes(logical_tree):
    logical_tree = nn.get_partition_spec(logical_tree)
  return jax.tree_util.tree_map(
    lambda x: PartitionSpec() if x is None else PartitionSpec(*x),
    logical_tree,
    is_leaf=_is_logical_leaf,
  )


def logical_to_sharding(logical_tree: Any, mesh: Mesh, rules: Optional[Rules] = None) -> Any:
  """Maps a tree of logical specs to a tree of ``NamedSharding``s.

  Shapes are not known here, so no divisibility fallback is applied; use
  ``shardings_for`` when they are (e.g. from ``jax.eval_shape``).

  Args:
    logical_tree: logical ``PartitionSpec``s (``nn.get_partition_spec``),
      tuples of names, None (replicated), or the boxed variables themselves.
    mesh: the device mesh.
    rules: the rule table (see ``logical_to_spec``).

  Returns:
    A tree of ``NamedSharding`` with the structure of ``logical_tree``.
  """
  rules = _resolve_rules(rules)
  _check_rules_against_mesh(rules, _axis_sizes(mesh))
  specs = _normalize_logical_tree(logical_tree)
  return nn.logical_to_mesh_sharding(specs, mesh, rules)


def shardings_for(
  shapes_tree: Any, logical_tree: Any, mesh: Mesh, rules: Optional[Rules] = None
) -> Any:
  """``NamedSharding`` per leaf, replicating dimensions that do not divide.

  Args:
    shapes_tree: arrays or ``jax.ShapeDtypeStruct``s (anything with
      ``.shape``), possibly boxed (``jax.eval_shape(model.init, ...)``).
    logical_tree: logical specs with the structure of ``shapes_tree`` (see
      ``logical_to_sharding``); None to read them from the boxes in
      ``shapes_tree``.
    mesh: the device mesh.
    rules: the rule table (see ``logical_to_spec``).

  Returns:
    A tree of ``NamedSharding`` with the structure of the unboxed
    ``shapes_tree``.
  """
  rules = _resolve_rules(rules)
  if logical_tree is None:
    if not _has_boxes(shapes_tree):
      raise ConfigError(
        "logical_tree is None but shapes_tree has no nn.Partitioned boxes "
        "to read logical axis names from"
      )
    logical_tree = nn.get_partition_spec(shapes_tree)
  shapes_tree = meta.unbox(shapes_tree)
  specs = _normalize_logical_tree(logical_tree)

  def one(path, spec, leaf):
    shape = np.shape(leaf)
    try:
      mesh_spec = logical_to_spec(spec, rules, shape=shape, mesh=mesh)
    except ValueError as e:
      raise ConfigError(f"at {jax.tree_util.keystr(path)}: {e}") from None
    return NamedSharding(mesh, mesh_spec)

  return jax.tree_util.tree_map_with_path(
    one, specs, shapes_tree, is_leaf=lambda x: isinstance(x, PartitionSpec)
  )


def _put(x: Any, sharding: NamedSharding) -> jax.Array:
  """device_put that also works when the sharding spans several hosts."""
  if sharding.is_fully_addressable or (isinstance(x, jax.Array) and not x.is_fully_addressable):
    return jax.device_put(x, sharding)
  # Multi-host: every process holds the full value; each builds its shards.
  host = np.asarray(x)
  return jax.make_array_from_callback(host.shape, sharding, lambda idx: host[idx])


def shard_tree(tree: Any, logical_tree: Any, mesh: Mesh, rules: Optional[Rules] = None) -> Any:
  """Places every array of ``tree`` on ``mesh`` according to its logical axes.

  Args:
    tree: arrays (e.g. params or a cache), possibly boxed Flax variables.
    logical_tree: logical specs with the structure of ``tree``; None to read
      them from the boxes in ``tree``.
    mesh: the device mesh.
    rules: the rule table (see ``logical_to_spec``).

  Returns:
    The same tree of plain (unboxed) ``jax.Array``s, sharded. An array already placed so is
    kept as it is (the same object: nothing is copied).
  """
  shardings = shardings_for(tree, logical_tree, mesh, rules)
  values = meta.unbox(tree)
  return jax.tree_util.tree_map(
    lambda x, s: x if is_placed(x, s) else _put(x, s), values, shardings
  )


def is_placed(x: Any, sharding: NamedSharding) -> bool:
  """Whether ``x`` is a ``jax.Array`` already laid out as ``sharding`` says."""
  return (
    isinstance(x, jax.Array)
    and not isinstance(x, jax.core.Tracer)
    and x.sharding.is_equivalent_to(sharding, x.ndim)
  )


# --- Activations -------------------------------------------------------------


def active_mesh() -> Any:
  """The mesh set by ``jax.set_mesh`` / ``use_mesh`` (abstract inside a trace), or None."""
  mesh = jax.sharding.get_abstract_mesh()
  return None if mesh is None or mesh.empty else mesh


def with_logical_constraint(x: jax.Array, logical_axes: LogicalAxes) -> jax.Array:
  """Constrains an activation's sharding by logical names.

  A no-op unless both a mesh (``jax.set_mesh`` / ``use_mesh``) and rules
  (``nn.logical_axis_rules`` / ``use_mesh``) are active, so model code can
  call it unconditionally and still run on one device. Dimensions that do
  not divide their mesh axes are left replicated.
  """
  active_rules = nn.get_logical_axis_rules()
  mesh = active_mesh()
  if not active_rules or mesh is None or logical_axes is None:
    return x
  spec = logical_to_spec(logical_axes, rules_from(active_rules), shape=x.shape, mesh=mesh)
  return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))


def constrain_activation(x: jax.Array, *features: Optional[str]) -> jax.Array:
  """``with_logical_constraint`` for a model activation ``[batch, ..., *features]``: the
  leading axis is ``batch``, one axis between it and the named trailing ``features`` is
  ``length`` (a block's positions), several are left unnamed (e.g. DFlash's
  ``[B, blocks, T, H]``). A no-op without an active mesh and rules."""
  middle = x.ndim - 1 - len(features)
  if middle < 0:
    raise ConfigError(f"an activation of shape {x.shape} has no room for the axes {features}")
  between = (LENGTH,) if middle == 1 else (None,) * middle
  return with_logical_constraint(x, (BATCH, *between, *features))


def with_logical_constraints(tree: Any, logical_tree: Any) -> Any:
  """``with_logical_constraint`` on every array of ``tree`` (a pytree, e.g. a decoding
  state), by the logical specs of ``logical_tree`` (its structure, as ``logical_to_sharding``
  takes it; a None leaf constrains nothing). A no-op without an active mesh and rules."""
  specs = jax.tree_util.tree_map(
    lambda x: None if x is None else PartitionSpec(*x),
    logical_tree,
    is_leaf=_is_logical_leaf,
  )
  return jax.tree_util.tree_map(
    lambda spec, x: x if spec is None else with_logical_constraint(x, spec),
    specs,
    tree,
    is_leaf=lambda x: x is None or isinstance(x, PartitionSpec),
  )


@contextlib.contextmanager
def use_mesh(mesh: Mesh, rules: Optional[Rules] = None) -> Iterator[Mesh]:
  """Activates ``mesh`` (``jax.set_mesh``) and the logical rules together.

  Inside the context ``with_logical_constraint`` (and Flax's own
  ``nn.with_logical_constraint``) take effect; jit the step inside it.
  """
  rules = rules_from(rules)
  _check_rules_against_mesh(rules, _axis_sizes(mesh))
  with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
    yield mesh


__all__ = [
  "BATCH",
  "DATA",
  "DEFAULT_RULES",
  "EMBED",
  "EXPERT",
  "EXPERT_AXIS",
  "HEADS",
  "HEAD_DIM",
  "KV_HEADS",
  "LAYERS",
  "LENGTH",
  "LOGICAL_AXES",
  "MESH_AXES",
  "MLP",
  "Rules",
  "active_mesh",
  "TENSOR",
  "VOCAB",
  "constrain_activation",
  "is_placed",
  "logical_specs",
  "logical_to_sharding",
  "logical_to_spec",
  "MESH_FORM",
  "make_mesh",
  "parse_mesh",
  "mesh_shape",
  "rules_from",
  "shard_tree",
  "shardings_for",
  "use_mesh",
  "with_logical_constraint",
  "with_logical_constraints",
]
