"""Small random configurations of the supported HF architectures, built with transformers.

Shared by the parity, checkpoint and sharding tests. Weights are perturbed away from HF's
initialisation (norm weights ≠ 1, correction biases ≠ 0) so that a swapped or ignored tensor
changes the logits.
"""

from __future__ import annotations

import os

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


def build_hf_model(name: str, seed: int = 0) -> transformers.PreTrainedModel:
  """A float32 HF model of configuration `name` with perturbed random weights, in eval mode."""
  return build_hf_model_from(*CONFIGS[name], seed=seed)


def build_hf_model_from(
  config_cls: str, model_cls: str, kwargs: dict, seed: int = 0
) -> transformers.PreTrainedModel:
  """As build_hf_model, for a configuration given inline (class names and kwargs)."""
  config = getattr(transformers, config_cls)(**kwargs)
  torch.manual_seed(seed)
  model = getattr(transformers, model_cls)(config).float().eval()
  gen = torch.Generator().manual_seed(seed + 1)
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


def save_all(tmp_path_factory) -> dict[str, tuple[transformers.PreTrainedModel, str]]:
  """name → (HF model, checkpoint dir) for every configuration (for module-scoped fixtures)."""
  out = {}
  for name in sorted(CONFIGS):
    d = str(tmp_path_factory.mktemp(name))
    out[name] = (save_hf_model(name, d), d)
  return out


def hf_logits(model: transformers.PreTrainedModel, ids: np.ndarray) -> np.ndarray:
  with torch.no_grad():
    return model(torch.as_tensor(ids, dtype=torch.long)).logits.float().numpy()
