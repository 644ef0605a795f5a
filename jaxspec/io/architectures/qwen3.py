"""Qwen3 (dense) and Qwen3-MoE: q/k norms, whole-head RoPE, softmax routing.

Qwen3-MoE places experts at every `decoder_sparse_step`-th layer except the dense ones listed in
`mlp_only_layers`; `layer_is_moe` folds both (ModelConfig keeps the rule for `replace`).
"""

from __future__ import annotations

from typing import Any

from jaxspec.config import ModelConfig
from jaxspec.family import Family
from jaxspec.io.architectures.base import Architecture
from jaxspec.io.architectures.reader import HFConfigReader


def _read_dense(r: HFConfigReader, kw: dict[str, Any]) -> dict[str, Any]:
  del r
  return dict(attention_out_bias=kw["attention_bias"], qk_norm=True)


def _read_moe(r: HFConfigReader, kw: dict[str, Any]) -> dict[str, Any]:
  experts = r.first_integer(("num_experts", "num_local_experts"), 0)
  sparse_step = r.integer("decoder_sparse_step", 1)
  if experts > 0 and sparse_step < 1:
    raise r.error(f"decoder_sparse_step must be positive, got {sparse_step}")
  mlp_only = set(r.integers("mlp_only_layers", ()))
  return dict(
    _read_dense(r, kw),
    num_experts=experts,
    num_experts_per_tok=r.integer("num_experts_per_tok", 0),
    moe_intermediate_size=r.integer("moe_intermediate_size", 0),
    router="softmax",
    norm_topk_prob=r.flag("norm_topk_prob", False),
    decoder_sparse_step=sparse_step if experts > 0 else 1,
    layer_is_moe=tuple(
      (i not in mlp_only) and experts > 0 and (i + 1) % sparse_step == 0
      for i in range(kw["num_layers"])
    ),
  )


def mlp_only_layers(config: ModelConfig) -> list[int]:
  """The dense layers at positions the sparse step gives experts (HF's `mlp_only_layers`)."""
  step = config.decoder_sparse_step
  return [i for i, m in enumerate(config.layer_is_moe) if not m and (i + 1) % step == 0]


def _write_moe(c: ModelConfig) -> dict[str, Any]:
  return dict(
    num_experts=c.num_experts,
    num_experts_per_tok=c.num_experts_per_tok,
    moe_intermediate_size=c.moe_intermediate_size,
    norm_topk_prob=c.norm_topk_prob,
    decoder_sparse_step=c.decoder_sparse_step,
    mlp_only_layers=mlp_only_layers(c),
  )


QWEN3 = Architecture(
  name="Qwen3ForCausalLM",
  model_type="qwen3",
  read=_read_dense,
  write=lambda c: {},
  family=Family(gguf_exportable=True),
  rotary_fraction=None,
)
QWEN3_MOE = Architecture(
  name="Qwen3MoeForCausalLM",
  model_type="qwen3_moe",
  read=_read_moe,
  write=_write_moe,
  family=Family(moe_rule="sparse_step"),
  rotary_fraction=None,
)
