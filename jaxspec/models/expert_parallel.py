"""Expert parallelism: a MoE layer's routed experts sharded over the mesh's `expert` axis.

On a mesh whose `expert` axis has e > 1 devices, each device keeps E/e of a layer's experts
(their `mlp` width split over `tensor` when the rules split it) and runs only those, inside one
`shard_map` over the whole mesh. Tokens reach their experts by one of two exchanges:

* replicate (decode, short verify blocks): every device of an expert group holds all of the
  group's tokens (all-gathered first if they arrive split over `expert`, as under data-parallel
  attention), runs the (token, expert) pairs routed to its own experts, and the partial outputs
  are summed over the group (psum, or psum_scatter back to the split).
* all_to_all (prefill, long blocks): the group's tokens are split e ways; each device sends every
  pair to the device that owns its expert, in a buffer of C rows per (source, destination), the
  owner runs its experts on what arrived and sends the results back, and the source combines
  them with the routing weights (then all-gathers them if the tokens were replicated). XLA:CPU
  has no ragged all-to-all, so there the buffers move whole; on GPU/TPU `ragged_all_to_all`
  moves only each buffer's filled rows, into the same layout.

"ep" picks the exchange that moves fewer bytes per device (`exchange_bytes`, the traffic model
the planner uses); "ep_replicate" and "ep_all_to_all" force one.

Capacity. C defaults to the exact bound n·min(k, E/e) (n tokens per device, k experts per token,
at most E/e of a token's experts on one device): no pair is ever dropped and the layer equals the
dense oracle. `ep_capacity_factor = f > 0` sets C = min(bound, ⌈f·n·k/e⌉) instead, trading exactness
for buffer size: a (source, destination) buffer keeps its first C pairs in token-major order of
(token, top-k slot), later pairs are dropped (they add nothing to the output), and the number
dropped is returned (the MoE layer sows it as the intermediate "ep_dropped"). A run that drops pairs
computes a different function than the dense target, and speculative decoding is then lossless
only with respect to that function.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from jaxspec import sharding
from jaxspec.errors import ConfigError
from jaxspec.quant.formats import is_quantized, stored_axes

EP_BACKENDS = ("ep", "ep_replicate", "ep_all_to_all")
EXCHANGES = ("replicate", "all_to_all")

# Logical axes of a MoE layer's expert weights (jaxspec.models.moe.MoE declares them with these).
INS_AXES = (sharding.EXPERT, sharding.EMBED, sharding.MLP)  # gate / up / fused gate_up [E, H, I]
DOWN_AXES = (sharding.EXPERT, sharding.MLP, sharding.EMBED)  # [E, I, H]
IN_BIAS_AXES = (sharding.EXPERT, sharding.MLP)
DOWN_BIAS_AXES = (sharding.EXPERT, sharding.EMBED)

# run_local(x [M, H], weights [M, k], ids [M, k] local expert ids, experts, out_dtype) → [M, H]:
# one device's experts on its pairs (jaxspec.models.moe.local_experts).
LocalExperts = Callable[..., jax.Array]


def group_size(mesh: Any) -> int:
  """Devices on the mesh's `expert` axis (1 without a mesh or without that axis)."""
  if mesh is None or sharding.EXPERT_AXIS not in mesh.axis_names:
    return 1
  return int(dict(mesh.shape)[sharding.EXPERT_AXIS])


def applies(backend: str, num_experts: int, mesh: Any) -> bool:
  """Whether a MoE layer with this backend runs expert-parallel on `mesh`: "auto" and the ep
  backends do when the mesh has an `expert` axis of e > 1 devices that divides the experts."""
  e = group_size(mesh)
  if backend not in ("auto", *EP_BACKENDS) or e == 1:
    return False
  if num_experts % e:
    if backend != "auto":
      raise ConfigError(
        f"moe_backend={backend!r}: {num_experts} experts do not divide over an expert axis of "
        f"{e} devices"
      )
    return False
  return True


