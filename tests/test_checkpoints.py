"""HF checkpoint export/import, MTP layers, sharded safetensors and the errors on bad input."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
import transformers

import jaxspec
from jaxspec.config import ModelConfig
from jaxspec.io import hf as hf_io
from jaxspec.io import safetensors_files
from jaxspec.models import target as target_lib
from jaxspec.io.architectures import config_from_hf, config_to_hf

from tests import hf_models, near_ties


def _glm_with_mtp() -> ModelConfig:
  return ModelConfig(
    architecture="Glm4MoeForCausalLM",
    vocab_size=80,
    hidden_size=32,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    intermediate_size=48,
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=16,
    router="sigmoid",
    n_shared_experts=1,
    norm_topk_prob=True,
    layer_is_moe=(False, True),
    num_mtp_layers=1,
    partial_rotary_factor=0.5,
    routed_scaling_factor=1.5,
  )


@pytest.mark.parametrize(
  "name",
  [
    "glm4moe_grouped_shared_partial",
    "qwen3moe_norm_mlponly",
    "qwen3_mha_tied",
    *sorted(hf_models.MLA_CONFIGS),  # DeepSeek-V3 layout: MLA projections, latent norms
  ],
)
def test_save_hf_loads_in_transformers_with_same_logits(tmp_path, name):
  hf_model = hf_models.save_hf_model(name, str(tmp_path / "in"))
  model = jaxspec.load_model(str(tmp_path / "in"))
  jaxspec.save_hf(model, str(tmp_path / "out"))
  reloaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out")).float()
  ids = np.random.default_rng(0).integers(0, model.config.vocab_size, (2, 8))
  np.testing.assert_allclose(
    hf_models.hf_logits(reloaded, ids), hf_models.hf_logits(hf_model, ids), atol=1e-5
  )
  near_ties.assert_logits_match(
    model, ids, model.logits(ids), hf_models.hf_logits(reloaded, ids), atol=1e-4
  )


def test_mtp_layers_round_trip_in_deepseek_layout(tmp_path):
  model = target_lib.TargetModel.random(_glm_with_mtp(), seed=1)
  jaxspec.save_hf(model, str(tmp_path))
  config = json.load(open(tmp_path / "config.json"))
  assert config["num_nextn_predict_layers"] == 1
  names = safetensors_files.TensorSource(str(tmp_path)).keys()
  for suffix in (
    "enorm.weight",
    "hnorm.weight",
    "eh_proj.weight",
    "shared_head.norm.weight",
    "self_attn.q_proj.weight",
    "mlp.experts.3.down_proj.weight",
    "mlp.gate.e_score_correction_bias",
  ):
    assert f"model.layers.2.{suffix}" in names, suffix
  loaded = jaxspec.load_model(str(tmp_path), scan_layers=True)  # stacked, as `model`
  assert loaded.config.num_mtp_layers == 1
  same = [
    np.array_equal(a, b)
    for a, b in zip(*(map(np.asarray, _leaves(m.params)) for m in (model, loaded)))
  ]
  assert all(same) and len(same) > 20


def _leaves(tree):
  import jax  # pylint: disable=import-outside-toplevel

  return jax.tree_util.tree_leaves(tree)


def test_sharded_safetensors_with_index(tmp_path):
  model = target_lib.TargetModel.random(_glm_with_mtp(), seed=2)
  hf_io.save_hf(model, str(tmp_path), max_shard_bytes=20_000)
  files = sorted(f for f in os.listdir(tmp_path) if f.endswith(".safetensors"))
  assert len(files) > 2 and os.path.exists(tmp_path / hf_io.INDEX_FILE)
  loaded = jaxspec.load_model(str(tmp_path))
  ids = np.arange(12).reshape(2, 6) % 80
  np.testing.assert_array_equal(np.asarray(loaded.logits(ids)), np.asarray(model.logits(ids)))


@pytest.fixture
def small_ckpt(tmp_path):
  model = target_lib.TargetModel.random(_glm_with_mtp(), seed=0)
  jaxspec.save_hf(model, str(tmp_path))
  return tmp_path


def test_unsupported_architecture_is_named(small_ckpt):
  cfg = json.load(open(small_ckpt / "config.json"))
  cfg["architectures"] = ["PhiForCausalLM"]
  json.dump(cfg, open(small_ckpt / "config.json", "w"))
  with pytest.raises(jaxspec.ConfigError, match="PhiForCausalLM"):
    jaxspec.load_model(str(small_ckpt))


def test_unsupported_rope_scaling_is_refused(small_ckpt):
  cfg = json.load(open(small_ckpt / "config.json"))
  cfg["rope_parameters"] = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}
  json.dump(cfg, open(small_ckpt / "config.json", "w"))
  with pytest.raises(jaxspec.ConfigError, match="yarn"):
    jaxspec.load_model(str(small_ckpt))


def test_missing_weights_file(small_ckpt):
  os.remove(small_ckpt / "model.safetensors")
  with pytest.raises(jaxspec.CheckpointError, match="no model.safetensors"):
    jaxspec.load_model(str(small_ckpt))


def test_truncated_safetensors(small_ckpt):
  path = small_ckpt / "model.safetensors"
  data = path.read_bytes()
  path.write_bytes(data[: len(data) // 2])
  with pytest.raises(jaxspec.CheckpointError, match="truncated or corrupt"):
    jaxspec.load_model(str(small_ckpt))


def test_missing_tensor_is_listed(small_ckpt):
  from safetensors.numpy import load_file, save_file  # pylint: disable=import-outside-toplevel

  tensors = load_file(str(small_ckpt / "model.safetensors"))
  del tensors["model.layers.1.mlp.experts.2.up_proj.weight"]
  save_file(tensors, str(small_ckpt / "model.safetensors"))
  with pytest.raises(jaxspec.CheckpointError, match=r"experts\.2\.up_proj"):
    jaxspec.load_model(str(small_ckpt))


def test_wrong_shape_is_reported(small_ckpt):
  from safetensors.numpy import load_file, save_file  # pylint: disable=import-outside-toplevel

  tensors = load_file(str(small_ckpt / "model.safetensors"))
  tensors["model.layers.0.self_attn.k_proj.weight"] = np.zeros((8, 32), np.float32)
  save_file(tensors, str(small_ckpt / "model.safetensors"))
  with pytest.raises(jaxspec.CheckpointError, match=r"k_proj.weight has shape \[8, 32\]"):
    jaxspec.load_model(str(small_ckpt))


def test_missing_shard_named_in_index(tmp_path):
  model = target_lib.TargetModel.random(_glm_with_mtp(), seed=2)
  hf_io.save_hf(model, str(tmp_path), max_shard_bytes=20_000)
  victim = sorted(f for f in os.listdir(tmp_path) if f.endswith(".safetensors"))[1]
  os.remove(tmp_path / victim)
  with pytest.raises(jaxspec.CheckpointError, match=victim):
    jaxspec.load_model(str(tmp_path))


def test_missing_directory_and_config(tmp_path):
  with pytest.raises(jaxspec.CheckpointError, match="does not exist"):
    jaxspec.load_model(str(tmp_path / "nope"))
  with pytest.raises(jaxspec.CheckpointError, match="no config.json"):
    jaxspec.load_model(str(tmp_path))


def test_token_ids_outside_vocabulary():
  model = target_lib.TargetModel.random(_glm_with_mtp())
  with pytest.raises(jaxspec.InputError, match=r"outside the vocabulary \[0, 80\)"):
    model.logits([[1, 2, 80]])
  with pytest.raises(jaxspec.InputError, match="outside the vocabulary"):
    model.logits([[-1, 2]])
  with pytest.raises(jaxspec.InputError, match="integer"):
    model.logits([[0.5, 1.0]])


def test_bad_config_values_are_named():
  with pytest.raises(jaxspec.ConfigError, match="multiple of num_key_value_heads"):
    _glm_with_mtp().replace(num_kv_heads=3)
  with pytest.raises(jaxspec.ConfigError, match="num_experts_per_tok"):
    _glm_with_mtp().replace(num_experts_per_tok=9)


def test_orbax_checkpoint_round_trip_single_device(tmp_path):
  from jaxspec.io import checkpoint  # pylint: disable=import-outside-toplevel

  model = target_lib.TargetModel.random(_glm_with_mtp(), seed=4)
  checkpoint.save(model, str(tmp_path / "ckpt"))
  restored = checkpoint.restore(str(tmp_path / "ckpt"))
  assert restored.config == model.config
  for a, b in zip(_leaves(model.params), _leaves(restored.params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  shutil.rmtree(tmp_path / "ckpt" / "params")
  with pytest.raises(jaxspec.CheckpointError, match="not a jaxspec orbax checkpoint"):
    checkpoint.restore(str(tmp_path / "ckpt"))


def test_convert_script_round_trip(tmp_path):
  from jaxspec.io.checkpoint import convert  # pylint: disable=import-outside-toplevel

  model = target_lib.TargetModel.random(_glm_with_mtp(), seed=5)
  jaxspec.save_hf(model, str(tmp_path / "hf"))
  convert(str(tmp_path / "hf"), str(tmp_path / "orbax"), "orbax")
  convert(str(tmp_path / "orbax"), str(tmp_path / "hf2"), "hf")
  back = jaxspec.load_model(str(tmp_path / "hf2"), scan_layers=True)  # stacked, as `model`
  for a, b in zip(_leaves(model.params), _leaves(back.params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _glm_declaring_mtp(monkeypatch) -> str:
  """A GLM4-MoE config in hf_models that declares one MTP layer (transformers saves none)."""
  config_cls, model_cls, kwargs = hf_models.CONFIGS["glm4moe_grouped_shared_partial"]
  name = "glm4moe_declares_mtp"
  monkeypatch.setitem(
    hf_models.CONFIGS, name, (config_cls, model_cls, dict(kwargs, num_nextn_predict_layers=1))
  )
  return name


def test_declared_mtp_layers_absent_from_checkpoint_load_with_warning(tmp_path, monkeypatch):
  hf_model = hf_models.save_hf_model(_glm_declaring_mtp(monkeypatch), str(tmp_path))
  # What transformers writes: the declaration, but no model.layers.{num_hidden_layers}.* tensors.
  assert json.load(open(tmp_path / "config.json"))["num_nextn_predict_layers"] == 1
  names = safetensors_files.TensorSource(str(tmp_path)).keys()
  assert "model.layers.2.input_layernorm.weight" in names
  assert not any(n.startswith("model.layers.3.") for n in names)

  with pytest.warns(UserWarning, match="MTP drafting is unavailable") as record:
    model = jaxspec.load_model(str(tmp_path))
  message = next(str(w.message) for w in record if "MTP" in str(w.message))
  assert str(tmp_path) in message and "absent" in message
  assert model.config.num_mtp_layers == 0
  assert model.hf_config["num_nextn_predict_layers"] == 0
  assert not any(k.startswith("mtp_") for k in model.params)
  ids = np.random.default_rng(1).integers(0, model.config.vocab_size, (2, 8))
  near_ties.assert_logits_match(
    model, ids, model.logits(ids), hf_models.hf_logits(hf_model, ids), atol=1e-4
  )


def test_partially_present_mtp_layers_are_still_an_error(small_ckpt):
  from safetensors.numpy import load_file, save_file  # pylint: disable=import-outside-toplevel

  path = str(small_ckpt / "model.safetensors")
  full = load_file(path)
  partial = dict(full)
  del partial["model.layers.2.eh_proj.weight"]
  del partial["model.layers.2.mlp.experts.1.up_proj.weight"]
  save_file(partial, path)
  with pytest.raises(jaxspec.CheckpointError, match=r"layers\.2\.eh_proj\.weight") as err:
    jaxspec.load_model(str(small_ckpt))
  assert "layers.2.mlp.experts.1.up_proj.weight" in str(err.value)

  # Only the enorm weight left: still a partial MTP layer, not an absent one.
  save_file(
    {k: v for k, v in full.items() if not k.startswith("model.layers.2.")}
    | {"model.layers.2.enorm.weight": full["model.layers.2.enorm.weight"]},
    path,
  )
  with pytest.raises(jaxspec.CheckpointError, match=r"layers\.2\.hnorm\.weight"):
    jaxspec.load_model(str(small_ckpt))

  # An explicit num_mtp_layers asks for the layers: their absence is an error, not a warning.
  save_file({k: v for k, v in full.items() if not k.startswith("model.layers.2.")}, path)
  with pytest.raises(jaxspec.CheckpointError, match=r"layers\.2\.enorm\.weight"):
    jaxspec.load_model(str(small_ckpt), num_mtp_layers=1)


def test_replace_num_layers_rederives_glm_dense_first_layout():
  base = _glm_with_mtp().replace(
    num_layers=4, layer_is_moe=(False, False, True, True)
  )  # first_k_dense_replace = 2, passed explicitly with a consistent num_layers
  assert base.segments() == ((0, 2, False), (2, 2, True))

  shallow = base.replace(num_layers=3)
  assert shallow.layer_is_moe == (False, False, True)
  assert shallow.segments() == ((0, 2, False), (2, 1, True))
  deep = base.replace(num_layers=6)
  assert deep.layer_is_moe == (False, False, True, True, True, True)
  assert deep.segments() == ((0, 2, False), (2, 4, True))
  assert config_to_hf(deep)["first_k_dense_replace"] == 2
  dense_only = base.replace(num_layers=1)
  assert dense_only.segments() == ((0, 1, False),)
  # The rule survives a depth with no MoE layer: GLM keeps first_k_dense_replace layers dense.
  assert dense_only.replace(num_layers=3).layer_is_moe == (False, True, True)

  ids = np.arange(10).reshape(2, 5) % 80
  for config, n in ((deep, 6), (dense_only, 1)):  # the grown stack, and no MoE run at all
    model = target_lib.TargetModel.random(config, seed=3)
    assert model.config.num_layers == n and model.config.num_mtp_layers == 1
    stacked = [model.params[f"layers_{s}"] for s in range(len(config.segments()))]
    assert [_leaves(p)[0].shape[0] for p in stacked] == [k for _, k, _ in config.segments()]
    logits = np.asarray(model.logits(ids))
    assert logits.shape == (2, 5, 80) and np.isfinite(logits).all()


def test_replace_num_layers_with_inconsistent_layer_is_moe_names_both():
  with pytest.raises(jaxspec.ConfigError, match="layer_is_moe has 2 entries but num_layers is 3"):
    _glm_with_mtp().replace(num_layers=3, layer_is_moe=(False, True))
  with pytest.raises(jaxspec.ConfigError, match="num_layers"):
    _glm_with_mtp().replace(layer_is_moe=(False, True, True))


@pytest.mark.parametrize(
  "name, grown",
  [
    ("qwen3moe_nonorm_step2_tied", (False, True, False, True, False, True)),
    ("qwen3moe_norm_mlponly", (False, True, True, True, True, True)),
  ],
)
def test_replace_num_layers_follows_qwen3moe_sparse_step(name, grown):
  config_cls, _, kwargs = hf_models.CONFIGS[name]
  hf = getattr(transformers, config_cls)(**kwargs).to_dict()
  hf["architectures"] = ["Qwen3MoeForCausalLM"]
  config = config_from_hf(hf)
  assert config_from_hf(config_to_hf(config)) == config
  n = config.num_layers
  assert config.layer_is_moe == grown[:n]
  assert config.replace(num_layers=6).layer_is_moe == grown
  assert config.replace(num_layers=2).layer_is_moe == grown[:2]
  assert config.replace(num_layers=6).replace(num_layers=n) == config
  wide = config.replace(num_layers=6)
  assert config_from_hf(config_to_hf(wide)) == wide
  model = target_lib.TargetModel.random(wide, seed=0)
  assert np.isfinite(np.asarray(model.logits([[1, 2, 3]]))).all()


# Kimi-K2.5: a DeepSeek-V3 text model (text_config) wrapped with a vision tower and projector.
_KIMI_VISION = dict(
  patch_size=4,
  pos_emb_height=4,
  pos_emb_width=4,
  pos_emb_time=2,
  num_attention_heads=2,
  num_hidden_layers=1,
  hidden_size=16,
  intermediate_size=24,
)


def _published_kimi_name(name: str) -> str:
  """transformers' in-memory Kimi-K2.5 name → the published checkpoints' (LLaVA-style) one."""
  for ours, theirs in (
    ("model.language_model.", "language_model.model."),
    ("lm_head.", "language_model.lm_head."),
    ("model.vision_tower.", "vision_tower.encoder."),
    ("model.mm_projector.", "mm_projector."),
  ):
    if name.startswith(ours):
      return theirs + name[len(ours) :]
  return name


def _per_expert(state: dict) -> dict:
  """transformers' fused in-memory experts (`experts.gate_up_proj` [E, 2I, H], `down_proj`
  [E, H, I]) → the per-expert tensors checkpoints store (`experts.{e}.gate_proj.weight`, ...)."""
  out = {}
  for k, v in state.items():
    if k.endswith("mlp.experts.gate_up_proj"):
      half = v.shape[1] // 2
      for e in range(v.shape[0]):
        out[k.replace("gate_up_proj", f"{e}.gate_proj.weight")] = v[e, :half]
        out[k.replace("gate_up_proj", f"{e}.up_proj.weight")] = v[e, half:]
    elif k.endswith("mlp.experts.down_proj"):
      for e in range(v.shape[0]):
        out[k.replace("down_proj", f"{e}.down_proj.weight")] = v[e]
    else:
      out[k] = v
  return out


@pytest.fixture(scope="module")
def kimi_k25(tmp_path_factory):
  """HF Kimi_K25ForConditionalGeneration and {layout: checkpoint dir} of its tensors under
  transformers' names (`model.language_model.*`) and under the published checkpoints' names
  (`language_model.model.*`, remote-code architecture name, text_config model_type kimi_k2).
  Written from the state dict: transformers 5.24's save_pretrained mangles this model's text
  q_proj (its vision `wqkv` conversion reversed onto it)."""
  from safetensors.numpy import save_file  # pylint: disable=import-outside-toplevel

  text = dict(hf_models.MLA_CONFIGS["deepseek_v3_plainq_flat"][2])
  tied = text.pop("tie_word_embeddings")
  hf_model = hf_models.build_hf_model_from(
    "Kimi_K25Config",
    "Kimi_K25ForConditionalGeneration",
    dict(
      text_config=text,
      vision_config=_KIMI_VISION,
      projection_hidden_size=16,
      tie_word_embeddings=tied,
    ),
  )
  state = _per_expert({k: v.detach().numpy().copy() for k, v in hf_model.state_dict().items()})
  cfg = hf_model.config.to_dict()
  dirs = {}
  for layout in ("transformers", "published"):
    d = str(tmp_path_factory.mktemp(f"kimi_{layout}"))
    names = (lambda k: k) if layout == "transformers" else _published_kimi_name
    save_file({names(k): v for k, v in state.items()}, os.path.join(d, "model.safetensors"))
    c = dict(cfg, architectures=["Kimi_K25ForConditionalGeneration"])  # what a save writes
    if layout == "published":
      c["architectures"] = ["KimiK25ForConditionalGeneration"]
      c["text_config"] = dict(c["text_config"], model_type="kimi_k2")
    with open(os.path.join(d, "config.json"), "w") as f:
      json.dump(c, f)
    dirs[layout] = d
  return hf_model, dirs


@pytest.mark.parametrize("layout", ["transformers", "published"])
def test_kimi_k25_checkpoint_loads_its_text_model(kimi_k25, layout):
  hf_model, dirs = kimi_k25
  with pytest.warns(UserWarning, match=r"vision-tower tensor\(s\) \(.*vision_tower\.\*"):
    model = jaxspec.load_model(dirs[layout])
  assert model.config.architecture == "DeepseekV3ForCausalLM" and model.config.is_mla
  assert not model.config.tie_word_embeddings and model.config.num_layers == 2
  ids = np.random.default_rng(5).integers(0, model.config.vocab_size, (2, 9))
  ref = hf_models.hf_logits(hf_model, ids)  # text-only input: the VL model's text path
  near_ties.assert_logits_match(model, ids, np.asarray(model.logits(ids)), ref, atol=1e-4)
