"""A model family as data: the mechanisms an architecture brings, and the registry of them.

Model code, validation, the planner and quantization branch on these feature fields, never on
an architecture's name, so that a family whose mechanisms all exist (a dense Llama, Mistral or
Qwen2) is its config.json mapping in jaxspec.io.architectures and a `Family()` with every field
at its default. Each architecture registers its family when jaxspec.io.architectures is
imported (always, by `import jaxspec`); this bottom layer holds the registry so that
`ModelConfig` can read it without importing the io layer.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from jaxspec.errors import ConfigError

# Gated DeltaNet projection layouts: Qwen3-Next's two fused projections (in_proj_qkvz and
# in_proj_ba, grouped per key head) or Qwen3.5's four plain ones (in_proj_qkv, _z, _b, _a).
LINEAR_PROJECTIONS = ("", "fused", "split")
# How the experts' layers are placed when a config is re-derived at another depth: dense
# layers first, then MoE (`first_k_dense_replace`), or MoE at every `decoder_sparse_step`-th
# layer except the dense `mlp_only_layers` there (Qwen3-MoE, Qwen3-Next).
MOE_RULES = ("first_k_dense", "sparse_step")
# Experts stored with gate and up fused in one [E, H, 2I] weight: interleaved feature by feature
# (gpt-oss, with the clamped SwiGLU) or gate then up (Gemma 4, with GELU-tanh).
FUSED_GATE_UP = ("", "interleaved", "gate_then_up")


@dataclasses.dataclass(frozen=True)
class Family:
  """The mechanisms of one architecture family; the defaults are a plain pre-norm decoder
  (full attention, SwiGLU or softmax-routed experts, RMSNorm with scale w).

  Attributes:
    hybrid: Qwen3-Next / Qwen3.5: zero-centred RMSNorms ((1 + w) · x), an output gate on full
      attention, Gated DeltaNet layers and a sigmoid-gated shared expert allowed; MTP layers
      read the final-normed state.
    linear_projections: the Gated DeltaNet projection layout (LINEAR_PROJECTIONS; "" without
      linear layers).
    mla: Multi-head Latent Attention (kv_lora_rank > 0 required, models/mla.py).
    dsa: DeepSeek Sparse Attention's lightning indexer on top of MLA (index_n_heads > 0).
    windowed: sliding-window layers and attention sinks allowed, with the sliding layers' own
      KV heads and RoPE base.
    moe_rule: where the routed experts are when the depth changes (MOE_RULES);
      `decoder_sparse_step` > 1 only under "sparse_step".
    fused_gate_up: the experts' fused gate/up layout and activation (FUSED_GATE_UP).
    biased_experts: gpt-oss's biased expert projections, clamped SwiGLU and top-k-then-softmax
      router allowed.
    float_router: published checkpoints keep the router in float, so the default quantization
      policy leaves it so.
    mtp_sliding: MTP blocks use the sliding layers' attention and a dense MLP (MiMo-V2-Flash).
    sandwich_norms: each sublayer's output normed too (Gemma 3, Gemma 4).
    layer_scalar: the layer's output scaled by a learned scalar (Gemma 4).
    centred_norms: every RMSNorm (q/k norms included) stores w and scales by 1 + w, without
      hybrid's other mechanisms (Gemma 3).
    moe_beside_mlp: the MoE block runs beside every layer's dense MLP, routed by the "gemma4"
      router on the residual, in every layer or in none (Gemma 4).
    embedding_scale: token embeddings scaled by sqrt(hidden_size) as they enter the model.
    value_norm: values RMS-normed without a scale before they are stored.
    unit_attention_scale: the q/k norms set the softmax scale (1, not head_dim^-0.5).
    query_scalar: the softmax scale is query_pre_attn_scalar^-0.5, a config value (Gemma 3).
    per_type_rope: sliding layers turn whole heads with their own base and no scaling; full
      layers are turned over their own head width by `rope_scaling`.
    global_attention: full layers with their own head width and KV heads, values equal to keys.
    kv_sharing: the last layers read an earlier layer's K/V; their MLPs may be twice as wide.
    per_layer_inputs: per-layer input embeddings added through a gated projection.
    logit_softcapping: tanh soft-capping of the logits.
    rope_types: RoPE types this family accepts beyond the common ones ("proportional").
    gguf_exportable: llama.cpp's qwen3 graph computes this family (io/gguf_export.py).
    hf_mxfp4: quantized checkpoints use transformers' MXFP4 expert layout (io/quantized.py).
  """

  hybrid: bool = False
  linear_projections: str = ""
  mla: bool = False
  dsa: bool = False
  windowed: bool = False
  moe_rule: str = "first_k_dense"
  fused_gate_up: str = ""
  biased_experts: bool = False
  float_router: bool = False
  mtp_sliding: bool = False
  sandwich_norms: bool = False
  layer_scalar: bool = False
  centred_norms: bool = False
  moe_beside_mlp: bool = False
  embedding_scale: bool = False
  value_norm: bool = False
  unit_attention_scale: bool = False
  query_scalar: bool = False
  per_type_rope: bool = False
  global_attention: bool = False
  kv_sharing: bool = False
  per_layer_inputs: bool = False
  logit_softcapping: bool = False
  rope_types: tuple[str, ...] = ()
  gguf_exportable: bool = False
  hf_mxfp4: bool = False

  def __post_init__(self):
    for name, allowed in (
      ("linear_projections", LINEAR_PROJECTIONS),
      ("moe_rule", MOE_RULES),
      ("fused_gate_up", FUSED_GATE_UP),
    ):
      if getattr(self, name) not in allowed:
        raise ConfigError(f"Family.{name} must be one of {allowed}, got {getattr(self, name)!r}")
    if self.dsa and not self.mla:
      raise ConfigError("Family.dsa is an indexer on MLA: it needs mla=True")
    if bool(self.linear_projections) != self.hybrid:
      raise ConfigError("Family.linear_projections goes with hybrid=True, and only with it")


_FAMILIES: dict[str, Family] = {}


def register(name: str, family: Family) -> None:
  """Records `family` as architecture `name`'s (again for the same family is a no-op)."""
  if not isinstance(family, Family):
    raise ConfigError(f"{name}: a family must be a jaxspec.family.Family, got {family!r}")
  if _FAMILIES.get(name, family) != family:
    raise ConfigError(f"{name} is already registered with another family")
  _FAMILIES[name] = family


def supported_architectures() -> tuple[str, ...]:
  """The architectures jaxspec builds, in registration order."""
  return tuple(_FAMILIES)


def family_of(name: str) -> Family:
  """The family of architecture `name`; ConfigError naming the supported ones otherwise."""
  family = _FAMILIES.get(name)
  if family is None:
    raise ConfigError(
      f"{name}: unsupported architecture; jaxspec supports {', '.join(_FAMILIES)}"
    )
  return family


def architectures_with(feature: Callable[[Family], Any]) -> tuple[str, ...]:
  """The registered architectures whose family has `feature` (for messages and tables)."""
  return tuple(name for name, family in _FAMILIES.items() if feature(family))
