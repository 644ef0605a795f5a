"""Small random configurations of the supported HF architectures, built with transformers.

Shared by the parity, checkpoint and sharding tests. Weights are perturbed away from HF's
initialisation (norm weights ≠ 1, correction biases ≠ 0) so that a swapped or ignored tensor
changes the logits.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import torch
import transformers

# name → (config class name, model class name, kwargs)
CONFIGS = {
  "qwen3_gqa_bias_headdim": (
    "Qwen3Config",
    "Qwen3ForCausalLM",
    dict(
      vocab_size=97,
      hidden_size=32,
      intermediate_size=64,
      num_hidden_layers=2,
      num_attention_heads=4,
      num_key_value_heads=2,
      head_dim=16,
      attention_bias=True,
      tie_word_embeddings=False,
      rope_theta=10000.0,
    ),
  ),
  "qwen3_mha_tied": (
    "Qwen3Config",
    "Qwen3ForCausalLM",
    dict(
      vocab_size=64,
      hidden_size=48,
      intermediate_size=96,
      num_hidden_layers=3,
      num_attention_heads=4,
      num_key_value_heads=4,
      head_dim=12,
      attention_bias=False,
      tie_word_embeddings=True,
      rope_theta=1e6,
    ),
  ),
  "qwen3moe_norm_mlponly": (
    "Qwen3MoeConfig",
    "Qwen3MoeForCausalLM",
    dict(
      vocab_size=80,
      hidden_size=32,
      intermediate_size=64,
      moe_intermediate_size=24,
      num_hidden_layers=3,
      num_attention_heads=4,
      num_key_value_heads=1,
      head_dim=8,
      num_experts=6,
      num_experts_per_tok=2,
      norm_topk_prob=True,
      mlp_only_layers=[0],
      decoder_sparse_step=1,
      tie_word_embeddings=False,
    ),
  ),
  "qwen3moe_nonorm_step2_tied": (
    "Qwen3MoeConfig",
    "Qwen3MoeForCausalLM",
    dict(
      vocab_size=72,
      hidden_size=32,
      intermediate_size=48,
      moe_intermediate_size=16,
      num_hidden_layers=4,
      num_attention_heads=2,
      num_key_value_heads=2,
      head_dim=16,
      num_experts=4,
      num_experts_per_tok=3,
      norm_topk_prob=False,
      decoder_sparse_step=2,
      mlp_only_layers=[],
      tie_word_embeddings=True,
      attention_bias=True,
    ),
  ),
  "glm4moe_grouped_shared_partial": (
    "Glm4MoeConfig",
    "Glm4MoeForCausalLM",
    dict(
      vocab_size=90,
      hidden_size=32,
      intermediate_size=64,
      moe_intermediate_size=16,
      num_hidden_layers=3,
      num_attention_heads=4,
      num_key_value_heads=2,
      head_dim=16,
      n_routed_experts=8,
      num_experts_per_tok=2,
      n_group=4,
      topk_group=2,
      n_shared_experts=1,
      first_k_dense_replace=1,
      routed_scaling_factor=2.5,
      norm_topk_prob=True,
      use_qk_norm=True,
      attention_bias=True,
      partial_rotary_factor=0.5,
      tie_word_embeddings=False,
      num_nextn_predict_layers=0,
    ),
  ),
  "glm4moe_flat_nonorm_tied": (
    "Glm4MoeConfig",
    "Glm4MoeForCausalLM",
    dict(
      vocab_size=64,
      hidden_size=24,
      intermediate_size=40,
      moe_intermediate_size=12,
      num_hidden_layers=2,
      num_attention_heads=3,
      num_key_value_heads=1,
      head_dim=8,
      n_routed_experts=4,
      num_experts_per_tok=2,
      n_group=1,
      topk_group=1,
      n_shared_experts=2,
      first_k_dense_replace=1,
      routed_scaling_factor=1.0,
      norm_topk_prob=False,
      use_qk_norm=False,
      attention_bias=False,
      partial_rotary_factor=0.75,
      tie_word_embeddings=True,
      num_nextn_predict_layers=0,
    ),
  ),
  "gptoss_sliding_sinks": (
    "GptOssConfig",
    "GptOssForCausalLM",
    dict(
      vocab_size=80,
      hidden_size=32,
      intermediate_size=32,
      num_hidden_layers=3,
      num_attention_heads=4,
      num_key_value_heads=2,
      head_dim=16,
      num_local_experts=4,
      num_experts_per_tok=2,
      sliding_window=4,
      tie_word_embeddings=False,
    ),
  ),
}


# Hybrid targets (Gated DeltaNet + gated full attention): kept apart from CONFIGS so that the
# suites parametrized over CONFIGS (sharding, quantization, ...) do not grow.
_LINEAR = dict(
  linear_conv_kernel_dim=4,
  linear_key_head_dim=8,
  linear_value_head_dim=6,
  linear_num_key_heads=2,
  linear_num_value_heads=4,
)
HYBRID_CONFIGS = {
  "qwen3_5_dense_3to1_tied": (
    "Qwen3_5TextConfig",
    "Qwen3_5ForCausalLM",
    dict(
      vocab_size=64,
      hidden_size=32,
      intermediate_size=48,
      num_hidden_layers=4,  # linear, linear, linear, full
      num_attention_heads=4,
      num_key_value_heads=2,
      head_dim=8,
      tie_word_embeddings=True,
      rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
      **_LINEAR,
    ),
  ),
  "qwen3_5_dense_full_first": (
    "Qwen3_5TextConfig",
    "Qwen3_5ForCausalLM",
    dict(
      vocab_size=72,
      hidden_size=24,
      intermediate_size=40,
      num_hidden_layers=5,
      layer_types=[
        "full_attention",
        "linear_attention",
        "linear_attention",
        "full_attention",
        "linear_attention",
      ],
      num_attention_heads=2,
      num_key_value_heads=1,
      head_dim=16,  # the default partial_rotary_factor 0.25: 4 rotary features
      tie_word_embeddings=False,
      linear_conv_kernel_dim=3,
      linear_key_head_dim=6,
      linear_value_head_dim=8,
      linear_num_key_heads=3,
      linear_num_value_heads=3,
    ),
  ),
  "qwen3next_moe_mlponly": (
    "Qwen3NextConfig",
    "Qwen3NextForCausalLM",
    dict(
      vocab_size=80,
      hidden_size=32,
      intermediate_size=48,
      moe_intermediate_size=16,
      shared_expert_intermediate_size=24,
      num_experts=4,
      num_experts_per_tok=2,
      norm_topk_prob=False,
      mlp_only_layers=[1],
      decoder_sparse_step=1,
      num_hidden_layers=4,
      full_attention_interval=2,  # linear, full, linear, full
      num_attention_heads=4,
      num_key_value_heads=2,
      head_dim=8,
      tie_word_embeddings=False,
      **_LINEAR,
    ),
  ),
  "qwen3_5moe_3to1": (
    "Qwen3_5MoeTextConfig",
    "Qwen3_5MoeForCausalLM",
    dict(
      vocab_size=64,
      hidden_size=32,
      moe_intermediate_size=16,
      shared_expert_intermediate_size=24,
      num_experts=6,
      num_experts_per_tok=2,
      num_hidden_layers=4,
      num_attention_heads=2,
      num_key_value_heads=2,
      head_dim=16,
      tie_word_embeddings=False,
      **_LINEAR,
    ),
  ),
}


def build_hf_model(name: str, seed: int = 0) -> transformers.PreTrainedModel:
  """A float32 HF model of configuration `name` (CONFIGS, HYBRID_CONFIGS, MLA_CONFIGS or
  MINIMAX_CONFIGS) with perturbed random weights, in eval mode."""
  return build_any(name, seed)


def build_hf_model_from(
  config_cls: str, model_cls: str, kwargs: dict, seed: int = 0
) -> transformers.PreTrainedModel:
  """As build_hf_model, for a configuration given inline (class names and kwargs)."""
  config = getattr(transformers, config_cls)(**kwargs)
  torch.manual_seed(seed)
  return perturbed(getattr(transformers, model_cls)(config), seed + 1)


def perturbed(model: transformers.PreTrainedModel, seed: int) -> transformers.PreTrainedModel:
  """`model` in float32 eval mode with random weights away from HF's initialisation: norm
  weights 1 ± 0.2, matrices N(0, 0.15²), correction biases N(0, 0.1²)."""
  model = model.float().eval()
  gen = torch.Generator().manual_seed(seed)
  with torch.no_grad():
    for pname, p in model.named_parameters():
      if pname.endswith("norm.weight") or "layernorm" in pname:
        p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
      else:
        p.copy_(0.15 * torch.randn(p.shape, generator=gen))
    for bname, b in model.named_buffers():
      if bname.endswith("e_score_correction_bias"):
        b.copy_(0.1 * torch.randn(b.shape, generator=gen))
  return model


def save_hf_model(name: str, out_dir: str, seed: int = 0) -> transformers.PreTrainedModel:
  model = build_hf_model(name, seed)
  model.save_pretrained(out_dir)
  assert os.path.exists(os.path.join(out_dir, "config.json"))
  return model


def save_all(
  tmp_path_factory, names: Any = None
) -> dict[str, tuple[transformers.PreTrainedModel, str]]:
  """name → (HF model, checkpoint dir) for every configuration of CONFIGS (or of `names`), for
  module-scoped fixtures."""
  out = {}
  for name in sorted(CONFIGS if names is None else names):
    d = str(tmp_path_factory.mktemp(name))
    out[name] = (save_hf_model(name, d), d)
  return out


def hf_logits(model: transformers.PreTrainedModel, ids: np.ndarray) -> np.ndarray:
  with torch.no_grad():
    return model(torch.as_tensor(ids, dtype=torch.long)).logits.float().numpy()


# Multi-head Latent Attention targets (DeepSeek-V3 / Kimi-K2), kept apart as HYBRID_CONFIGS are.
_MLA = dict(
  vocab_size=96,
  hidden_size=32,
  intermediate_size=48,
  moe_intermediate_size=16,
  num_attention_heads=4,
  num_key_value_heads=4,
  kv_lora_rank=24,  # + qk_rope_head_dim 8: a Q4_0 block
  qk_nope_head_dim=8,
  qk_rope_head_dim=8,
  v_head_dim=12,
  n_shared_experts=1,
  num_experts_per_tok=2,
  first_k_dense_replace=1,
  norm_topk_prob=True,
  tie_word_embeddings=False,
  num_nextn_predict_layers=0,
)
MLA_CONFIGS = {
  # q low-rank, grouped routing, DeepSeek's YaRN with mscale (softmax scale × mscale²).
  "deepseek_v3_qlora_grouped_yarn": (
    "DeepseekV3Config",
    "DeepseekV3ForCausalLM",
    dict(
      _MLA,
      num_hidden_layers=3,
      q_lora_rank=12,
      n_routed_experts=8,
      n_group=4,
      topk_group=2,
      routed_scaling_factor=2.5,
      max_position_embeddings=256,
      rope_parameters={
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 4.0,
        "original_max_position_embeddings": 64,
        "beta_fast": 32,
        "beta_slow": 1,
        "mscale": 0.8,
        "mscale_all_dim": 1.0,
      },
    ),
  ),
  # Plain q_proj (q_lora_rank null, as DeepSeek-V2-Lite), flat routing, half-split RoPE.
  "deepseek_v3_plainq_flat": (
    "DeepseekV3Config",
    "DeepseekV3ForCausalLM",
    dict(
      _MLA,
      num_hidden_layers=2,
      q_lora_rank=None,
      n_routed_experts=4,
      n_group=1,
      topk_group=1,
      routed_scaling_factor=1.0,
      rope_interleave=False,
      attention_bias=True,
    ),
  ),
}


_DSA = dict(
  _MLA,
  q_lora_rank=12,
  n_routed_experts=4,
  n_group=1,
  topk_group=1,
  routed_scaling_factor=1.5,
  index_n_heads=8,
  index_head_dim=16,
  index_topk=4,  # shorter than the test contexts: the choice matters
)
# DeepSeek Sparse Attention targets (MLA + the lightning indexer).
DSA_CONFIGS = {
  # GLM-5: interleaved indexer RoPE, a layer reusing the previous indexer's choice.
  "glm5_dsa_shared": (
    "GlmMoeDsaConfig",
    "GlmMoeDsaForCausalLM",
    dict(_DSA, num_hidden_layers=3, indexer_types=["full", "shared", "full"]),
  ),
  # DeepSeek-V3.2: half-split indexer RoPE, every layer its own indexer.
  "deepseek_v32_dsa": (
    "DeepseekV32Config",
    "DeepseekV32ForCausalLM",
    dict(_DSA, num_hidden_layers=2),
  ),
}
MLA_CONFIGS.update(DSA_CONFIGS)


# MiniMax-M2 targets (the conformance table's rows; tests/test_minimax_m2.py has the rest).
_MINIMAX = dict(vocab_size=96, num_hidden_layers=2, tie_word_embeddings=False)
MINIMAX_CONFIGS = {
  # 4 of 8 features per head rotated (MiniMax's `rotary_dim`), 2 query heads per KV head.
  "minimax_m2_partial": (
    "MiniMaxM2Config",
    "MiniMaxM2ForCausalLM",
    dict(
      _MINIMAX,
      hidden_size=32,
      intermediate_size=16,
      num_attention_heads=4,
      num_key_value_heads=2,
      head_dim=8,
      rotary_dim=4,
      num_local_experts=4,
      num_experts_per_tok=2,
      rope_theta=10000.0,
    ),
  ),
  # Whole heads of 16 rotated, 3 KV heads of 6 query heads; wide enough for MXFP4 blocks.
  "minimax_m2_full": (
    "MiniMaxM2Config",
    "MiniMaxM2ForCausalLM",
    dict(
      _MINIMAX,
      hidden_size=64,
      intermediate_size=32,
      num_attention_heads=6,
      num_key_value_heads=3,
      head_dim=16,
      num_local_experts=6,
      num_experts_per_tok=3,
      rms_norm_eps=1e-5,
      rope_theta=1000.0,
    ),
  ),
}


def build_any(name: str, seed: int = 0) -> transformers.PreTrainedModel:
  """build_hf_model for a name in CONFIGS, HYBRID_CONFIGS, MLA_CONFIGS or MINIMAX_CONFIGS."""
  for table in (CONFIGS, HYBRID_CONFIGS, MLA_CONFIGS, MINIMAX_CONFIGS):
    if name in table:
      return build_hf_model_from(*table[name], seed=seed)
  raise KeyError(name)
