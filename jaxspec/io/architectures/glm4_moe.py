"""GLM-4 MoE: dense layers first, then MoE layers with grouped sigmoid routing, shared experts
and DeepSeek-style MTP layers (`num_nextn_predict_layers`); half-head RoPE by default."""

from __future__ import annotations

from typing import Any

from jaxspec.config import ModelConfig
from jaxspec.errors import ConfigError
from jaxspec.io.architectures.base import Architecture
from jaxspec.io.architectures.reader import HFConfigReader


def read_deepseek_moe(r: HFConfigReader, kw: dict[str, Any]) -> dict[str, Any]:
  """The DeepSeek-style MoE fields GLM-4 MoE shares with DeepSeek-V3 / GLM-5: grouped sigmoid
  routing, shared experts, `first_k_dense_replace` leading dense layers."""
  first_dense = r.integer("first_k_dense_replace", 1)
  if first_dense < 0:
    raise r.error(f"first_k_dense_replace must be ≥ 0, got {first_dense}")
  return dict(
    num_experts=r.first_integer(("n_routed_experts", "num_local_experts"), 0),
    num_experts_per_tok=r.integer("num_experts_per_tok", 0),
    moe_intermediate_size=r.integer("moe_intermediate_size", 0),
    router="sigmoid",
    norm_topk_prob=r.flag("norm_topk_prob", True),
    n_group=r.integer("n_group", 1),
    topk_group=r.integer("topk_group", 1),
    routed_scaling_factor=r.number("routed_scaling_factor", 1.0),
    n_shared_experts=r.integer("n_shared_experts", 0),
    layer_is_moe=tuple(i >= first_dense for i in range(kw["num_layers"])),
  )


def _read(r: HFConfigReader, kw: dict[str, Any]) -> dict[str, Any]:
  return dict(read_deepseek_moe(r, kw), qk_norm=r.flag("use_qk_norm", False))


def write_deepseek_moe(c: ModelConfig) -> dict[str, Any]:
  """The config.json keys of `read_deepseek_moe` (and the MTP layer count, written even when 0)."""
  first_dense = c.layer_is_moe.index(True) if any(c.layer_is_moe) else c.num_layers
  if c.layer_is_moe != tuple(i >= first_dense for i in range(c.num_layers)):
    raise ConfigError(f"{c.architecture} layout needs dense layers first, then MoE layers")
  return dict(
    n_routed_experts=c.num_experts,
    num_experts_per_tok=c.num_experts_per_tok,
    moe_intermediate_size=c.moe_intermediate_size,
    norm_topk_prob=c.norm_topk_prob,
    n_group=c.n_group,
    topk_group=c.topk_group,
    routed_scaling_factor=c.routed_scaling_factor,
    n_shared_experts=c.n_shared_experts,
    first_k_dense_replace=first_dense,
    num_nextn_predict_layers=c.num_mtp_layers,  # written even when 0
  )


def _write(c: ModelConfig) -> dict[str, Any]:
  return dict(write_deepseek_moe(c), use_qk_norm=c.qk_norm)


GLM4_MOE = Architecture(name="Glm4MoeForCausalLM", model_type="glm4_moe", read=_read, write=_write)
