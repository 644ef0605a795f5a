"""Gemma 4's text model (`Gemma4ForCausalLM`, model_type gemma4_text; the text part of
`Gemma4ForConditionalGeneration`).

Sliding-window and full-attention layers (`layer_types`, window `sliding_window`: keys p seen by
query q iff p > q − W), each type with its own RoPE (`rope_parameters` nested per type: the
sliding layers' default RoPE, the full layers' "proportional" one); full layers with their own
head width and KV heads (`global_head_dim`, `num_global_key_value_heads` as the hub writes them,
or transformers' `per_layer_config` overrides); values equal to the keys' projection in full
layers (`attention_k_eq_v`); the last `num_kv_shared_layers` layers reading the K/V of the last
earlier layer of their type; per-layer input embeddings (`hidden_size_per_layer_input`,
`vocab_size_per_layer_input`); tanh soft-capping of the logits; MLPs twice as wide in KV-shared
layers (`use_double_wide_mlp`); GELU-tanh (`hidden_activation`); tied embeddings; the MoE block
beside every layer's MLP (`enable_moe_block`: `num_experts`, `top_k_experts`,
`moe_intermediate_size`; experts stored fused as `experts.gate_up_proj` [E, 2I, H]).

`use_bidirectional_attention: "vision"` (what every published Gemma 4 config states) is read as
causal text decoding: it makes image tokens attend to each other both ways, and jaxspec builds
no vision tower, so text tokens stay causal, as in transformers on text-only input.

Refused by name: bidirectional attention over all tokens ("all"), other RoPE types, per-layer
overrides other than the full layers' head width and KV heads.
"""

from __future__ import annotations

from typing import Any, Mapping

from jaxspec.config import ModelConfig
from jaxspec.errors import show
from jaxspec.family import Family
from jaxspec.io.architectures.base import Architecture
from jaxspec.io.architectures.reader import FULL, SLIDING, HFConfigReader
from jaxspec.io.architectures.tensors import TensorLayout, norm_entries

# transformers' defaults (Gemma4TextConfig).
DEFAULT_THETA = {SLIDING: 10_000.0, FULL: 1_000_000.0}
DEFAULT_FULL_PARTIAL = 0.25
DEFAULT_GLOBAL_HEAD_DIM = 512
DEFAULT_WINDOW = 512
MULTIMODAL_TEXT = {"Gemma4ForConditionalGeneration": "Gemma4ForCausalLM"}
FAMILY = Family(
  windowed=True,
  fused_gate_up="gate_then_up",
  sandwich_norms=True,
  layer_scalar=True,
  moe_beside_mlp=True,
  embedding_scale=True,
  value_norm=True,
  unit_attention_scale=True,
  per_type_rope=True,
  global_attention=True,
  kv_sharing=True,
  per_layer_inputs=True,
  logit_softcapping=True,
  rope_types=("proportional",),
)


def _default_types(n: int) -> list[str]:
  """transformers' pattern: five sliding layers, then a full one; the last layer is full."""
  types = [SLIDING if (i + 1) % 6 else FULL for i in range(n)]
  return types[:-1] + [FULL] if types else types


def _prepare(hf: Mapping[str, Any]) -> dict[str, Any]:
  """The config with the per-type RoPE folded into the flat keys the shared reader reads (the
  full layers' base); the rest of both types' RoPE and the activation are kept under `_` keys
  for `_read`."""
  r = HFConfigReader(hf, "Gemma4ForCausalLM")
  out = dict(hf)
  nested = r.rope_per_layer_type()
  if r.mapping("rope_scaling"):
    raise r.error("rope_scaling is not supported (Gemma 4 states RoPE in rope_parameters)")
  defaults = {
    SLIDING: {"rope_type": "default", "rope_theta": DEFAULT_THETA[SLIDING]},
    FULL: {
      "rope_type": "proportional",
      "rope_theta": DEFAULT_THETA[FULL],
      "partial_rotary_factor": DEFAULT_FULL_PARTIAL,
    },
  }
  rope = {kind: dict(nested.get(kind, defaults[kind])) for kind in (SLIDING, FULL)}
  for kind, d in rope.items():
    d.setdefault("rope_theta", DEFAULT_THETA[kind])
    d.setdefault("rope_type", "default")
  if r.has("rope_theta") and r.number("rope_theta") != float(rope[FULL]["rope_theta"]):
    raise r.error("rope_theta and rope_parameters.full_attention.rope_theta disagree")
  out.pop("rope_parameters", None)
  out.pop("partial_rotary_factor", None)
  out["rope_theta"] = float(rope[FULL]["rope_theta"])
  out["_rope"] = rope
  act = hf.get("hidden_activation", hf.get("hidden_act", "gelu_pytorch_tanh"))
  if "hidden_act" in hf and hf.get("hidden_activation") not in (None, hf["hidden_act"]):
    raise r.error("hidden_act and hidden_activation disagree")
  out.pop("hidden_act", None)  # (the shared reader knows only silu)
  out["_hidden_act"] = act
  return out