def remote_devices(e: int, k: int) -> float:
  """Other devices of an e-device expert group that hold at least one of a token's k experts
  (uniform routing, experts spread evenly)."""
  return (e - 1) * (1 - (1 - 1 / e) ** k)


def exchange_bytes(
  exchange: str,
  tokens: int,
  e: int,
  k: int,
  hidden: int,
  act: int,
  split: bool = False,
  capacity: int | None = None,
) -> float:
  """Bytes one device sends per MoE layer for an expert group of e devices and `tokens` tokens.

  replicate: the all-reduce (or all-gather + reduce-scatter when the tokens arrive split over the
  group) of T·H activations, 2·(e−1)/e·T·H·act. all_to_all: each of a device's ⌈T/e⌉ tokens goes
  to the other devices holding its experts and comes back, 2·⌈T/e⌉·remote_devices(e, k)·H·act
  with ragged buffers, or 2·(e−1)·C·H·act with whole buffers of `capacity` rows; plus, when the
  tokens arrive replicated over the group, the all-gather of the outputs, (e−1)/e·T·H·act.
  """
  if exchange not in EXCHANGES:
    raise ConfigError(f"unknown expert exchange {exchange!r}; expected one of {EXCHANGES}")
  if e <= 1:
    return 0.0
  row = hidden * act
  if exchange == "replicate":
    return 2 * (e - 1) / e * tokens * row
  sent = (
    2 * (e - 1) * capacity
    if capacity is not None
    else (2 * math.ceil(tokens / e) * remote_devices(e, k))
  )
  gather = 0.0 if split else (e - 1) / e * tokens
  return (sent + gather) * row


def _spec(axes: tuple, expert: Any, mlp: Any) -> PartitionSpec:
  """A weight's in-spec: its `expert` axis on the mesh's expert axis, `mlp` on `mlp`'s mesh
  axes, every other axis whole (the computation below relies on whole `embed` rows)."""
  names = {sharding.EXPERT: expert, sharding.MLP: mlp}
  return PartitionSpec(*(names.get(a) for a in axes))


def _weight_specs(w: Any, axes: tuple, mlp: Any) -> Any:
  """In-specs for one expert weight, an array or a QTensor (values and scales keep the weight's
  logical names, jaxspec.quant.formats.stored_axes)."""
  if w is None:
    return None
  if is_quantized(w):
    values, scales = stored_axes(axes, w.format, w.axes)
    return w.replace(
      values=_spec(values, sharding.EXPERT_AXIS, mlp),
      scales=_spec(scales, sharding.EXPERT_AXIS, mlp),
    )
  return _spec(axes, sharding.EXPERT_AXIS, mlp)


def _stored(w: Any, axes: tuple) -> list[tuple[tuple, tuple]]:
  """(logical axes, shape) of the arrays a weight is stored in."""
  if w is None:
    return []
  if is_quantized(w):
    values, scales = stored_axes(axes, w.format, w.axes)
    return [(values, w.values.shape), (scales, w.scales.shape)]
  return [(axes, w.shape)]


def _mlp_axes(experts: Any, mesh: Any, rules: sharding.Rules) -> Any:
  """The mesh axes that split the experts' `mlp` width: the rules' choice when it splits every
  stored `mlp` dimension the same way (so the pieces of gate/up and down line up), else None."""
  stored = [
    *(p for m in experts.ins for p in _stored(m, INS_AXES)),
    *_stored(experts.down, DOWN_AXES),
    *(p for b in experts.in_biases or () for p in _stored(b, IN_BIAS_AXES)),
  ]
  choices = set()
  for axes, shape in stored:
    for name, size in zip(axes, shape):
      if name == sharding.MLP:
        spec = sharding.logical_to_spec((sharding.MLP,), rules, shape=(size,), mesh=mesh)
        entry = spec[0] if len(spec) else None
        if isinstance(entry, str):
          entry = (entry,)
        if entry and sharding.EXPERT_AXIS in entry:
          entry = None  # the expert axis already splits the experts
        choices.add(entry or None)
  return next(iter(choices)) if len(choices) == 1 else None


