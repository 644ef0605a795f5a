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
from jaxspec.models import target as target_lib

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
  "name", ["glm4moe_grouped_shared_partial", "qwen3moe_norm_mlponly", "qwen3_mha_tied"]
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
  names = hf_io._TensorSource(str(tmp_path)).keys()
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
  loaded = jaxspec.load_model(str(tmp_path))
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
  cfg["architectures"] = ["LlamaForCausalLM"]
  json.dump(cfg, open(small_ckpt / "config.json", "w"))
  with pytest.raises(jaxspec.ConfigError, match="LlamaForCausalLM"):
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
  back = jaxspec.load_model(str(tmp_path / "hf2"))
  for a, b in zip(_leaves(model.params), _leaves(back.params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
