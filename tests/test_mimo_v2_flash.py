"""MiMo-V2-Flash targets (MiMoV2FlashForCausalLM) against transformers on small random
configurations.

Two layer patterns: "hub" (full, sliding ×3, full, sliding: transformers' pattern rule) and
"alternate" (sliding, full, sliding, with sinks on every layer is not transformers': it keeps
its rule of sinks on sliding layers). Sliding layers have twice the full layers' KV heads
(transformers' rule), windows of 5 and 4 under prompts of 13 tokens, sinks perturbed with every
other weight (tests/hf_models.py), keys 12 wide and values 8, a value scale, partial RoPE with
a different base per layer type and a dense first layer before the MoE layers.
"""

from __future__ import annotations

import dataclasses
import json
import os

import jax
import numpy as np
import pytest
import torch
from safetensors import safe_open

import jaxspec
from jaxspec.errors import ConfigError
from jaxspec.io.architectures import config_from_hf, config_to_hf
from jaxspec.speculative.engine import EngineConfig, SpecEngine
from jaxspec.state import SlidingKV

from tests import drafter_models, hf_models, near_ties

_BASE = dict(
  vocab_size=80,
  hidden_size=32,
  intermediate_size=48,
  moe_intermediate_size=32,
  num_attention_heads=4,
  num_key_value_heads=1,
  head_dim=12,
  v_head_dim=8,
  n_routed_experts=4,
  num_experts_per_tok=2,
  attention_value_scale=0.6,
  tie_word_embeddings=False,
  rope_parameters={
    "full_attention": {"rope_type": "default", "rope_theta": 5e6, "partial_rotary_factor": 0.5},
    "sliding_attention": {"rope_type": "default", "rope_theta": 1e2, "partial_rotary_factor": 0.5},
  },
)
CONFIGS = {
  "hub": dict(_BASE, num_hidden_layers=6, sliding_window=5),  # transformers' own pattern
  "alternate": dict(
    _BASE,
    num_hidden_layers=3,
    sliding_window=4,
    layer_types=["sliding_attention", "full_attention", "sliding_attention"],
    mlp_layer_types=["dense", "sparse", "dense"],
    n_group=2,
    topk_group=1,
  ),
}


def _build(name: str, seed: int = 0):
  return hf_models.build_hf_model_from(
    "MiMoV2FlashConfig", "MiMoV2FlashForCausalLM", CONFIGS[name], seed=seed
  )


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  """name → (HF model, checkpoint dir)."""
  out = {}
  for name in CONFIGS:
    d = str(tmp_path_factory.mktemp(f"mimo_{name}"))
    model = _build(name)
    model.save_pretrained(d)
    out[name] = (model, d)
  return out


def _ids(vocab: int, shape=(2, 13), seed: int = 0) -> np.ndarray:
  return np.random.default_rng(seed).integers(0, vocab, shape)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_logits_match_transformers(saved, name):
  hf, d = saved[name]
  model = jaxspec.load_model(d, scan_layers=True)
  ids = _ids(model.config.vocab_size)
  near_ties.assert_logits_match(
    model, ids, np.asarray(model.logits(ids)), hf_models.hf_logits(hf, ids), atol=1e-4
  )


def test_config_reads_both_spellings_and_round_trips(saved):
  _, d = saved["hub"]
  with open(os.path.join(d, "config.json")) as f:
    native = json.load(f)
  c = config_from_hf(native)
  assert c.layer_windows == (0, 5, 5, 5, 5, 0)
  assert c.sliding_num_kv_heads == 2 and c.sliding_attention_sinks and not c.attention_sinks
  assert (c.rope_theta, c.sliding_rope_theta, c.rotary_dim) == (5e6, 1e2, 6)
  assert c.value_head_dim == 8 and c.attention_value_scale == 0.6
  assert c.layer_is_moe == (False,) + (True,) * 5
  assert config_from_hf(config_to_hf(c)) == c
  # The published hub config.json's spelling of the same model.
  hub = {
    k: v
    for k, v in native.items()
    if k not in ("layer_types", "mlp_layer_types", "rope_parameters", "sliding_window")
  }
  hub.update(
    hybrid_layer_pattern=[0, 1, 1, 1, 1, 0],
    moe_layer_freq=[0, 1, 1, 1, 1, 1],
    sliding_window_size=4,
    swa_num_key_value_heads=2,
    swa_num_attention_heads=4,
    swa_head_dim=12,
    swa_v_head_dim=8,
    rope_theta=5e6,
    swa_rope_theta=1e2,
    partial_rotary_factor=0.5,
    add_swa_attention_sink_bias=True,
    add_full_attention_sink_bias=False,
    layernorm_epsilon=native["rms_norm_eps"],
    scoring_func="sigmoid",
    topk_method="noaux_tc",
    n_shared_experts=None,
    routed_scaling_factor=None,
  )
  hub.pop("rms_norm_eps")
  assert config_from_hf(hub) == c


@pytest.mark.parametrize(
  "change, match",
  [
    ({"swa_head_dim": 16}, "swa_head_dim"),
    ({"swa_num_attention_heads": 8}, "swa_num_attention_heads"),
    ({"scoring_func": "softmax"}, "scoring_func"),
    ({"n_shared_experts": 1}, "n_shared_experts"),
    ({"attention_projection_layout": "fused_qkv"}, "attention_projection_layout"),
    ({"add_full_attention_sink_bias": True, "add_swa_attention_sink_bias": False}, "sink"),
    ({"hybrid_layer_pattern": [1, 1, 1, 1, 1, 1]}, "hybrid_layer_pattern"),
    ({"swa_rope_theta": 7.0}, "swa_rope_theta"),
  ],
)
def test_unsupported_or_conflicting_keys_are_refused_by_name(saved, change, match):
  _, d = saved["hub"]
  with open(os.path.join(d, "config.json")) as f:
    native = json.load(f)
  with pytest.raises(ConfigError, match=match):
    config_from_hf({**native, **change})