def _token_axes(rows: int, mesh: Any, rules: sharding.Rules) -> tuple[str, ...]:
  """The mesh axes a block's rows ride on: the batch's (the rules'), as many as divide them."""
  spec = sharding.logical_to_spec((sharding.BATCH,), rules, shape=None, mesh=mesh)
  entry = spec[0] if len(spec) else None
  axes = (entry,) if isinstance(entry, str) else tuple(entry or ())
  sizes = dict(mesh.shape)
  while axes and rows % math.prod(sizes[a] for a in axes):
    axes = axes[:-1]
  return axes


def _all_to_all(buf: jax.Array) -> jax.Array:
  """Whole-buffer exchange: chunk d of buf [e, C, ...] goes to device d; chunk s of the result
  came from device s."""
  return jax.lax.all_to_all(buf, sharding.EXPERT_AXIS, 0, 0, tiled=True)


def _ragged(
  ragged_all_to_all: Callable[..., jax.Array],
  buf: jax.Array,
  sizes: jax.Array,
  recv_sizes: jax.Array,
) -> jax.Array:
  """The same exchange moving only the first sizes[d] rows of chunk d; each arrives at row
  me·C of its receiver's buffer, so the layout equals `_all_to_all`'s (unfilled rows zero)."""
  e, c = buf.shape[:2]
  me = jax.lax.axis_index(sharding.EXPERT_AXIS)
  flat = buf.reshape(e * c, *buf.shape[2:])
  out = ragged_all_to_all(
    flat,
    jnp.zeros_like(flat),
    jnp.arange(e, dtype=jnp.int32) * c,
    sizes.astype(jnp.int32),
    jnp.full((e,), me * c, jnp.int32),
    recv_sizes.astype(jnp.int32),
    axis_name=sharding.EXPERT_AXIS,
  )
  return out.reshape(buf.shape)


