"""RoPE scaling read from HF configs (issue 16, part): linear and YaRN, parity with transformers
(the rotary tables themselves, and whole-model logits past the original context)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers

import jaxspec
from jaxspec.models import layers
from jaxspec.io.architectures import config_from_hf
from tests import hf_models, near_ties

QWEN3 = dict(
  vocab_size=64,
  hidden_size=32,
  intermediate_size=64,
  num_hidden_layers=2,
  num_attention_heads=4,
  num_key_value_heads=2,
  head_dim=16,
  max_position_embeddings=256,
  tie_word_embeddings=False,
)
GLM = dict(
  vocab_size=64,
  hidden_size=32,
  intermediate_size=64,
  moe_intermediate_size=16,
  num_hidden_layers=2,
  num_attention_heads=4,
  num_key_value_heads=2,
  head_dim=16,
  n_routed_experts=4,
  num_experts_per_tok=2,
  n_group=1,
  topk_group=1,
  first_k_dense_replace=1,
  norm_topk_prob=True,
  partial_rotary_factor=0.5,
  num_nextn_predict_layers=0,
  max_position_embeddings=256,
)

SCALINGS = {
  "linear": {"rope_type": "linear", "factor": 3.0},
  "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},
  "yarn_betas_mscale": {
    "rope_type": "yarn",
    "factor": 8.0,
    "original_max_position_embeddings": 24,
    "beta_fast": 16.0,
    "beta_slow": 2.0,
    "mscale": 0.9,
    "mscale_all_dim": 0.7,
  },
  "dynamic": {"rope_type": "dynamic", "factor": 2.0},
  # Llama 3.1's bands at θ 5000, head_dim 16: one pair kept, two blended, five divided.
  "llama3": {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
  },
  "yarn_attention_factor": {
    "rope_type": "yarn",
    "factor": 2.0,
    "original_max_position_embeddings": 32,
    "attention_factor": 1.3,
    "truncate": False,
  },
}


def _hf(arch: str, scaling: dict, theta: float = 10000.0) -> transformers.PreTrainedModel:
  kwargs = dict(QWEN3 if arch == "qwen3" else GLM)
  kwargs["rope_parameters"] = {**scaling, "rope_theta": theta}
  if arch == "glm":
    kwargs["rope_parameters"]["partial_rotary_factor"] = 0.5
  cls = (
    ("Qwen3Config", "Qwen3ForCausalLM")
    if arch == "qwen3"
    else ("Glm4MoeConfig", "Glm4MoeForCausalLM")
  )
  return hf_models.build_hf_model_from(*cls, kwargs, seed=3)


@pytest.mark.parametrize("name", sorted(SCALINGS))
def test_rotary_tables_equal_transformers(name):
  hf = _hf("qwen3", SCALINGS[name], theta=5000.0)
  config = config_from_hf({**hf.config.to_dict(), "architectures": ["Qwen3ForCausalLM"]})
  assert dict(config.rope_scaling)["rope_type"] == SCALINGS[name]["rope_type"]
  pos = np.arange(0, 200, 7)[None]
  if name == "dynamic":  # transformers scales for the longest position in the call: span M · 2
    pos = np.append(pos, 2 * QWEN3["max_position_embeddings"] - 1)[None]
  x = torch.zeros(1, pos.shape[1], config.hidden_size)
  with torch.no_grad():
    cos_hf, sin_hf = hf.model.rotary_emb(x, torch.as_tensor(pos))
  cos, sin = layers.rope_tables(pos, config.rotary_dim, config.rope_theta, config.rope_scaling)
  # An ulp of a float32 frequency is ~4e-6 of angle at position 511 (the dynamic case).
  atol = 1e-5 if name == "dynamic" else 2e-6
  np.testing.assert_allclose(np.asarray(cos), cos_hf.numpy(), atol=atol)
  np.testing.assert_allclose(np.asarray(sin), sin_hf.numpy(), atol=atol)
  # The scaling matters: the default tables differ.
  plain, _ = layers.rope_tables(pos, config.rotary_dim, config.rope_theta)
  assert np.abs(np.asarray(plain) - cos_hf.numpy()).max() > 1e-2


@pytest.mark.parametrize("arch", ["qwen3", "glm"])
@pytest.mark.parametrize("name", ["linear", "yarn"])
def test_logits_past_the_original_context_equal_transformers(arch, name, tmp_path):
  hf = _hf(arch, SCALINGS[name])
  hf.save_pretrained(str(tmp_path))
  model = jaxspec.load_model(str(tmp_path))
  assert model.config.rope_scaling
  ids = np.random.default_rng(1).integers(0, 64, (2, 40))  # past original_max (16)
  ref = hf_models.hf_logits(hf, ids)
  near_ties.assert_logits_match(model, ids, model.logits(ids), ref, atol=1e-4)
  # Saved back, transformers reads the same scaling.
  jaxspec.save_hf(model, str(tmp_path / "out"))
  again = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out")).float()
  np.testing.assert_allclose(hf_models.hf_logits(again, ids), ref, atol=1e-5)


def test_legacy_rope_scaling_key_and_unsupported_types():
  base = dict(architectures=["Qwen3ForCausalLM"], **QWEN3)
  legacy = config_from_hf({**base, "rope_scaling": {"type": "linear", "factor": 2.0}})
  assert dict(legacy.rope_scaling) == {"rope_type": "linear", "factor": 2.0}
  with pytest.raises(jaxspec.ConfigError, match="RoPE type 'longrope'.*not supported"):
    config_from_hf({**base, "rope_scaling": {"rope_type": "longrope", "factor": 2.0}})
  with pytest.raises(jaxspec.ConfigError, match="dynamic RoPE scaling needs a factor"):
    config_from_hf({**base, "rope_scaling": {"rope_type": "dynamic"}})
  with pytest.raises(jaxspec.ConfigError, match="original_max_position_embeddings"):
    config_from_hf({**base, "rope_parameters": {"rope_type": "yarn", "factor": 2.0}})
  with pytest.raises(jaxspec.ConfigError, match="conflicting RoPE scaling"):
    config_from_hf(
      {
        **base,
        "rope_parameters": {"rope_type": "linear", "factor": 2.0},
        "rope_scaling": {"rope_type": "linear", "factor": 3.0},
      }
    )
  llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
  # original_max_position_embeddings defaults to max_position_embeddings, as in transformers.
  read = dict(config_from_hf({**base, "rope_parameters": llama3}).rope_scaling)
  assert read["original_max_position_embeddings"] == QWEN3["max_position_embeddings"]
  with pytest.raises(jaxspec.ConfigError, match="llama3 RoPE scaling needs low_freq_factor"):
    config_from_hf({**base, "rope_parameters": {**llama3, "low_freq_factor": None}})
  with pytest.raises(jaxspec.ConfigError, match="high_freq_factor > low_freq_factor"):
    config_from_hf({**base, "rope_parameters": {**llama3, "high_freq_factor": 1.0}})
  with pytest.raises(jaxspec.ConfigError, match="linear RoPE scaling needs a factor"):
    config_from_hf({**base, "rope_parameters": {"rope_type": "linear"}})
  with pytest.raises(jaxspec.ConfigError, match="rope_scaling must be"):
    legacy.replace(rope_scaling=(("rope_type", "longrope"),))


@pytest.mark.parametrize("arch", ["qwen3", "glm"])
def test_dynamic_ntk_equals_transformers_over_the_extended_context(arch, tmp_path):
  """Dynamic NTK with θ fixed for the whole extended context (max_position_embeddings ×
  factor, as vLLM): equal to transformers for a forward that spans exactly that context."""
  hf = _hf(arch, {"rope_type": "dynamic", "factor": 2.0})
  hf.config.max_position_embeddings = 20
  hf.model.rotary_emb = type(hf.model.rotary_emb)(hf.config)
  hf.save_pretrained(str(tmp_path))
  model = jaxspec.load_model(str(tmp_path))
  assert dict(model.config.rope_scaling)["rope_type"] == "dynamic"
  ids = np.random.default_rng(2).integers(0, 64, (2, 40))  # 20 × 2 positions
  ref = hf_models.hf_logits(hf, ids)
  near_ties.assert_logits_match(model, ids, model.logits(ids), ref, atol=1e-4)
  # The scaling matters: default RoPE gives other logits.
  plain = model.with_config(rope_scaling=())
  assert np.abs(np.asarray(plain.logits(ids)) - ref).max() > 1e-3
  jaxspec.save_hf(model, str(tmp_path / "out"))
  again = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out")).float()
  np.testing.assert_allclose(hf_models.hf_logits(again, ids), ref, atol=1e-5)
