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

import numpy as np
import pytest
import torch
from safetensors import safe_open

import jaxspec
from jaxspec.errors import ConfigError
from jaxspec.io.architectures import config_from_hf, config_to_hf
from jaxspec.speculative.engine import SpecEngine
from jaxspec.speculative.engine_config import EngineConfig
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


def test_cached_greedy_decoding_is_transformers_full_forward_argmax(saved):
  """A prompt three windows long that holds token 0 (an ordinary token: transformers'
  `generate` with pad_token_id=0 and no mask drops it, see near_ties); the oracle is
  transformers' uncached forward over prompt + output."""
  hf, d = saved["hub"]
  model = jaxspec.load_model(d)
  prompt = _ids(model.config.vocab_size, (1, 15), seed=7)
  assert 0 in prompt
  new = 12  # 27 positions: the window of 5 slides 5× over
  engine = SpecEngine(model, None, EngineConfig(max_len=48, batch_size=1, use_eos=False))
  rings = [s for s in engine.empty_state().target_state.segments if isinstance(s, SlidingKV)]
  assert len(rings) == 1 and rings[0].max_len == 5 + 1  # layers 1-4: window + one token
  got = engine.generate([prompt[0].tolist()], max_new_tokens=new, temperature=0.0)
  assert len(got.tokens[0]) == new
  near_ties.assert_greedy_is_full_forward_argmax(hf, prompt[0], got.tokens[0], model)


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


# -- MTP layers (model.mtp.layers.{k}.*: a sliding-window block with a dense MLP) ----------------

MTP_LAYERS = 2


def _mtp_tensors(config: dict, k: int, rng: np.random.Generator) -> dict:
  """Random tensors of MTP layer k under the published names (vLLM's / SGLang's MiMo MTP
  loaders read these: enorm, hnorm, eh_proj, final_layernorm beside a decoder block whose MLP
  norm is `pre_mlp_layernorm`)."""
  names = ("hidden_size", "num_attention_heads", "head_dim", "v_head_dim")
  h, heads, hd, vd = (config[n] for n in names)
  kv, inter = 2 * config["num_key_value_heads"], config["intermediate_size"]
  shapes = {
    "enorm.weight": (h,),
    "hnorm.weight": (h,),
    "eh_proj.weight": (h, 2 * h),
    "final_layernorm.weight": (h,),
    "input_layernorm.weight": (h,),
    "pre_mlp_layernorm.weight": (h,),
    "self_attn.q_proj.weight": (heads * hd, h),
    "self_attn.k_proj.weight": (kv * hd, h),
    "self_attn.v_proj.weight": (kv * vd, h),
    "self_attn.o_proj.weight": (h, heads * vd),
    "self_attn.attention_sink_bias": (heads,),
    "mlp.gate_proj.weight": (inter, h),
    "mlp.up_proj.weight": (inter, h),
    "mlp.down_proj.weight": (h, inter),
  }
  out = {}
  for name, shape in shapes.items():
    norm = name.endswith("norm.weight")
    x = 1.0 + 0.2 * rng.standard_normal(shape) if norm else 0.15 * rng.standard_normal(shape)
    out[f"model.mtp.layers.{k}.{name}"] = x.astype(np.float32)
  return out


@pytest.fixture(scope="module")
def with_mtp(saved, tmp_path_factory):
  """(HF main model, dir of its checkpoint with MTP_LAYERS MTP layers added, the tensors)."""
  from safetensors.numpy import save_file  # pylint: disable=import-outside-toplevel

  hf, d = saved["hub"]
  out = str(tmp_path_factory.mktemp("mimo_mtp"))
  with open(os.path.join(d, "config.json")) as f:
    config = json.load(f)
  with safe_open(os.path.join(d, "model.safetensors"), "np") as f:
    tensors = {k: f.get_tensor(k) for k in f.keys()}
  rng = np.random.default_rng(7)
  mtp = {}
  for k in range(MTP_LAYERS):
    mtp.update(_mtp_tensors(CONFIGS["hub"], k, rng))
  save_file({**tensors, **mtp}, os.path.join(out, "model.safetensors"))
  with open(os.path.join(out, "config.json"), "w") as f:
    json.dump({**config, "num_nextn_predict_layers": MTP_LAYERS}, f)
  return hf, out, mtp


