"""MiMo-V2-Flash: sliding-window layers beside full ones, each type with its own RoPE base, KV
head count and sinks; keys wider than values; values scaled; dense first layer(s), then MoE
layers with DeepSeek's grouped sigmoid routing and no shared experts.

Two spellings of the config reach jaxspec, and both are read:

* transformers' (`model_type` mimo_v2_flash, what `save_pretrained` writes): `layer_types`,
  `mlp_layer_types`, `rope_parameters` nested per layer type, `sliding_window` (keys p seen by
  query q iff p > q − W, so 129 = 128 earlier keys and the query's own), `rms_norm_eps`.
  transformers gives sliding layers twice `num_key_value_heads` and sinks, full layers none.
* the published hub config.json's: `hybrid_layer_pattern` (1 = sliding), `moe_layer_freq`
  (1 = MoE), `sliding_window_size` (earlier keys: W − 1), `swa_num_key_value_heads`,
  `swa_rope_theta`, `add_{swa,full}_attention_sink_bias`, `layernorm_epsilon`,
  `scoring_func` / `topk_method`, and `swa_*` head shapes that must equal the full layers'.

Where both state a fact they must agree. `config_to_hf` writes transformers' keys and the
hub's sliding-layer ones (which transformers ignores), so either reader gets the same model.
MTP layers (`num_nextn_predict_layers` of them, under `model.mtp.layers.{k}.*`) are built when
the config states them: a sliding-window block with a dense MLP (models/decoder.py, MTPLayer);
a config stating none skips those tensors with a warning, as transformers does.
"""

from __future__ import annotations

from typing import Any, Mapping

from jaxspec.config import ModelConfig
from jaxspec.errors import ConfigError, show
from jaxspec.family import Family
from jaxspec.io.architectures.base import Architecture
from jaxspec.io.architectures.reader import FULL, SLIDING, HFConfigReader
from jaxspec.io.architectures.tensors import TensorLayout

# transformers' defaults (MiMoV2FlashConfig.__post_init__).
DEFAULT_THETA = {FULL: 5_000_000.0, SLIDING: 10_000.0}
DEFAULT_PARTIAL = 0.334
HF_WINDOW = 129


def _default_types(n: int) -> list[str]:
  """transformers' pattern: full attention at layer 0 and every 6th layer, sliding elsewhere."""
  return [FULL if i == 0 or (i + 1) % 6 == 0 else SLIDING for i in range(n)]


def _prepare(hf: Mapping[str, Any]) -> dict[str, Any]:
  """The config with the hub's keys turned into transformers' and the per-type RoPE folded
  into the flat keys the shared reader reads (the full layers'); the sliding layers' base is
  kept under `_sliding_rope_theta` for `_read`."""
  r = HFConfigReader(hf, "MiMoV2FlashForCausalLM")
  out = dict(hf)
  n = r.integer("num_hidden_layers", 0)
  pattern = r.integers("hybrid_layer_pattern", None)
  if pattern is not None:
    types = [SLIDING if p else FULL for p in pattern]
    if r.has("layer_types") and list(r.strings("layer_types")) != types:
      raise r.error("layer_types and hybrid_layer_pattern disagree")
    out["layer_types"] = types
  freq = r.integers("moe_layer_freq", None)
  if freq is not None and not isinstance(hf.get("moe_layer_freq"), int):
    kinds = ["sparse" if f else "dense" for f in freq]
    if r.has("mlp_layer_types") and list(r.strings("mlp_layer_types")) != kinds:
      raise r.error("mlp_layer_types and moe_layer_freq disagree")
    out["mlp_layer_types"] = kinds
  if r.has("sliding_window_size"):  # the hub's count of earlier keys (transformers: W − 1)
    out["sliding_window"] = r.integer("sliding_window_size") + 1
  if r.has("layernorm_epsilon"):
    eps = r.number("layernorm_epsilon")
    if r.has("rms_norm_eps") and r.number("rms_norm_eps") != eps:
      raise r.error("rms_norm_eps and layernorm_epsilon disagree")
    out["rms_norm_eps"] = eps
  # RoPE: per type in rope_parameters (transformers), or rope_theta / swa_rope_theta (hub).
  per_type = r.mapping("rope_parameters")
  nested = {k: v for k, v in per_type.items() if isinstance(v, Mapping)}
  theta, partial = {}, {}
  for kind in (FULL, SLIDING):
    d = nested.get(kind, {})
    rope_type = d.get("rope_type") or d.get("type") or "default"
    if rope_type != "default":
      raise r.error(f"RoPE type {show(rope_type)} in rope_parameters.{kind} is not supported")
    theta[kind] = d.get("rope_theta")
    partial[kind] = d.get("partial_rotary_factor")
  extra = sorted(set(nested) - {FULL, SLIDING})
  if extra:
    raise r.error(f"rope_parameters names unknown layer types {extra}")
  for kind, key in ((FULL, "rope_theta"), (SLIDING, "swa_rope_theta")):
    if r.has(key):
      if theta[kind] is not None and float(theta[kind]) != r.number(key):
        raise r.error(f"{key} and rope_parameters.{kind}.rope_theta disagree")
      theta[kind] = r.number(key)
    if theta[kind] is None:
      theta[kind] = DEFAULT_THETA[kind]
  stated = r.number("partial_rotary_factor", None)
  partial = {k: v if v is not None else stated for k, v in partial.items()}
  partial = {k: DEFAULT_PARTIAL if v is None else v for k, v in partial.items()}
  if partial[FULL] != partial[SLIDING]:
    raise r.error(
      f"partial_rotary_factor differs between layer types ({partial[FULL]} full, "
      f"{partial[SLIDING]} sliding): jaxspec rotates the same features in every layer"
    )
  if nested:
    out.pop("rope_parameters")
  out["rope_theta"] = theta[FULL]
  out["partial_rotary_factor"] = partial[FULL]
  out["_sliding_rope_theta"] = theta[SLIDING]
  if n and "layer_types" not in out:
    out["layer_types"] = _default_types(n)
  return out


