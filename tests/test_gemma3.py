"""Gemma 3 targets (Gemma3ForCausalLM, the text part of Gemma3ForConditionalGeneration): what is
Gemma 3's own, against transformers on small random configurations. The generic checks (parity,
round trips, cached greedy decoding past the window with the sliding layer in a ring, DFlash
speculation, quantization, the planner) are its rows in tests/test_conformance.py.

"scaled": four layers by `sliding_window_pattern` 3 (sliding, sliding, full, sliding), window 4,
query_pre_attn_scalar 12 (not head_dim 8), the sliding layers' base 50, the full layers' 1000
with linear RoPE scaling (factor 8). "capped": sliding, full, soft-capped logits. "wrapped": a
Gemma3ForConditionalGeneration with a one-layer vision tower, saved by transformers.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
import transformers
from safetensors.numpy import load_file, save_file

import jaxspec
from jaxspec.errors import ConfigError
from jaxspec.io.architectures import config_from_hf, config_to_hf

from tests import hf_models, near_ties

SLIDING, FULL = "sliding_attention", "full_attention"
VOCAB = 96
TEXT = dict(
  vocab_size=VOCAB,
  hidden_size=32,
  intermediate_size=48,
  num_attention_heads=4,
  num_key_value_heads=2,
  head_dim=8,
  sliding_window=4,
)
CONFIGS = {
  "scaled": dict(
    TEXT,
    num_hidden_layers=4,
    sliding_window_pattern=3,
    query_pre_attn_scalar=12,
    rope_theta=1e3,
    rope_local_base_freq=50.0,
    rope_scaling={"rope_type": "linear", "factor": 8.0},
  ),
  "capped": dict(
    TEXT, num_hidden_layers=2, layer_types=[SLIDING, FULL], final_logit_softcapping=3.0
  ),
}
VISION = dict(
  hidden_size=16,
  intermediate_size=32,
  num_hidden_layers=1,
  num_attention_heads=2,
  image_size=16,
  patch_size=8,
)


def _tensors(d: str) -> dict[str, np.ndarray]:
  out = {}
  for f in os.listdir(d):
    if f.endswith(".safetensors"):
      out.update(load_file(os.path.join(d, f)))
  return out


def _config(d: str) -> dict:
  with open(os.path.join(d, "config.json")) as f:
    return json.load(f)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  """name → (HF model, checkpoint dir), "wrapped" included."""
  out = {}
  for name, config in CONFIGS.items():
    d = str(tmp_path_factory.mktemp(f"gemma3_{name}"))
    model = hf_models.build_hf_model_from("Gemma3TextConfig", "Gemma3ForCausalLM", config, 0)
    model.save_pretrained(d)
    out[name] = (model, d)
  config = transformers.Gemma3Config(
    text_config=CONFIGS["scaled"], vision_config=VISION, mm_tokens_per_image=4
  )
  torch.manual_seed(1)
  wrapped = hf_models.perturbed(transformers.Gemma3ForConditionalGeneration(config), 2)
  d = str(tmp_path_factory.mktemp("gemma3_wrapped"))
  wrapped.save_pretrained(d)
  out["wrapped"] = (wrapped, d)
  return out


@pytest.fixture(scope="module")
def scaled(saved):
  """The "scaled" target, loaded once."""
  return jaxspec.load_model(saved["scaled"][1])


def _ids(shape=(2, 14), seed: int = 0) -> np.ndarray:
  return np.random.default_rng(seed).integers(0, VOCAB, shape)


# -- config.json -----------------------------------------------------------------------------------

# gemma-3-1b-it's spelling (transformers 4.50): flat RoPE keys, the layer pattern by number.
_LEGACY = ("rope_theta", "rope_local_base_freq", "rope_scaling", "sliding_window_pattern")


def _legacy(native: dict) -> dict:
  """A transformers 5 config.json respelled as the published flat one."""
  full, sliding = native["rope_parameters"][FULL], native["rope_parameters"][SLIDING]
  out = {k: v for k, v in native.items() if k not in ("rope_parameters", "layer_types")}
  scaling = {k: v for k, v in full.items() if k != "rope_theta"}
  return dict(
    out,
    rope_theta=full["rope_theta"],
    rope_local_base_freq=sliding["rope_theta"],
    rope_scaling=scaling if scaling["rope_type"] != "default" else None,
    sliding_window_pattern=native.get("sliding_window_pattern", 6),
  )


def test_config_reads_both_spellings_and_the_wrappers_defaults(saved):
  native = _config(saved["scaled"][1])
  c = config_from_hf(native)
  assert c.layer_windows == (4, 4, 0, 4)
  assert (c.rope_theta, c.sliding_rope_theta, c.query_pre_attn_scalar) == (1e3, 50.0, 12.0)
  assert c.rope_scaling == (("factor", 8.0), ("rope_type", "linear"))
  assert c.tie_word_embeddings and c.hidden_act == "gelu_pytorch_tanh"
  assert c.layer_rope(0) == (8, 50.0, ()) and c.layer_rope(2) == (8, 1e3, c.rope_scaling)
  assert config_from_hf(config_to_hf(c)) == c
  # The published flat spelling reads the same, as transformers reads it.
  legacy = _legacy(native)
  assert config_from_hf(legacy) == c
  theirs = transformers.Gemma3TextConfig(**legacy)
  assert theirs.layer_types == native["layer_types"]
  assert theirs.rope_parameters == native["rope_parameters"]
  # gemma-3-4b-it's wrapper states in text_config only what differs from the defaults.
  sparse = {"hidden_size": 2560, "intermediate_size": 10240, "num_hidden_layers": 34}
  sparse["rope_scaling"] = {"factor": 8.0, "rope_type": "linear"}
  published = {
    "architectures": ["Gemma3ForConditionalGeneration"],
    "eos_token_id": [1, 106],
    "text_config": {**sparse, "model_type": "gemma3_text", "sliding_window": 1024},
    "vision_config": {"model_type": "siglip_vision_model"},
  }
  big = config_from_hf(published)
  want = transformers.Gemma3TextConfig(**sparse, sliding_window=1024)
  assert (big.vocab_size, big.num_heads, big.num_kv_heads, big.head_dim) == (
    want.vocab_size, want.num_attention_heads, want.num_key_value_heads, want.head_dim
  )
  assert big.layer_windows == tuple(1024 if t == SLIDING else 0 for t in want.layer_types)
  assert (big.rope_theta, big.sliding_rope_theta) == (1e6, 1e4)
  assert (big.query_pre_attn_scalar, big.eos_token_ids) == (256.0, (1, 106))
  # gemma-3-1b-it's config.json as published (a null rope_scaling: the full layers unscaled).
  small = config_from_hf(GEMMA_3_1B)
  want = transformers.Gemma3TextConfig(**GEMMA_3_1B)
  assert small.layer_windows == tuple(512 if t == SLIDING else 0 for t in want.layer_types)
  assert small.layer_windows[:6] == (512,) * 5 + (0,) and small.rope_scaling == ()
  assert (small.num_kv_heads, small.head_dim, small.sliding_rope_theta) == (1, 256, 1e4)


GEMMA_3_1B = {
  "architectures": ["Gemma3ForCausalLM"],
  "attention_bias": False,
  "attention_dropout": 0.0,
  "attn_logit_softcapping": None,
  "bos_token_id": 2,
  "cache_implementation": "hybrid",
  "eos_token_id": [1, 106],
  "final_logit_softcapping": None,
  "head_dim": 256,
  "hidden_activation": "gelu_pytorch_tanh",
  "hidden_size": 1152,
  "initializer_range": 0.02,
  "intermediate_size": 6912,
  "max_position_embeddings": 32768,
  "model_type": "gemma3_text",
  "num_attention_heads": 4,
  "num_hidden_layers": 26,
  "num_key_value_heads": 1,
  "pad_token_id": 0,
  "query_pre_attn_scalar": 256,
  "rms_norm_eps": 1e-06,
  "rope_local_base_freq": 10000,
  "rope_scaling": None,
  "rope_theta": 1000000,
  "sliding_window": 512,
  "sliding_window_pattern": 6,
  "torch_dtype": "bfloat16",
  "use_cache": True,
  "vocab_size": 262144,
}


@pytest.mark.parametrize(
  "change, match",
  [
    (dict(attn_logit_softcapping=50.0), "attn_logit_softcapping"),
    (dict(use_bidirectional_attention=True), "use_bidirectional_attention"),
    (dict(hidden_activation="gelu"), "hidden_activation"),
    (dict(hidden_act="silu"), "hidden_act and hidden_activation disagree"),
    (dict(rope_parameters={FULL: {"rope_type": "yarn", "factor": 2.0}}), "yarn"),
    (dict(rope_parameters={SLIDING: {"rope_type": "linear", "factor": 2.0}}), "sliding layers"),
    (dict(rope_parameters={"global": {}}), "unknown layer types"),
    (dict(rope_local_base_freq=7.0), "rope_local_base_freq and rope_parameters"),
    (dict(rope_scaling={"rope_type": "linear", "factor": 2.0}), "rope_scaling.factor"),
    (dict(layer_types=[SLIDING, FULL]), "layer_types"),
    (dict(query_pre_attn_scalar=0), "query_pre_attn_scalar"),
  ],
)
def test_unsupported_or_conflicting_keys_are_refused_by_name(saved, change, match):
  hf = {**_config(saved["scaled"][1]), **change}
  with pytest.raises(ConfigError, match=match):
    config_from_hf(hf)


def test_the_query_scalar_is_gemma_3s_own(scaled):
  """Another family's config carrying Gemma 3's softmax scale is refused, naming the field."""
  with pytest.raises(ConfigError, match="query_pre_attn_scalar"):
    scaled.config.replace(architecture="Qwen3ForCausalLM", layer_windows=(), sliding_rope_theta=0.0)


# -- the model -------------------------------------------------------------------------------------


def test_logits_depend_on_the_rope_bases_and_the_cap(saved, scaled):
  """Within 1e-4 of transformers with four layers by pattern and soft-capped logits; off with
  the sliding layers at the full layers' base, and the capped model uncapped. (The softmax
  scale and the linear scaling: the gemma3 row of tests/test_conformance.py.)"""
  hf, _ = saved["scaled"]
  ids = _ids(seed=1)
  want = hf_models.hf_logits(hf, ids)
  near_ties.assert_logits_match(scaled, ids, np.asarray(scaled.logits(ids)), want, atol=1e-4)
  one_base = scaled.with_config(sliding_rope_theta=scaled.config.rope_theta)
  assert np.abs(np.asarray(one_base.logits(ids)) - want).max() > 1e-3
  hf_c, d = saved["capped"]
  capped = jaxspec.load_model(d, scan_layers=True)
  want = hf_models.hf_logits(hf_c, ids)
  near_ties.assert_logits_match(capped, ids, np.asarray(capped.logits(ids)), want, atol=1e-4)
  assert np.abs(want).max() <= 3.0
  uncapped = np.asarray(capped.with_config(final_logit_softcapping=0.0).logits(ids))
  assert np.abs(uncapped - want).max() > 1e-3


def test_norms_are_zero_centred(saved, scaled):
  """Every RMSNorm (q/k norms included) scales by 1 + w: the same weights read as w are off."""
  hf, _ = saved["scaled"]
  ids = _ids(seed=2)
  want = hf_models.hf_logits(hf, ids)
  with torch.no_grad():
    for name, p in hf.named_parameters():
      if name.endswith("norm.weight"):
        p.sub_(1.0)  # w - 1: transformers' 1 + (w - 1) equals a plain norm of weight w
    plain = hf_models.hf_logits(hf, ids)
    for name, p in hf.named_parameters():
      if name.endswith("norm.weight"):
        p.add_(1.0)
  assert np.abs(plain - want).max() > 1e-3
  got = np.asarray(scaled.logits(ids))
  assert np.abs(got - plain).max() > 1e-3 and np.abs(got - want).max() < 1e-4


def test_wrapped_checkpoints_read_the_language_model(saved, scaled, tmp_path):
  """Gemma3ForConditionalGeneration as transformers saves it and as Google published it
  (`language_model.model.*`, tower `vision_tower.*`, `multi_modal_projector.*`), and under the
  names transformers holds in memory (`model.language_model.*`): the text model's logits equal
  the wrapper's on text, the tower and projector left out with a warning."""
  wrapped, d = saved["wrapped"]
  names = set(_tensors(d))
  assert "language_model.model.embed_tokens.weight" in names
  assert any(n.startswith("multi_modal_projector.") for n in names)
  ids = _ids((1, 14), seed=3)
  want = hf_models.hf_logits(wrapped, ids)
  with pytest.warns(UserWarning, match="vision"):
    model = jaxspec.load_model(d)
  assert model.config == scaled.config.replace(eos_token_ids=model.config.eos_token_ids)
  near_ties.assert_logits_match(model, ids, np.asarray(model.logits(ids)), want, atol=1e-4)
  renamed = tmp_path / "in_memory_names"
  renamed.mkdir()
  tensors = {
    n.replace("language_model.model.", "model.language_model.", 1)
    .replace("vision_tower.", "model.vision_tower.", 1)
    .replace("multi_modal_projector.", "model.multi_modal_projector.", 1): t
    for n, t in _tensors(d).items()
  }
  save_file(tensors, str(renamed / "model.safetensors"))
  with open(renamed / "config.json", "w") as f:
    json.dump(_config(d), f)
  with pytest.warns(UserWarning, match="vision"):
    again = jaxspec.load_model(str(renamed))
  np.testing.assert_array_equal(np.asarray(again.logits(ids)), np.asarray(model.logits(ids)))


def test_export_writes_the_published_names_and_config(saved, tmp_path):
  """save_hf of a wrapped checkpoint's text model: Gemma3ForCausalLM's published tensor names
  (no lm_head: tied), a text config transformers reads to the same logits."""
  wrapped, d = saved["wrapped"]
  with pytest.warns(UserWarning, match="vision"):
    model = jaxspec.load_model(d)
  out = str(tmp_path / "export")
  jaxspec.save_hf(model, out)
  names = set(_tensors(out))
  hf_text, text_dir = saved["scaled"]
  assert names == set(_tensors(text_dir))
  config = _config(out)
  assert config["architectures"] == ["Gemma3ForCausalLM"]
  assert config["model_type"] == "gemma3_text" and "vision_config" not in config
  back = transformers.AutoModelForCausalLM.from_pretrained(out).float().eval()
  ids = _ids((1, 14), seed=4)
  np.testing.assert_allclose(
    hf_models.hf_logits(back, ids), hf_models.hf_logits(wrapped, ids), atol=1e-5
  )