def _rope_scaling(r: HFConfigReader, full: Mapping[str, Any]) -> tuple:
  """The full layers' RoPE as ModelConfig.rope_scaling: () for the default RoPE, else the
  normalized proportional settings."""
  rope_type = full.get("rope_type") or full.get("type") or "default"
  partial = full.get("partial_rotary_factor", 1.0)
  factor = full.get("factor", 1.0)
  if rope_type == "default":
    if partial != 1.0 or factor != 1.0:
      raise r.error("the full layers' default RoPE must turn whole heads unscaled")
    return ()
  if rope_type != "proportional":
    raise r.error(
      f"RoPE type {show(rope_type)} in rope_parameters.full_attention is not supported "
      "('default', 'proportional')"
    )
  if not (0 < float(partial) <= 1 and float(factor) > 0):
    raise r.error("proportional RoPE needs partial_rotary_factor in (0, 1] and factor > 0")
  settings = {"rope_type": "proportional", "partial_rotary_factor": float(partial)}
  if factor != 1.0:
    settings["factor"] = float(factor)
  return tuple(sorted(settings.items()))


def _global_shape(r: HFConfigReader, types: list[str], kv_heads: int, k_eq_v: bool):
  """(global_head_dim, global_num_kv_heads) from the hub's keys or transformers'
  `per_layer_config` overrides, which must name the full layers only and agree."""
  head_dim = r.integer("global_head_dim", None)
  stated_kv = r.integer("num_global_key_value_heads", None)
  kv = stated_kv if k_eq_v else None  # transformers applies it only where k_eq_v
  overrides = r.hf.get("per_layer_config") or {}
  if not isinstance(overrides, Mapping):
    raise r.error(f"per_layer_config must be an object, got {show(overrides)}")
  full = {i for i, t in enumerate(types) if t == FULL}
  seen_dims, seen_kv = set(), set()
  for key, entry in overrides.items():
    if not (isinstance(entry, Mapping) and str(key).isdigit() and int(key) in full):
      raise r.error(
        f"per_layer_config[{key!r}]: only full-attention layers' overrides are supported"
      )
    unknown = sorted(set(entry) - {"head_dim", "num_key_value_heads"})
    if unknown:
      raise r.error(f"per_layer_config[{key!r}] overrides {unknown}: not supported")
    seen_dims.add(entry.get("head_dim", r.hf.get("head_dim")))
    seen_kv.add(entry.get("num_key_value_heads", kv_heads))
  if overrides:
    if len(seen_dims) > 1 or len(seen_kv) > 1 or len(overrides) != len(full):
      raise r.error("per_layer_config must give every full-attention layer the same shape")
    dim, heads = seen_dims.pop(), seen_kv.pop()
    if head_dim is not None and head_dim != dim:
      raise r.error("global_head_dim and per_layer_config disagree")
    if kv is not None and kv != heads:
      raise r.error("num_global_key_value_heads and per_layer_config disagree")
    head_dim, kv = dim, heads
  head_dim = DEFAULT_GLOBAL_HEAD_DIM if head_dim is None else head_dim
  return head_dim, (kv if kv is not None and kv != kv_heads else 0)


