"""Qwen3-Next, Qwen3.5 and Qwen3.5-MoE: hybrid targets of Gated DeltaNet (linear-attention)
layers beside gated full-attention layers, zero-centred norms, a sigmoid-gated shared expert
(the MoE ones) and one MTP module (`mtp_num_hidden_layers`).

Published Qwen3.5 checkpoints are vision-language models: their text model is read from the
nested `text_config` (`MULTIMODAL_TEXT`, applied by `text_config` in `__init__.py`).
"""

from __future__ import annotations

from typing import Any

from jaxspec.config import ModelConfig
from jaxspec.config_checks import LAYER_TYPES
from jaxspec.errors import show
from jaxspec.family import Family
from jaxspec.io.architectures.base import Architecture
from jaxspec.io.architectures.qwen3 import mlp_only_layers
from jaxspec.io.architectures.reader import HFConfigReader
from jaxspec.io.architectures.tensors import TensorLayout

# A multimodal checkpoint's architecture -> its text model's.
MULTIMODAL_TEXT = {
  "Qwen3_5ForConditionalGeneration": "Qwen3_5ForCausalLM",
  "Qwen3_5MoeForConditionalGeneration": "Qwen3_5MoeForCausalLM",
}


def _layer_types(r: HFConfigReader, num_layers: int) -> tuple[str, ...]:
  """`layer_types`, or full attention every `full_attention_interval`-th layer."""
  types = r.strings("layer_types", None)
  if types is None:
    interval = r.integer("full_attention_interval", 4)
    if interval < 1:
      raise r.error(f"full_attention_interval must be positive, got {interval}")
    types = tuple(
      "full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(num_layers)
    )
  if len(types) != num_layers or set(types) - set(LAYER_TYPES):
    raise r.error(
      f"layer_types must name 'linear_attention' or 'full_attention' for each of the "
      f"{num_layers} layers, got {show(list(types))}"
    )
  return tuple(types)


def _read_dense(r: HFConfigReader, kw: dict[str, Any]) -> dict[str, Any]:
  """Qwen3.5's fields (transformers' defaults when absent); the MoE variants add experts."""
  out: dict[str, Any] = dict(
    attention_out_bias=kw["attention_bias"],
    qk_norm=True,
    layer_types=_layer_types(r, kw["num_layers"]),
    linear_conv_kernel_dim=r.integer("linear_conv_kernel_dim", 4),
    linear_key_head_dim=r.integer("linear_key_head_dim", 128),
    linear_value_head_dim=r.integer("linear_value_head_dim", 128),
    linear_num_key_heads=r.integer("linear_num_key_heads", 16),
    linear_num_value_heads=r.integer("linear_num_value_heads", 32),
  )
  # The checkpoints store one MTP module (`mtp.*`) of `mtp_num_hidden_layers` decoder layers,
  # applied once per draft: jaxspec builds it as one MTP layer.
  mtp = r.integer("mtp_num_hidden_layers", 0)
  if mtp not in (0, 1):
    raise r.error(f"mtp_num_hidden_layers={mtp}: an MTP module of several layers is not supported")
  if mtp and r.flag("mtp_use_dedicated_embeddings", False):
    raise r.error(
      "mtp_use_dedicated_embeddings: an MTP module with its own embedding is not supported"
    )
  out["num_mtp_layers"] = mtp
  return out