def _same(r: HFConfigReader, swa_key: str, key: str, value: Any) -> None:
  """The hub's sliding-layer shape `swa_key`, which jaxspec requires to equal `key`'s."""
  stated = r.hf.get(swa_key)
  if stated is not None and stated != value:
    raise r.error(
      f"{swa_key}={show(stated)} differs from {key}={show(value)}: jaxspec gives sliding "
      "layers the full layers' query heads and head widths"
    )


def _read(r: HFConfigReader, kw: dict[str, Any]) -> dict[str, Any]:
  n = kw["num_layers"]
  types = list(r.strings("layer_types"))
  bad = sorted(set(types) - {SLIDING, FULL})
  if bad or len(types) != n:
    raise r.error(
      f"layer_types must name {SLIDING!r} or {FULL!r} for each of the {n} layers, got "
      f"{show(types)}"
    )
  window = r.integer("sliding_window", HF_WINDOW)
  if SLIDING in types and window < 2:
    raise r.error(f"sliding_window must be ≥ 2 (the query and an earlier key), got {window}")
  kinds = list(r.strings("mlp_layer_types", ["dense"] + ["sparse"] * (n - 1)))
  if len(kinds) != n or set(kinds) - {"dense", "sparse"}:
    raise r.error(f"mlp_layer_types must name 'dense' or 'sparse' for each of the {n} layers")
  for key, allowed in (("scoring_func", ("sigmoid",)), ("topk_method", ("noaux_tc",))):
    if r.hf.get(key) is not None and r.hf[key] not in allowed:
      raise r.error(f"{key}={show(r.hf[key])} is not supported (only {allowed[0]!r})")
  if r.hf.get("n_shared_experts"):
    raise r.error(f"n_shared_experts={show(r.hf['n_shared_experts'])}: MiMo has none")
  layout = r.hf.get("attention_projection_layout")
  if layout not in (None, "split"):
    raise r.error(f"attention_projection_layout={show(layout)} is not supported (only 'split')")
  heads, kv_heads = kw["num_heads"], kw["num_kv_heads"]
  head_dim = kw["head_dim"]
  v_head_dim = r.integer("v_head_dim", head_dim)
  _same(r, "swa_num_attention_heads", "num_attention_heads", heads)
  _same(r, "swa_head_dim", "head_dim", head_dim)
  _same(r, "swa_v_head_dim", "v_head_dim", v_head_dim)
  swa_sinks = r.flag("add_swa_attention_sink_bias", True)
  full_sinks = r.flag("add_full_attention_sink_bias", False)
  if full_sinks and not swa_sinks:
    raise r.error(
      "add_full_attention_sink_bias without add_swa_attention_sink_bias is not supported"
    )
  experts = r.first_integer(("n_routed_experts", "num_local_experts"), 0)
  scaling = r.hf.get("routed_scaling_factor")
  # transformers: 0.707 when absent, none (1.0) when stated null.
  stated_null = "attention_value_scale" in r.hf and r.hf["attention_value_scale"] is None
  value_scale = 1.0 if stated_null else r.number("attention_value_scale", 0.707)
  return dict(
    intermediate_size=kw["intermediate_size"],
    qk_norm=False,
    v_head_dim=v_head_dim,
    attention_value_scale=value_scale,
    num_experts=experts,
    num_experts_per_tok=r.integer("num_experts_per_tok", 8),
    moe_intermediate_size=r.integer("moe_intermediate_size", 2048),
    router="sigmoid",
    norm_topk_prob=r.flag("norm_topk_prob", True),
    n_group=r.integer("n_group", 1),
    topk_group=r.integer("topk_group", 1),
    routed_scaling_factor=1.0 if scaling is None else r.number("routed_scaling_factor"),
    layer_is_moe=tuple(k == "sparse" for k in kinds),
    layer_windows=tuple(window if t == SLIDING else 0 for t in types),
    attention_sinks=full_sinks,
    sliding_attention_sinks=swa_sinks and not full_sinks,
    sliding_num_kv_heads=r.integer("swa_num_key_value_heads", 2 * kv_heads),
    sliding_rope_theta=float(r.hf["_sliding_rope_theta"]),
  )