def _dispatch_and_combine(
  x: jax.Array,
  weights: jax.Array,
  ids: jax.Array,
  valid: jax.Array,
  experts: Any,
  run_local: LocalExperts,
  e: int,
  local_experts: int,
  cap: int,
  ragged_all_to_all: Callable[..., jax.Array] | None,
) -> tuple[jax.Array, jax.Array]:
  """One device's side of the all_to_all exchange: x [m, H] (rows `valid`), its pairs sent to
  their experts' owners and the results combined → (y [m, H] float32, pairs dropped)."""
  m, k = ids.shape
  h = x.shape[-1]
  pairs = m * k
  flat = ids.reshape(-1)
  dest = jnp.where(jnp.repeat(valid, k), flat // local_experts, e)  # e: not sent
  local_id = flat % local_experts
  order = jnp.argsort(dest, stable=True)
  counts = jnp.bincount(dest, length=e + 1)
  starts = jnp.cumsum(counts) - counts
  rank = (
    jnp.zeros(pairs, jnp.int32)
    .at[order]
    .set(jnp.arange(pairs, dtype=jnp.int32) - starts[dest[order]].astype(jnp.int32))
  )
  dropped = jnp.sum((dest < e) & (rank >= cap))
  token = jnp.arange(pairs) // k
  # Out-of-range (dest, rank) — unsent or beyond capacity — are dropped by mode="drop".
  put = lambda init, v: init.at[dest, rank].set(v, mode="drop")
  send_x = put(jnp.zeros((e, cap, h), x.dtype), x[token])
  send_w = put(jnp.zeros((e, cap), jnp.float32), weights.reshape(-1).astype(jnp.float32))
  send_id = put(jnp.zeros((e, cap), jnp.int32), local_id)
  if ragged_all_to_all is None:
    exchange = back = _all_to_all
  else:
    sent = jnp.minimum(counts[:e], cap)
    received = _all_to_all(sent.reshape(e, 1)).reshape(e)
    exchange = lambda b: _ragged(ragged_all_to_all, b, sent, received)
    back = lambda b: _ragged(ragged_all_to_all, b, received, sent)
  recv_x, recv_w, recv_id = exchange(send_x), exchange(send_w), exchange(send_id)
  out = run_local(
    recv_x.reshape(e * cap, h),
    recv_w.reshape(-1, 1),
    recv_id.reshape(-1, 1),
    experts,
    jnp.float32,
  )
  returned = back(out.reshape(e, cap, h))
  contrib = returned.at[dest, rank].get(mode="fill", fill_value=0)  # [pairs, H]
  return jnp.zeros((m, h), jnp.float32).at[token].add(contrib), dropped


def experts_ep(
  x: jax.Array,
  weights: jax.Array,
  ids: jax.Array,
  experts: Any,
  run_local: LocalExperts,
  *,
  mesh: Any,
  rules: sharding.Rules | None = None,
  backend: str = "ep",
  capacity_factor: float = 0.0,
  ragged_all_to_all: Callable[..., jax.Array] | None = None,
  act_bytes: int | None = None,
) -> tuple[jax.Array, jax.Array]:
  """Routed experts over the mesh's expert axis: x [N, H] → (y [N, H] in x's dtype, pairs dropped).

  Args:
    x, weights, ids: the block's tokens and their routing (weights [N, k], global expert ids).
    experts: the layer's expert weights (moe.Experts; arrays or QTensors, stored sharded by
      their logical axes).
    run_local: runs one device's experts on its pairs (moe.local_experts).
    mesh: the active (abstract) mesh; rules: the logical rules (None: the active or default).
    backend: "ep" (the exchange moving fewer bytes), "ep_replicate" or "ep_all_to_all".
    capacity_factor: 0 for the exact capacity, else see the module docstring.
    ragged_all_to_all: the ragged collective for the all_to_all exchange (jax.lax's on GPU/TPU);
      None moves whole buffers (XLA:CPU).
    act_bytes: bytes per activation for the traffic model (default x's itemsize).
  """
  if backend not in EP_BACKENDS:
    raise ConfigError(f"unknown expert-parallel backend {backend!r}; expected one of {EP_BACKENDS}")
  rules = sharding.rules_from(rules) if rules is not None else sharding.DEFAULT_RULES
  n, h = x.shape
  k = ids.shape[1]
  num_experts = experts.down.shape[0]
  e = group_size(mesh)
  local_experts = num_experts // e
  token_axes = _token_axes(n, mesh, rules)
  split = sharding.EXPERT_AXIS in token_axes
  mlp = _mlp_axes(experts, mesh, rules)
  sizes = dict(mesh.shape)
  rows = n // math.prod(sizes[a] for a in token_axes)  # rows per device
  group_tokens = rows * e if split else rows
  mine = rows if split else -(-rows // e)  # rows one device dispatches in the all_to_all
  cap = capacity(mine, k, local_experts, e, capacity_factor)
  exchange = {"ep_replicate": "replicate", "ep_all_to_all": "all_to_all"}.get(backend)
  if exchange is None:
    act = act_bytes or x.dtype.itemsize
    cost = {
      name: exchange_bytes(
        name,
        group_tokens,
        e,
        k,
        h,
        act,
        split,
        None if ragged_all_to_all is not None or name == "replicate" else cap,
      )
      for name in EXCHANGES
    }
    exchange = "all_to_all" if cost["all_to_all"] < cost["replicate"] else "replicate"

  row_spec = PartitionSpec(token_axes or None, None)
  tensors = (experts.ins, experts.in_biases, experts.down, experts.down_bias)
  specs = (
    tuple(_weight_specs(m, INS_AXES, mlp) for m in experts.ins),
    None
    if experts.in_biases is None
    else tuple(_weight_specs(b, IN_BIAS_AXES, mlp) for b in experts.in_biases),
    _weight_specs(experts.down, DOWN_AXES, mlp),
    None if experts.down_bias is None else _spec(DOWN_BIAS_AXES, sharding.EXPERT_AXIS, None),
  )
  mlp_axes = () if mlp is None else mlp
  counted = tuple(a for a in token_axes if a != sharding.EXPERT_AXIS) + (sharding.EXPERT_AXIS,)

  def body(x, weights, ids, ins, in_biases, down, down_bias):
    me = jax.lax.axis_index(sharding.EXPERT_AXIS)
    if mlp_axes and down_bias is not None:  # added once, not once per mlp piece
      first = jnp.all(jnp.stack([jax.lax.axis_index(a) == 0 for a in mlp_axes]))
      down_bias = jnp.where(first, down_bias, jnp.zeros_like(down_bias))
    local = experts._replace(ins=ins, in_biases=in_biases, down=down, down_bias=down_bias)
    dropped = jnp.zeros((), jnp.int32)
    if exchange == "replicate":
      if split:
        x, weights, ids = (
          jax.lax.all_gather(a, sharding.EXPERT_AXIS, axis=0, tiled=True) for a in (x, weights, ids)
        )
      lid = ids - me * local_experts
      ours = (lid >= 0) & (lid < local_experts)
      y = run_local(
        x, jnp.where(ours, weights, 0.0), jnp.clip(lid, 0, local_experts - 1), local, jnp.float32
      )
      if split:
        y = jax.lax.psum_scatter(y, sharding.EXPERT_AXIS, scatter_dimension=0, tiled=True)
      else:
        y = jax.lax.psum(y, sharding.EXPERT_AXIS)
    else:
      if split:
        y, dropped = _dispatch_and_combine(
          x,
          weights,
          ids,
          jnp.ones(rows, bool),
          local,
          run_local,
          e,
          local_experts,
          cap,
          ragged_all_to_all,
        )
      else:  # this device dispatches rows [me·mine, (me+1)·mine) of the (padded) block
        pad = mine * e - rows
        grow = lambda a: jnp.pad(a, [(0, pad)] + [(0, 0)] * (a.ndim - 1))
        take = lambda a: jax.lax.dynamic_slice_in_dim(grow(a), me * mine, mine)
        valid = jax.lax.dynamic_slice_in_dim(jnp.arange(mine * e) < rows, me * mine, mine)
        y_mine, dropped = _dispatch_and_combine(
          take(x),
          take(weights),
          take(ids),
          valid,
          local,
          run_local,
          e,
          local_experts,
          cap,
          ragged_all_to_all,
        )
        y = jax.lax.all_gather(y_mine, sharding.EXPERT_AXIS, axis=0, tiled=True)[:rows]
      dropped = jax.lax.psum(dropped, counted)
    if mlp_axes:
      y = jax.lax.psum(y, mlp_axes)
    return y.astype(x.dtype), dropped

  y, dropped = jax.shard_map(
    body,
    mesh=mesh,
    in_specs=(row_spec, row_spec, row_spec, *specs),
    out_specs=(row_spec, PartitionSpec()),
    check_vma=False,
  )(x, weights, ids, *tensors)
  return y, dropped


def capacity(rows: int, k: int, local_experts: int, e: int, factor: float = 0.0) -> int:
  """Rows of one (source, destination) buffer: the exact bound rows·min(k, E/e), or
  min(bound, ⌈factor·rows·k/e⌉) with factor > 0 (see the module docstring)."""
  bound = max(1, rows * min(k, local_experts))
  if factor <= 0:
    return bound
  return max(1, min(bound, math.ceil(factor * rows * k / e)))