def _mtp_reference(hf, mtp: dict, k: int, tokens: np.ndarray, prev: np.ndarray) -> np.ndarray:
  """MTP layer k by transformers' own MiMo pieces: its RMSNorm for enorm / hnorm, then a
  one-layer MiMo model (one sliding layer, dense MLP: the MTP block, its norm as the final
  layernorm) run on inputs_embeds = eh_proj([enorm(embed(t)); hnorm(h)]), then the LM head."""
  import transformers  # pylint: disable=import-outside-toplevel
  from transformers.models.mimo_v2_flash import modeling_mimo_v2_flash as m  # pylint: disable=all

  cfg = dict(CONFIGS["hub"], num_hidden_layers=1, layer_types=["sliding_attention"])
  cfg["mlp_layer_types"] = ["dense"]
  one = transformers.MiMoV2FlashForCausalLM(transformers.MiMoV2FlashConfig(**cfg)).float().eval()
  p = f"model.mtp.layers.{k}."
  t = lambda name: torch.as_tensor(mtp[p + name])
  block = ("input_layernorm", "pre_mlp_layernorm", "self_attn", "mlp")
  renames = (
    (p, "model.layers.0."),
    ("pre_mlp_layernorm", "post_attention_layernorm"),
    ("attention_sink_bias", "sinks"),
  )
  state = {}
  for name, v in mtp.items():
    if name.startswith(p) and name[len(p) :].split(".")[0] in block:
      for old, new in renames:
        name = name.replace(old, new)
      state[name] = torch.as_tensor(v)
  state["model.norm.weight"] = t("final_layernorm.weight")
  state["model.embed_tokens.weight"] = hf.model.embed_tokens.weight.detach()
  state["lm_head.weight"] = hf.lm_head.weight.detach()
  missing, unexpected = one.load_state_dict(state, strict=False)
  assert not unexpected and all("rotary" in n for n in missing), (missing, unexpected)
  eps = hf.config.rms_norm_eps
  norm = lambda w: m.MiMoV2FlashRMSNorm(w.shape[0], eps).eval()
  enorm, hnorm = norm(t("enorm.weight")), norm(t("hnorm.weight"))
  with torch.no_grad():
    enorm.weight.copy_(t("enorm.weight"))
    hnorm.weight.copy_(t("hnorm.weight"))
    emb = hf.model.embed_tokens(torch.as_tensor(tokens))
    x = torch.cat([enorm(emb), hnorm(torch.as_tensor(prev))], dim=-1) @ t("eh_proj.weight").T
    return one(inputs_embeds=x).logits.float().numpy()


def test_mtp_layers_load_in_the_published_layout_and_round_trip(with_mtp, tmp_path):
  _, d, mtp = with_mtp
  model = jaxspec.load_model(d)
  assert model.config.num_mtp_layers == MTP_LAYERS and model.config.mtp_sliding
  jaxspec.save_hf(model, str(tmp_path))
  with safe_open(os.path.join(str(tmp_path), "model.safetensors"), "np") as f:
    for name, x in mtp.items():
      np.testing.assert_array_equal(f.get_tensor(name), x)


def test_mtp_layer_equals_transformers_pieces(with_mtp):
  """Each MTP layer's logits (cache-free, 13 tokens: past the window of 5) against the
  reference built from transformers' MiMo modules; a wrong RoPE base for the block (the full
  layers' instead of the sliding layers') is caught."""
  from jaxspec.models import target as target_lib  # pylint: disable=import-outside-toplevel

  hf, d, mtp = with_mtp
  model = jaxspec.load_model(d)
  rng = np.random.default_rng(5)
  tokens = rng.integers(0, model.config.vocab_size, (2, 13))
  prev = rng.standard_normal((2, 13, model.config.hidden_size)).astype(np.float32)
  for k in range(MTP_LAYERS):
    ref = _mtp_reference(hf, mtp, k, tokens, prev)
    got, _, _ = target_lib.apply_mtp(model.config, model.params, k, tokens, prev)
    np.testing.assert_allclose(np.asarray(got), ref, atol=1e-4)
  wrong = model.with_config(sliding_rope_theta=model.config.rope_theta)
  bad, _, _ = target_lib.apply_mtp(wrong.config, wrong.params, 0, tokens, prev)
  assert np.abs(np.asarray(bad) - _mtp_reference(hf, mtp, 0, tokens, prev)).max() > 1e-3


# CI runs DDTree over DFlash and the MTP chain (one compile each); the other two pairs are
# slow-marked.
@pytest.mark.parametrize(
  "engine_pairs",
  [
    (("dflash", "tree"), ("mtp", "chain")),
    pytest.param((("dflash", "chain"), ("mtp", "tree")), marks=pytest.mark.slow),
  ],
)
def test_speculative_decoding_is_lossless(with_mtp, engine_pairs):
  """Greedy speculation equals plain decoding past the window, batch 1 and 4: DFlash chain and
  DDTree, and the MTP drafter (the first MTP layer chained γ = 3 times) chain and tree. One
  plain engine and engines of 4 slots, compiled once; the sliding layers keep rings of window
  + verify width."""
  _, d, _ = with_mtp
  target = jaxspec.load_model(d)
  cfg = EngineConfig(max_len=48, batch_size=4, use_eos=False)
  verify = {"chain": cfg, "tree": dataclasses.replace(cfg, verify="tree", tree_budget=6)}
  drafters = {
    "dflash": lambda: drafter_models.small_dflash(target, target_layer_ids=(0, 3)),
    "mtp": lambda: jaxspec.MTPDrafter.from_target(target, gamma=3),
  }
  plain = SpecEngine(target, None, cfg)
  engines = [SpecEngine(target, drafters[d](), verify[v]) for d, v in engine_pairs]
  for batch in (1, 4):
    ps = drafter_models.prompts(batch, target.config.vocab_size)
    want = plain.generate(ps, max_new_tokens=12)
    for engine in engines:
      got = engine.generate(ps, max_new_tokens=12)
      near_ties.assert_greedy_match(target, ps, want.tokens, got.tokens)
      assert all(len(t) == 12 for t in got.tokens)