def _write(c: ModelConfig) -> dict[str, Any]:
  windows = {w for w in c.layer_windows if w}
  if len(windows) > 1:
    raise ConfigError(f"MiMo-V2-Flash has one sliding window size, got {sorted(windows)}")
  window = windows.pop() if windows else HF_WINDOW
  rope = lambda theta: {
    "rope_type": "default",
    "rope_theta": theta,
    "partial_rotary_factor": c.partial_rotary_factor,
  }
  types = [SLIDING if w else FULL for w in c.layer_windows]
  sliding_theta = c.sliding_rope_theta or c.rope_theta
  return dict(
    intermediate_size=c.intermediate_size,
    v_head_dim=c.value_head_dim,
    attention_value_scale=c.attention_value_scale,
    n_routed_experts=c.num_experts,
    num_experts_per_tok=c.num_experts_per_tok,
    moe_intermediate_size=c.moe_intermediate_size,
    norm_topk_prob=c.norm_topk_prob,
    n_group=c.n_group,
    topk_group=c.topk_group,
    routed_scaling_factor=c.routed_scaling_factor,
    sliding_window=window,
    layer_types=types,
    mlp_layer_types=["sparse" if m else "dense" for m in c.layer_is_moe],
    rope_parameters={FULL: rope(c.rope_theta), SLIDING: rope(sliding_theta)},
    # The hub's keys for what transformers fixes by rule.
    swa_num_key_value_heads=c.sliding_num_kv_heads or c.num_kv_heads,
    swa_rope_theta=sliding_theta,
    add_swa_attention_sink_bias=c.attention_sinks or c.sliding_attention_sinks,
    add_full_attention_sink_bias=c.attention_sinks,
    scoring_func="sigmoid",
    topk_method="noaux_tc",
  )


MIMO_V2_FLASH = Architecture(
  name="MiMoV2FlashForCausalLM",
  model_type="mimo_v2_flash",
  read=_read,
  write=_write,
  family=Family(windowed=True, float_router=True, mtp_sliding=True),
  sliding=True,
  rope_theta=DEFAULT_THETA[FULL],
  rotary_fraction=DEFAULT_PARTIAL,
  prepare=_prepare,
  tensors=TensorLayout(
    sink="attention_sink_bias",
    mtp_prefix="model.mtp.layers.{k}.",
    mtp_names=("enorm", "hnorm", "eh_proj", "final_layernorm"),
    # the MTP block names the MLP's norm for what it precedes
    mtp_renames=(("post_attention_layernorm.weight", "pre_mlp_layernorm.weight"),),
    unbuilt_mtp="model.mtp.",
    mtp_embed="",  # the MTP layers read the main embedding and head
    mtp_head="",
  ),
)