def test_value_scale_and_per_type_rope_are_what_the_logits_depend_on(saved):
  hf, d = saved["hub"]
  model = jaxspec.load_model(d, scan_layers=True)
  ids = _ids(model.config.vocab_size, seed=1)
  ref = hf_models.hf_logits(hf, ids)
  for broken in (
    dict(attention_value_scale=1.0),
    dict(sliding_rope_theta=model.config.rope_theta),
  ):
    wrong = np.asarray(model.with_config(**broken).logits(ids))
    assert np.abs(wrong - ref).max() > 1e-3, broken


def test_checkpoint_round_trip_through_transformers(saved, tmp_path):
  hf, d = saved["alternate"]
  model = jaxspec.load_model(d)
  jaxspec.save_hf(model, str(tmp_path))
  with safe_open(os.path.join(str(tmp_path), "model.safetensors"), "np") as f:
    names = set(f.keys())
  assert "model.layers.0.self_attn.attention_sink_bias" in names  # the published name
  assert "model.layers.1.self_attn.attention_sink_bias" not in names  # full: no sinks
  again = type(hf).from_pretrained(str(tmp_path), dtype=torch.float32).eval()
  ids = _ids(model.config.vocab_size, seed=2)
  np.testing.assert_allclose(
    hf_models.hf_logits(again, ids), hf_models.hf_logits(hf, ids), atol=1e-5
  )


def test_mtp_tensors_are_skipped_with_a_warning(saved, tmp_path):
  """The published checkpoint carries MTP layers under model.mtp.*, which transformers skips."""
  from safetensors.numpy import save_file  # pylint: disable=import-outside-toplevel

  _, d = saved["alternate"]
  with safe_open(os.path.join(d, "model.safetensors"), "np") as f:
    tensors = {k: f.get_tensor(k) for k in f.keys()}
  tensors["model.mtp.layers.0.enorm.weight"] = np.ones((32,), np.float32)
  save_file(tensors, os.path.join(str(tmp_path), "model.safetensors"))
  with open(os.path.join(d, "config.json")) as f, open(tmp_path / "config.json", "w") as g:
    g.write(f.read())
  with pytest.warns(UserWarning, match="model.mtp.layers.0.enorm.weight"):
    jaxspec.load_model(str(tmp_path))


def test_cached_greedy_decoding_equals_transformers_past_the_window(saved):
  hf, d = saved["hub"]
  model = jaxspec.load_model(d)
  prompt = _ids(model.config.vocab_size, (1, 7), seed=3)
  new = 12  # 19 positions: the window of 5 slides 3× over
  with torch.no_grad():
    want = hf.generate(
      torch.as_tensor(prompt),
      max_new_tokens=new,
      min_new_tokens=new,
      do_sample=False,
      pad_token_id=0,
      eos_token_id=None,
    )[0, 7:]
  engine = SpecEngine(model, None, EngineConfig(max_len=48, batch_size=1, use_eos=False))
  rings = [s for s in engine.empty_state().target_state.segments if isinstance(s, SlidingKV)]
  assert len(rings) == 1 and rings[0].max_len == 5 + 1  # layers 1-4: window + one token
  got = engine.generate([prompt[0].tolist()], max_new_tokens=new, temperature=0.0)
  near_ties.assert_greedy_match(model, prompt, [want.tolist()], [list(got.tokens[0])])


def test_speculative_decoding_is_lossless(saved):
  """DFlash chain and DDTree outputs equal plain greedy decoding past the window, batch 1 and
  4 (engines of 4 slots, compiled once; the sliding layers keep rings of window + verify)."""
  _, d = saved["hub"]
  target = jaxspec.load_model(d)
  drafter = drafter_models.small_dflash(target, target_layer_ids=(0, 3))
  check = drafter_models.GreedyCheck(target, drafter, max_len=48, batch_size=4)
  tree = SpecEngine(
    target, drafter, dataclasses.replace(check.cfg, verify="tree", tree_budget=6)
  )
  for batch in (1, 4):
    ps = drafter_models.prompts(batch, target.config.vocab_size)
    plain = check.plain.generate(ps, max_new_tokens=16)
    for engine in (check.spec, tree):
      spec = engine.generate(ps, max_new_tokens=16)
      near_ties.assert_greedy_match(target, ps, plain.tokens, spec.tokens)
      assert all(len(t) == 16 for t in spec.tokens)


def test_default_quantize_policy(saved):
  _, d = saved["hub"]
  q = jaxspec.quantize(jaxspec.load_model(d, scan_layers=True))
  attn = q.params["layers_1"]["self_attn"]  # a sliding run: sinks stay float
  mlp = q.params["layers_1"]["mlp"]
  assert attn["q_proj"]["kernel"].format == "fp8" and mlp["gate_proj"].format == "mxfp4"
  assert not isinstance(attn["sinks"], jaxspec.quant.QTensor)
  assert not isinstance(mlp["router"], jaxspec.quant.QTensor)
  ids = _ids(q.config.vocab_size, seed=4)
  assert np.isfinite(np.asarray(q.logits(ids))).all()
