"""A tiny randomly initialised Qwen3-MoE-style target, for demos and smoke tests.

Used by ``launch/generate.py`` when no checkpoint is given: it exercises the
whole path (tokenizer, MoE decoder, cache, drafter, engine) in seconds on one
CPU. The output is random text; only the mechanics are meaningful.

Model fields use the names of ``jaxspec.config.ModelConfig``.
"""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
  """Returns the tiny random model and demo settings."""
  config = ml_collections.ConfigDict()
  config.architecture = "Qwen3MoeForCausalLM"
  # Matches the bundled byte-level BPE tokenizer (jaxspec/assets/tokenizer.json,
  # 8192 ids: <|endoftext|>=0, <|pad|>=1, <|mask|>=2).
  config.vocab_size = 8192
  config.eos_token_id = 0
  config.pad_token_id = 1
  config.mask_token_id = 2
  config.hidden_size = 64
  config.num_layers = 2
  config.num_heads = 4
  config.num_kv_heads = 2
  config.head_dim = 16
  config.intermediate_size = 128  # dense MLP width (unused when every layer is MoE)
  # Mixture of experts (Qwen3-MoE: softmax router, top-k renormalised).
  config.num_experts = 8
  config.num_experts_per_tok = 2
  config.moe_intermediate_size = 32
  config.norm_topk_prob = True
  config.rope_theta = 1_000_000.0
  config.rms_norm_eps = 1e-6
  config.tie_word_embeddings = False
  config.dtype = "float32"
  # Run settings.
  config.seed = 0
  config.max_len = 256
  config.mesh = ml_collections.ConfigDict({"data": 1, "expert": 1, "tensor": 1})
  return config