def _read(r: HFConfigReader, kw: dict[str, Any]) -> dict[str, Any]:
  n = kw["num_layers"]
  types = list(r.strings("layer_types", _default_types(n)))
  bad = sorted(set(types) - {SLIDING, FULL})
  if bad or len(types) != n:
    raise r.error(
      f"layer_types must name {SLIDING!r} or {FULL!r} for each of the {n} layers, got {show(types)}"
    )
  if r.hf.get("use_bidirectional_attention") not in (None, "vision"):
    raise r.error(
      f"use_bidirectional_attention={show(r.hf['use_bidirectional_attention'])} is not "
      'supported (causal text decoding only; "vision" is read as causal text)'
    )
  moe = r.flag("enable_moe_block", False)
  experts = dict(num_experts=0, num_experts_per_tok=0, moe_intermediate_size=0)
  if moe:
    experts = dict(
      num_experts=r.integer("num_experts"),
      num_experts_per_tok=r.integer("top_k_experts"),
      moe_intermediate_size=r.integer("moe_intermediate_size"),
      router="gemma4",
      norm_topk_prob=True,
      layer_is_moe=(True,) * n,
    )
  act = r.hf["_hidden_act"]
  if act not in ("gelu_pytorch_tanh", "silu"):
    raise r.error(f"hidden_activation {show(act)} is not supported ('gelu_pytorch_tanh')")
  window = r.integer("sliding_window", DEFAULT_WINDOW)
  if SLIDING in types and window < 1:
    raise r.error(f"sliding_window must be ≥ 1, got {window}")
  rope = r.hf["_rope"]
  sliding_type = rope[SLIDING].get("rope_type") or "default"
  if sliding_type != "default" or rope[SLIDING].get("partial_rotary_factor", 1.0) != 1.0:
    raise r.error("the sliding layers' RoPE must be the default one over whole heads")
  k_eq_v = r.flag("attention_k_eq_v", False)
  global_dim, global_kv = _global_shape(r, types, kw["num_kv_heads"], k_eq_v)
  cap = r.hf.get("final_logit_softcapping")
  per_layer = r.integer("hidden_size_per_layer_input", 256)
  return dict(
    qk_norm=True,
    hidden_act=act,
    tie_word_embeddings=r.flag("tie_word_embeddings", True),
    layer_windows=tuple(window if t == SLIDING else 0 for t in types),
    sliding_rope_theta=float(rope[SLIDING]["rope_theta"]),
    rope_scaling=_rope_scaling(r, rope[FULL]),
    global_head_dim=global_dim if global_dim != kw["head_dim"] else 0,
    global_num_kv_heads=global_kv,
    attention_k_eq_v=k_eq_v,
    num_kv_shared_layers=r.integer("num_kv_shared_layers", 0),
    hidden_size_per_layer_input=per_layer,
    vocab_size_per_layer_input=r.integer("vocab_size_per_layer_input", kw["vocab_size"])
    if per_layer
    else 0,
    final_logit_softcapping=0.0 if cap is None else r.number("final_logit_softcapping"),
    use_double_wide_mlp=r.flag("use_double_wide_mlp", False),
    **experts,
  )


def _write(c: ModelConfig) -> dict[str, Any]:
  windows = {w for w in c.layer_windows if w}
  window = windows.pop() if windows else DEFAULT_WINDOW
  types = [SLIDING if w else FULL for w in c.layer_windows]
  full = {"rope_type": "default", "rope_theta": c.rope_theta}
  if c.rope_scaling:
    full = {**dict(c.rope_scaling), "rope_theta": c.rope_theta}
  global_dim = c.attention_head_dim(False)
  overrides = {"head_dim": global_dim}
  if c.global_num_kv_heads:
    overrides["num_key_value_heads"] = c.global_num_kv_heads
  return dict(
    hidden_act=c.hidden_act,
    hidden_activation=c.hidden_act,
    sliding_window=window,
    layer_types=types,
    rope_parameters={
      SLIDING: {"rope_type": "default", "rope_theta": c.sliding_rope_theta or c.rope_theta},
      FULL: full,
    },
    partial_rotary_factor=None,
    global_head_dim=global_dim,
    num_global_key_value_heads=c.global_num_kv_heads or c.num_kv_heads,
    per_layer_config={str(i): overrides for i, t in enumerate(types) if t == FULL},
    attention_k_eq_v=c.attention_k_eq_v,
    num_kv_shared_layers=c.num_kv_shared_layers,
    hidden_size_per_layer_input=c.hidden_size_per_layer_input,
    vocab_size_per_layer_input=c.vocab_size_per_layer_input,
    final_logit_softcapping=c.final_logit_softcapping or None,
    use_double_wide_mlp=c.use_double_wide_mlp,
    enable_moe_block=c.is_moe,
    num_experts=c.num_experts or None,
    top_k_experts=c.num_experts_per_tok or None,
    moe_intermediate_size=c.moe_intermediate_size or None,
  )


GEMMA4 = Architecture(
  name="Gemma4ForCausalLM",
  model_type="gemma4_text",
  read=_read,
  write=_write,
  family=FAMILY,
  sliding=True,
  rope_theta=DEFAULT_THETA[FULL],
  rotary_fraction=None,
  head_dim=256,
  prepare=_prepare,
  tensors=TensorLayout(
    # sandwich norms around the MLP and the layer's output scalar
    layer_extras=(
      *norm_entries("pre_feedforward_layernorm", "post_feedforward_layernorm"),
      ("layer_scalar", ("layer_scalar",), "same"),
    ),
    # the MoE block beside the dense MLP: router, stacked experts and their norms
    moe_beside_mlp=(
      ("router.proj.weight", ("moe", "router"), "linear"),
      ("router.scale", ("moe", "router_scale"), "same"),
      ("router.per_expert_scale", ("moe", "per_expert_scale"), "same"),
      ("experts.gate_up_proj", ("moe", "gate_up_proj"), "experts_linear"),
      ("experts.down_proj", ("moe", "down_proj"), "experts_linear"),
      *norm_entries(
        "pre_feedforward_layernorm_2",
        "post_feedforward_layernorm_1",
        "post_feedforward_layernorm_2",
      ),
    ),
  ),
)
