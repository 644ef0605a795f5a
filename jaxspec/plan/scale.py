"""Bytes per device and bytes over the interconnect for a model on a mesh, before any allocation.

Inputs: a `ModelSpec` (`jaxspec.plan.arch`: from a HF config.json), a mesh `{data, expert,
tensor}`, a quantization policy (`jaxspec.quant.policy` rules, or a name in `POLICIES`), a KV
format (`jaxspec.state.KV_FORMATS`), `max_len`, batch, a verify block of N tokens and an
optional drafter. Outputs (`Plan`): per-device bytes of the parameters by format, the decoding
state, the drafter (weights and state) and the peak activations of one verify block; whether
that fits a named accelerator and with what margin; and the interconnect bytes of one decode
step and of one verify block.

**Memory.** Every array (weight, quantized weight's values and scales, state array) is sharded
by `jaxspec.sharding.logical_to_spec` with the run's rule table and the mesh sizes, exactly as
`shard_tree` places live arrays, so a dimension that does not divide its mesh axes stays
replicated here too. A quantized weight's shapes come from `jaxspec.quant.quantize_weight`
traced abstractly; its values and scales keep the weight's logical axes
(`jaxspec.quant.formats.stored_axes`). Activations of a verify block (T = ⌈B/ways⌉·N tokens
per device, the batch split `ways` ways by the rules, act = activation bytes, 2 for bfloat16), an estimate of the live buffers at the
widest point of one layer plus the logits:

  residual + normed input      2·T·H·act
  attention                    T·(q_width + 2·kv_width)/tensor·act + T·heads/tensor·chunk·4
  feed-forward (the larger)    dense 2·T·I/tensor·act | MoE 2·T·k·I_moe/tensor·act + T·E·4
  logits                       2·T·V/tensor·4 (float32 logits and their log-softmax)
  recurrent snapshots          N·⌈B/data⌉·(state of every linear layer)/tensor (hybrids only)

peak = residual + max(attention, feed-forward) + logits + snapshots.

**Interconnect (per device, bytes sent in one step of T_d = ⌈B/data⌉·N tokens).** Collectives
are counted as ring algorithms: an all-reduce of S bytes over g devices sends 2·(g−1)/g·S per
device, an all-gather (g−1)/g·S.

* Tensor parallel (tensor = t > 1): every layer ends its token mixer (attention, MLA, Gated
  DeltaNet) and its feed-forward (dense, shared and routed experts, whose `mlp` axis is on
  `tensor`) with an all-reduce of the T_d·H activations: 2 · 2·(t−1)/t · T_d·H·act per layer.
  The vocabulary-sharded logits are all-gathered for sampling: (t−1)/t · T_d·V·4.
* Expert parallel (expert = e > 1), per MoE layer, the cheaper of the two exchanges the
  expert-parallel backend runs (jaxspec.models.expert_parallel.exchange_bytes, the same model
  its "ep" backend picks by):
  - all-to-all: tokens split over the expert group (⌈T_d/e⌉ per device); each token goes once
    to every other device owning one of its k experts — on average (e−1)·(1−(1−1/e)^k) devices
    for uniform routing — and comes back combined: 2·⌈T_d/e⌉·(e−1)·(1−(1−1/e)^k)·H·act; when
    the tokens arrive replicated over the group (the batch on `data` only, the default rules)
    the outputs are then all-gathered, (e−1)/e·T_d·H·act more;
  - replicate + reduce: every device of the group holds all T_d tokens, runs its local experts
    and the partial outputs are all-reduced (all-gathered and reduce-scattered when the tokens
    arrive split): 2·(e−1)/e·T_d·H·act.
  With tokens replicated over the group (the default rules) the all-to-all can win only when a
  token's experts touch fewer than half of the other devices, 1−(1−1/e)^k < 1/2, and a block has
  at least e tokens; DeepSeek-V3 (e = 8, k = 8: 0.66) replicates at every block size. With the
  batch split over `expert` too (data-parallel attention, `launch/plan.py
  --batch_axes=data,expert`) the all-to-all wins once a device has a token.
* The data axis moves nothing per step (sequences are independent; weights are replicated).

What the model leaves out: the latency terms (all-to-all count exchange, kernel launches),
load imbalance across experts, pipeline or sequence parallelism, and the drafter's own
traffic (it is small and replicated over `expert`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import jax

from jaxspec import sharding
from jaxspec.errors import ConfigError
from jaxspec.models import expert_parallel
from jaxspec.plan.arch import ModelSpec, Tensor, kv_kind_tensors, tensors_of
from jaxspec.speculative.memory import human_bytes
from jaxspec.quant.formats import quantize_weight, stored_axes
from jaxspec.quant.policy import DEFAULT_POLICY, check_policy, contraction_axes, format_for
from jaxspec.state import DEFAULT_SLACK

# Named policies: the weights of every role they name in that format; the rest as stored.
POLICIES: dict[str, tuple[tuple[str, str], ...]] = {
  "bf16": (),
  "fp8": (
    ("experts", "fp8"),
    ("shared_experts", "fp8"),
    ("mlp", "fp8"),
    ("attention", "fp8"),
  ),
  "mxfp4_fp8": DEFAULT_POLICY,  # MXFP4 experts, FP8 attention and router (MiMo × TileRT)
  "int4_experts": (("experts", "int4"),),  # Kimi-K2's published INT4 experts (group 32)
}

# Memory per device in bytes, as published (decimal GB: slightly less than the devices report).
ACCELERATORS: dict[str, tuple[str, float]] = {
  "h100": ("H100 80 GB", 80e9),
  "h200": ("H200 141 GB", 141e9),
  "b200": ("B200 192 GB", 192e9),
  "v5p": ("TPU v5p 95 GB", 95e9),
  "v6e": ("TPU v6e 32 GB", 32e9),
}

ATTENTION_CHUNK = 256  # RunOptions.attention_chunk: keys per online-softmax chunk
DFLASH_TAPS = 5  # target layers a published DFlash drafter reads
DFLASH_LAYERS_PER = 6  # target layers per DFlash drafter layer (published: 4–8)
EAGLE3_DRAFT_VOCAB = 32000  # EAGLE-3's draft vocabulary (SpecForge's default)


def policy_rules(policy: str | Iterable) -> tuple[tuple[str, str], ...]:
  """A policy by name (`POLICIES`) or as (pattern, format) rules, validated."""
  if isinstance(policy, str):
    if policy not in POLICIES:
      raise ConfigError(f"unknown policy {policy!r}; expected one of {sorted(POLICIES)}")
    return POLICIES[policy]
  return check_policy(policy)


def mesh_sizes(mesh: Any) -> dict[str, int]:
  """`{data, expert, tensor}` sizes from a dict, MeshConfig or "expert=8,tensor=2" string."""
  sizes = sharding.parse_mesh(mesh) if isinstance(mesh, str) else sharding.mesh_shape(mesh)
  bad = {a: s for a, s in sizes.items() if s < 1}
  if bad:
    raise ConfigError(f"a planned mesh needs explicit positive sizes; got {bad}")
  return sizes


def _split(t: Tensor, sizes: Mapping[str, int], rules: sharding.Rules) -> int:
  """How many ways the rule table splits `t` over a mesh of these sizes."""
  spec = sharding.logical_to_spec(t.axes, rules, shape=t.shape, mesh=sizes)
  ways = 1
  for entry in spec:
    for axis in (entry,) if isinstance(entry, str) else (entry or ()):
      ways *= sizes[axis]
  return ways


def device_bytes(t: Tensor, sizes: Mapping[str, int], rules: sharding.Rules | None = None) -> int:
  """Bytes of `t` on one device once sharded by the rules (every device holds as much)."""
  return t.nbytes // _split(t, mesh_sizes(sizes), sharding.rules_from(rules))


def _contraction(axes: tuple) -> tuple[int, ...]:
  """The weight's contraction axes (policy.contraction_axes), or, for a matrix with no `embed`
  axis (MLA's low-rank up-projections), its first matrix axis."""
  try:
    return contraction_axes(axes)
  except ConfigError:
    lead = 0
    while lead < len(axes) and axes[lead] in ("layers", "expert"):
      lead += 1
    return (lead - len(axes),)


def stored_tensors(w: Tensor, fmt: str) -> tuple[Tensor, ...]:
  """The arrays `w` is kept as in format `fmt` ("none": itself), shapes traced from the
  quantizer itself."""
  if fmt == "none":
    return (w,)
  axes = _contraction(w.axes)
  try:
    q = jax.eval_shape(
      lambda x: quantize_weight(x, fmt, axes), jax.ShapeDtypeStruct(w.shape, w.dtype)
    )
  except ConfigError as e:
    raise ConfigError(f"{w.path} ({fmt}): {e}") from None
  values_axes, scales_axes = stored_axes(w.axes, fmt, axes)
  return (
    Tensor(f"{w.path}/values", tuple(q.values.shape), str(q.values.dtype), values_axes),
    Tensor(f"{w.path}/scales", tuple(q.scales.shape), str(q.scales.dtype), scales_axes),
  )


def weight_format(w: Tensor, rules: tuple, config: Any = None) -> str:
  """The policy's format for `w`; vectors (norms, biases, gates) always stay as stored."""
  matrix = [a for a in w.axes if a not in ("layers", "expert")]
  if len(matrix) < 2:
    return "none"
  return format_for(w.path, rules, config)


def params_by_format(
  spec: ModelSpec, policy: Any, sizes: Mapping[str, int], rules: sharding.Rules | None = None
) -> dict[str, int]:
  """Per-device bytes of the target's parameters in each format ("none": unquantized)."""
  policy, rules, sizes = policy_rules(policy), sharding.rules_from(rules), mesh_sizes(sizes)
  out: dict[str, int] = {}
  for w in spec.weights:
    fmt = weight_format(w, policy, spec.config)
    for t in stored_tensors(w, fmt):
      out[fmt] = out.get(fmt, 0) + device_bytes(t, sizes, rules)
  return out


def state_bytes(
  spec: ModelSpec,
  batch: int,
  max_len: int,
  kv_format: str,
  sizes: Mapping[str, int],
  rules: sharding.Rules | None = None,
  slack: int = DEFAULT_SLACK,
) -> int:
  """Per-device bytes of the target's decoding state, sharded by its logical axes
  (sliding-window layers: rings of window + `slack` slots; slack ≥ max_len: every position)."""
  rules, sizes = sharding.rules_from(rules), mesh_sizes(sizes)
  tensors = spec.state(batch, max_len, kv_format, slack=slack)
  return sum(device_bytes(t, sizes, rules) for t in tensors)


# ------------------------------------------------------------------------------------------------
# Drafters
# ------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class DrafterSpec:
  """A drafter's weights (traced from its jaxspec module) and its state arrays' builder."""

  kind: str
  weights: tuple[Tensor, ...]
  state: Any  # (batch, max_len) -> tuple[Tensor, ...]


def drafter_spec(kind: str | None, spec: ModelSpec, layers: int = 0) -> DrafterSpec | None:
  """DFlash or EAGLE-3 of the published proportions for this target (None: no drafter).

  DFlash: the target's width, `layers` layers (default one per `DFLASH_LAYERS_PER` target
  layers), 128-wide heads, the target's dense FFN width, `DFLASH_TAPS` context features, the
  target's embedding and head shared; its state is K/V of the last `context_window` (4096)
  context positions per layer. EAGLE-3: one layer and its own head over a 32K draft
  vocabulary; its state is one layer's K/V over the whole context. "mtp" and "none" add
  nothing (MTP layers are part of the target's parameters).
  """
  if kind in (None, "", "none", "mtp"):
    return None
  from jaxspec.drafters import dflash, eagle3  # pylint: disable=import-outside-toplevel

  d = spec.dims
  h = d["hidden"]
  heads = max(1, h // 128)
  kv_heads = math.gcd(heads, 8)
  inter = d["intermediate"] or 3 * h
  dtype = spec.param_dtype
  if kind == "dflash":
    n = layers or max(1, round(d["layers"] / DFLASH_LAYERS_PER))
    cfg = dflash.DFlashConfig(
      hidden_size=h,
      num_layers=n,
      num_heads=heads,
      num_kv_heads=kv_heads,
      head_dim=128,
      intermediate_size=inter,
      target_layer_ids=dflash.build_target_layer_ids(d["layers"], DFLASH_TAPS),
      mask_token_id=0,
      vocab_size=d["vocab"],
      num_target_layers=d["layers"],
      dtype=dtype,
      param_dtype=dtype,
    )
    lib, window = dflash, dflash.DEFAULT_CONTEXT_WINDOW

    def state(batch: int, max_len: int) -> tuple[Tensor, ...]:
      cap = min(window, max_len)
      return kv_kind_tensors("dflash", n, batch, cap, kv_heads, 128, "float", dtype) + (
        Tensor("dflash.ctx_pos", (batch, cap), "int32", ("batch", "length")),
      )

  elif kind == "eagle3":
    cfg = eagle3.Eagle3Config(
      hidden_size=h,
      num_heads=heads,
      num_kv_heads=kv_heads,
      head_dim=128,
      intermediate_size=inter,
      target_layer_ids=eagle3.default_layer_ids(d["layers"]),
      vocab_size=d["vocab"],
      draft_vocab_size=min(EAGLE3_DRAFT_VOCAB, d["vocab"]),
      dtype=dtype,
      param_dtype=dtype,
    )
    lib = eagle3

    def state(batch: int, max_len: int) -> tuple[Tensor, ...]:
      return kv_kind_tensors("eagle3", 1, batch, max_len, kv_heads, 128, "float", dtype) + (
        Tensor("eagle3.last_feature", (batch, h), dtype, ("batch", "embed")),
      )

  else:
    raise ConfigError(f"unknown drafter {kind!r}; expected dflash, eagle3, mtp or none")
  weights = tensors_of(lib.param_shapes(cfg), lib.logical_axes(cfg))
  return DrafterSpec(kind, weights, state)


# ------------------------------------------------------------------------------------------------
# Activations and traffic
# ------------------------------------------------------------------------------------------------


def _local(n: int, ways: int) -> float:
  """n split `ways` ways when it divides (the rule table's fallback replicates otherwise)."""
  return n / ways if ways > 1 and n % ways == 0 else float(n)


def activation_bytes(
  spec: ModelSpec,
  batch: int,
  block: int,
  sizes: Mapping[str, int],
  act: int = 2,
  rules: sharding.Rules | None = None,
) -> int:
  """Peak activations of one verify block of `block` tokens per sequence, per device (the
  batch split as the rules split it: over `data` by default)."""
  d, t = spec.dims, sizes["tensor"]
  ways = _split(Tensor("batch", (batch,), "int32", ("batch",)), sizes, sharding.rules_from(rules))
  rows = math.ceil(batch / ways)
  tokens = rows * block
  h = d["hidden"]
  residual = 2 * tokens * h * act
  kv_width = d["cache_heads"] * d["cache_head_dim"]
  attention = tokens * (_local(d["q_width"], t) + 2 * _local(kv_width, t)) * act
  attention += tokens * _local(d["heads"], t) * ATTENTION_CHUNK * 4
  ffn = 2 * tokens * _local(d["intermediate"], t) * act
  if d["experts"]:
    routed = 2 * tokens * d["top_k"] * _local(d["moe_intermediate"], t) * act
    shared = 2 * tokens * _local(d["shared_intermediate"], t) * act
    ffn = max(ffn, routed + shared + tokens * d["experts"] * 4)
  logits = 2 * tokens * _local(d["vocab"], t) * 4
  snapshots = 0.0
  if d["linear_layers"]:
    per_layer = (
      d["conv_dim"] * d["conv_window"] * act
      + d["linear_value_heads"] * d["linear_key_dim"] * d["linear_value_dim"] * 4
    )
    snapshots = block * rows * d["linear_layers"] * _local(per_layer, t)
  return int(residual + max(attention, ffn) + logits + snapshots)


def traffic(
  spec: ModelSpec,
  batch: int,
  block: int,
  sizes: Mapping[str, int],
  act: int = 2,
  split: bool = False,
) -> dict[str, Any]:
  """Interconnect bytes one device sends in one step of `block` tokens per sequence (see the
  module docstring): {"tensor", "expert", "total": bytes, "expert_mode": ...}. `split`: the
  batch is split over `expert` too (data-parallel attention), so the tokens arrive split over
  each expert group instead of replicated."""
  d, t, e = spec.dims, sizes["tensor"], sizes["expert"]
  tokens = math.ceil(batch / sizes["data"]) * block
  h = d["hidden"]
  tensor = 0.0
  if t > 1:
    layers = d["layers"]
    tensor = layers * 2 * (2 * (t - 1) / t) * tokens * h * act
    tensor += (t - 1) / t * tokens * d["vocab"] * 4
  expert, mode = 0.0, "-"
  if e > 1 and d["moe_layers"]:
    cost = {
      name: expert_parallel.exchange_bytes(name, tokens, e, d["top_k"], h, act, split)
      for name in expert_parallel.EXCHANGES
    }
    mode = "all_to_all" if cost["all_to_all"] < cost["replicate"] else "replicate"
    expert = d["moe_layers"] * cost[mode]
  return {
    "tensor": int(tensor),
    "expert": int(expert),
    "total": int(tensor + expert),
    "expert_mode": mode,
  }


# ------------------------------------------------------------------------------------------------
# The plan
# ------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Plan:
  """Per-device bytes of one run, and its interconnect bytes per step (see the module doc)."""

  model: str
  mesh: Mapping[str, int]
  policy: str
  kv_format: str
  max_len: int
  batch: int
  block: int
  params: Mapping[str, int]  # by format
  state: int
  drafter: int
  activations: int
  state_full_length: int  # the state if sliding-window layers kept every position
  decode_traffic: Mapping[str, Any]
  verify_traffic: Mapping[str, Any]

  @property
  def total(self) -> int:
    return sum(self.params.values()) + self.state + self.drafter + self.activations

  def margin(self, accelerator: str) -> float:
    """Bytes left on one device of `accelerator` (negative: does not fit)."""
    return accelerator_bytes(accelerator) - self.total

  def fits(self, accelerator: str) -> bool:
    return self.margin(accelerator) >= 0

  def describe(self, accelerators: Sequence[str] = ("h100", "h200")) -> list[str]:
    mesh = ",".join(f"{a}={s}" for a, s in self.mesh.items())
    lines = [
      (
        f"{self.model}: mesh {mesh}, policy {self.policy}, kv {self.kv_format}, "
        f"max_len {self.max_len}, batch {self.batch}, verify block {self.block}"
      ),
      "  per device:",
    ]
    for fmt, n in sorted(self.params.items()):
      label = f"parameters ({'as stored' if fmt == 'none' else fmt})"
      lines.append(f"    {label:<24}{human_bytes(n):>12}")
    lines += [
      f"    decoding state          {human_bytes(self.state):>12}",
      *(
        [f"      (sliding layers holding every position: {human_bytes(self.state_full_length)})"]
        if self.state_full_length != self.state
        else []
      ),
      f"    drafter (weights+state) {human_bytes(self.drafter):>12}",
      f"    verify activations      {human_bytes(self.activations):>12}",
      f"    total                   {human_bytes(self.total):>12}",
    ]
    for acc in accelerators:
      name, cap = ACCELERATORS[acc]
      m = self.margin(acc)
      verdict = "fits" if m >= 0 else "does NOT fit"
      lines.append(f"  {name}: {verdict}, margin {human_bytes(m)} ({m / cap:+.0%})")
    for label, tr in (
      ("decode step", self.decode_traffic),
      (f"verify of {self.block}", self.verify_traffic),
    ):
      lines.append(
        f"  interconnect per device, {label}: {human_bytes(tr['total'])} (tensor "
        f"{human_bytes(tr['tensor'])}, expert {human_bytes(tr['expert'])} {tr['expert_mode']})"
      )
    return lines


def accelerator_bytes(name: str) -> float:
  if name not in ACCELERATORS:
    raise ConfigError(f"unknown accelerator {name!r}; expected one of {sorted(ACCELERATORS)}")
  return ACCELERATORS[name][1]


def _batch_on_expert(batch: int, sizes: Mapping[str, int], rules: sharding.Rules) -> bool:
  """Whether the rules split a batch of this size over the `expert` mesh axis."""
  spec = sharding.logical_to_spec((sharding.BATCH,), rules, shape=(batch,), mesh=sizes)
  entry = spec[0] if len(spec) else None
  return sharding.EXPERT_AXIS in ((entry,) if isinstance(entry, str) else tuple(entry or ()))


def plan(
  spec: ModelSpec,
  mesh: Any,
  policy: Any = "bf16",
  kv_format: str = "float",
  max_len: int = 32768,
  batch: int = 1,
  block: int = 16,
  drafter: str | None = None,
  drafter_layers: int = 0,
  rules: sharding.Rules | None = None,
) -> Plan:
  """The per-device memory and per-step traffic of `spec` on `mesh` (see the module doc)."""
  sizes = mesh_sizes(mesh)
  for name, v in (("max_len", max_len), ("batch", batch), ("block", block)):
    if not isinstance(v, int) or v < 1:
      raise ConfigError(f"{name} must be a positive integer, got {v!r}")
  rules = sharding.rules_from(rules)
  draft = drafter_spec(drafter, spec, drafter_layers)
  draft_bytes = 0
  if draft is not None:
    draft_bytes = sum(device_bytes(w, sizes, rules) for w in draft.weights)
    draft_bytes += sum(device_bytes(t, sizes, rules) for t in draft.state(batch, max_len))
  return Plan(
    model=spec.name,
    mesh=sizes,
    policy=policy if isinstance(policy, str) else "custom",
    kv_format=kv_format,
    max_len=max_len,
    batch=batch,
    block=block,
    params=params_by_format(spec, policy, sizes, rules),
    state=state_bytes(spec, batch, max_len, kv_format, sizes, rules, slack=block),
    state_full_length=state_bytes(spec, batch, max_len, kv_format, sizes, rules, slack=max_len),
    drafter=draft_bytes,
    activations=activation_bytes(spec, batch, block, sizes, rules=rules),
    decode_traffic=traffic(spec, batch, 1, sizes, split=_batch_on_expert(batch, sizes, rules)),
    verify_traffic=traffic(spec, batch, block, sizes, split=_batch_on_expert(batch, sizes, rules)),
  )


def comparison_table(
  specs: Sequence[ModelSpec],
  meshes: Sequence[Any] = ({"expert": 8},),
  policies: Sequence[str] = ("bf16", "fp8", "mxfp4_fp8"),
  contexts: Sequence[int] = (32768, 131072),
  accelerators: Sequence[str] = ("h200", "h100"),
  **options: Any,
) -> list[str]:
  """Markdown rows: every model × policy × context, its per-device total and margins."""
  head = ["model", "params", "policy", "context", "weights/dev", "state/dev", "act/dev"]
  head += [f"8×{ACCELERATORS[a][0].split()[0]} margin" for a in accelerators]
  head += ["decode bytes/dev", "verify bytes/dev"]
  rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
  for spec in specs:
    for mesh in meshes:
      for pol in policies:
        for ctx in contexts:
          p = plan(spec, mesh, pol, max_len=ctx, **options)
          cells = [
            spec.name,
            f"{spec.num_params / 1e9:.0f}B",
            pol,
            f"{ctx // 1024}K",
            _gb(sum(p.params.values())),
            _gb(p.state),
            _gb(p.activations),
          ]
          for acc in accelerators:
            m = p.margin(acc)
            cells.append(("" if m >= 0 else "✗ ") + f"{m / 1e9:+.1f} GB")
          cells += [_traffic_cell(p.decode_traffic), _traffic_cell(p.verify_traffic)]
          rows.append("| " + " | ".join(cells) + " |")
  return rows


def _gb(n: float) -> str:
  return f"{n / 1e9:.1f} GB" if n >= 1e9 else f"{n / 1e6:.0f} MB"


def _traffic_cell(tr: Mapping[str, Any]) -> str:
  n = tr["total"]
  text = f"{n / 1e6:.2f} MB" if n >= 1e5 else f"{n / 1e3:.1f} KB"
  return f"{text} ({tr['expert_mode']})" if tr["expert_mode"] != "-" else text


__all__ = [
  "ACCELERATORS",
  "POLICIES",
  "DrafterSpec",
  "Plan",
  "accelerator_bytes",
  "activation_bytes",
  "comparison_table",
  "device_bytes",
  "drafter_spec",
  "mesh_sizes",
  "params_by_format",
  "plan",
  "policy_rules",
  "state_bytes",
  "stored_tensors",
  "traffic",
]