def _read_moe(r: HFConfigReader, kw: dict[str, Any], every_layer: bool) -> dict[str, Any]:
  """Qwen3-Next (`every_layer` False: a sparse step and dense `mlp_only_layers` allowed) or
  Qwen3.5-MoE (`every_layer`: experts in every layer)."""
  out = _read_dense(r, kw)
  experts = r.integer("num_experts", 512)
  if every_layer and experts < 1:
    raise r.error(f"num_experts must be positive, got {experts}")
  step = 1 if every_layer else r.integer("decoder_sparse_step", 1)
  if experts > 0 and step < 1:
    raise r.error(f"decoder_sparse_step must be positive, got {step}")
  mlp_only = set() if every_layer else set(r.integers("mlp_only_layers", ()))
  out.update(
    num_experts=experts,
    num_experts_per_tok=r.integer("num_experts_per_tok", 8 if every_layer else 10),
    moe_intermediate_size=r.integer("moe_intermediate_size", 512),
    shared_expert_intermediate_size=r.integer("shared_expert_intermediate_size", 512)
    if experts > 0
    else 0,
    router="softmax",
    norm_topk_prob=True if every_layer else r.flag("norm_topk_prob", True),
    decoder_sparse_step=step if experts > 0 else 1,
    layer_is_moe=tuple(
      (i not in mlp_only) and experts > 0 and (i + 1) % step == 0 for i in range(kw["num_layers"])
    ),
  )
  return out


def _write_dense(c: ModelConfig) -> dict[str, Any]:
  hf: dict[str, Any] = dict(
    layer_types=list(c.layer_types),
    linear_conv_kernel_dim=c.linear_conv_kernel_dim,
    linear_key_head_dim=c.linear_key_head_dim,
    linear_value_head_dim=c.linear_value_head_dim,
    linear_num_key_heads=c.linear_num_key_heads,
    linear_num_value_heads=c.linear_num_value_heads,
  )
  return hf


def _write_moe(c: ModelConfig, every_layer: bool) -> dict[str, Any]:
  hf = _write_dense(c)
  hf.update(
    num_experts=c.num_experts,
    num_experts_per_tok=c.num_experts_per_tok,
    moe_intermediate_size=c.moe_intermediate_size,
    shared_expert_intermediate_size=c.shared_expert_intermediate_size,
  )
  if not every_layer:
    hf.update(
      norm_topk_prob=c.norm_topk_prob,
      decoder_sparse_step=c.decoder_sparse_step,
      mlp_only_layers=mlp_only_layers(c),
    )
  return hf


# Checkpoint names: one `mtp.` module, {pre_fc_norm_*, fc, norm, layers.0.*}, that transformers
# builds only when asked (Qwen3-Next fuses the Gated DeltaNet input projections).
_MTP_MODULE = dict(
  mtp_prefix="mtp.",
  mtp_names=("pre_fc_norm_embedding", "pre_fc_norm_hidden", "fc", "norm"),
  mtp_block="layers.0.",
  unbuilt_mtp="mtp.",
  mtp_embed="",  # the module reads the main embedding and head
  mtp_head="",
)
# Transformers' defaults: a quarter of each head rotated, only the default RoPE, 256-wide heads.
_HYBRID = dict(
  sliding=True,
  rotary_fraction=0.25,
  rope_types=("default",),
  head_dim=256,
  mtp_key="mtp_num_hidden_layers",
)
QWEN3_NEXT = Architecture(
  name="Qwen3NextForCausalLM",
  model_type="qwen3_next",
  read=lambda r, kw: _read_moe(r, kw, every_layer=False),
  write=lambda c: _write_moe(c, every_layer=False),
  family=Family(hybrid=True, linear_projections="fused", moe_rule="sparse_step"),
  **_HYBRID,
  tensors=TensorLayout(**_MTP_MODULE, linear_attention=("in_proj_qkvz", "in_proj_ba")),
)
QWEN3_5 = Architecture(
  name="Qwen3_5ForCausalLM",
  model_type="qwen3_5_text",
  read=_read_dense,
  write=_write_dense,
  family=Family(hybrid=True, linear_projections="split"),
  **_HYBRID,
  tensors=TensorLayout(**_MTP_MODULE),
)
QWEN3_5_MOE = Architecture(
  name="Qwen3_5MoeForCausalLM",
  model_type="qwen3_5_moe_text",
  read=lambda r, kw: _read_moe(r, kw, every_layer=True),
  write=lambda c: _write_moe(c, every_layer=True),
  family=Family(hybrid=True, linear_projections="split"),
  dense_width=False,  # every layer is MoE: no dense width
  **_HYBRID,
  tensors=TensorLayout(**_MTP_MODULE),
)
