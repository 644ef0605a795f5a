"""Model configs and checkpoints are validated once, at load, with one-line named errors (issue 12).

Every case goes through the public API (`jaxspec.load_model`, `jaxspec.load_drafter`,
`jaxspec.io.checkpoint.convert`, `jaxspec.ModelConfig`) on tiny checkpoints written to tmp_path,
and asserts the exact error class and the field, tensor or file the message names.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil

import numpy as np
import pytest
import transformers
from safetensors.numpy import load_file, save_file

import jaxspec
from jaxspec.drafters.eagle3 import Eagle3Drafter
from jaxspec.io import checkpoint
from jaxspec.io import hf as hf_io
from jaxspec.io.architectures import config_from_hf, config_to_hf

from tests import hf_models
from tests.drafter_models import small_dflash, small_target

CONFIG = "config.json"
TENSORS = "model.safetensors"


@pytest.fixture(scope="module")
def target():
  return small_target(num_layers=3)


@pytest.fixture(scope="module")
def saved(tmp_path_factory, target):
  """name → a pristine checkpoint directory; tests mutate copies (`_copy`)."""
  root = tmp_path_factory.mktemp("pristine")
  jaxspec.save_hf(target, str(root / "target"))
  hf_io.save_hf(target, str(root / "sharded"), max_shard_bytes=8_000)
  jaxspec.save_drafter(small_dflash(target), str(root / "dflash"))
  eagle = Eagle3Drafter.random(target, target_layer_ids=(0, 1, 2), seed=2)
  jaxspec.save_drafter(eagle, str(root / "eagle3"))
  return {name: str(root / name) for name in ("target", "sharded", "dflash", "eagle3")}


def _copy(saved, name, tmp_path) -> str:
  dst = str(tmp_path / name)
  shutil.copytree(saved[name], dst)
  return dst


def _edit_json(path: str, edit) -> None:
  with open(path) as f:
    data = json.load(f)
  out = edit(data)
  with open(path, "w") as f:
    json.dump(data if out is None else out, f)


def _edit_tensors(model_dir: str, edit) -> None:
  path = os.path.join(model_dir, TENSORS)
  tensors = load_file(path)
  edit(tensors)
  save_file(tensors, path)


def _raises(error, fragment, fn, *args, **kwargs) -> str:
  """Runs fn; asserts exactly `error`, a one-line message containing `fragment`; returns it."""
  with pytest.raises(error, match=re.escape(fragment)) as info:
    fn(*args, **kwargs)
  assert type(info.value) is error, f"{type(info.value).__name__}: {info.value}"
  message = str(info.value)
  assert "\n" not in message, message
  return message


# ------------------------------------------------------------------------------------------------
# 1-3. config.json: required fields, types, ranges, RoPE
# ------------------------------------------------------------------------------------------------


def _pop(*keys):
  """A config.json edit that deletes `keys`."""

  def edit(config):
    for key in keys:
      del config[key]

  return edit


def _set(**values):
  """A config.json edit that sets `values`."""
  return lambda config: config.update(values)


def _set_theta(theta):
  """Sets rope_theta in both places save_hf writes it, so that they agree."""

  def edit(config):
    config["rope_theta"] = theta
    config["rope_parameters"]["rope_theta"] = theta

  return edit


BAD_CONFIGS = {
  "missing_one": (_pop("hidden_size"), "missing required field(s): hidden_size"),
  "missing_three": (
    _pop("vocab_size", "num_hidden_layers", "intermediate_size"),
    "missing required field(s): vocab_size, num_hidden_layers, intermediate_size",
  ),
  "null_required": (_set(hidden_size=None), "null required field(s): hidden_size=null"),
  "string_int": (_set(hidden_size="32"), "hidden_size must be an integer, got '32'"),
  "bool_int": (_set(num_hidden_layers=True), "num_hidden_layers must be an integer, got True"),
  "fractional_int": (_set(head_dim=8.5), "head_dim must be an integer, got 8.5"),
  "float_int": (_set(intermediate_size=48.0), "intermediate_size must be an integer, got 48.0"),
  "string_bool": (
    _set(tie_word_embeddings="false"),
    "tie_word_embeddings must be true or false, got 'false'",
  ),
  "string_eos": (_set(eos_token_id=["0"]), "eos_token_id must be an integer or a list of integers"),
  "string_eps": (_set(rms_norm_eps="1e-6"), "rms_norm_eps must be a finite number, got '1e-6'"),
  "negative_eps": (_set(rms_norm_eps=-1), "rms_norm_eps must be positive, got -1.0"),
  "zero_eps": (_set(rms_norm_eps=0.0), "rms_norm_eps must be positive, got 0.0"),
  "nan_eps": (_set(rms_norm_eps=math.nan), "rms_norm_eps must be a finite number, got nan"),
  "zero_theta": (_set_theta(0.0), "rope_theta must be positive, got 0.0"),
  "inf_theta": (_set_theta(math.inf), "rope_theta must be a finite number, got inf"),
  "zero_heads": (_set(num_attention_heads=0), "num_heads (num_attention_heads) must be positive"),
  "negative_kv_heads": (
    _set(num_key_value_heads=-2),
    "num_kv_heads (num_key_value_heads) must be positive, got -2",
  ),
  "kv_heads_not_dividing": (
    _set(num_key_value_heads=3),
    "must be a multiple of num_key_value_heads",
  ),
  "zero_positions": (_set(max_position_embeddings=0), "max_position_embeddings must be positive"),
  "negative_eos": (_set(eos_token_id=-1), "eos token ids must be ≥ 0, got [-1]"),
  # YaRN and linear scaling are read (tests/test_rope_scaling.py); stated twice, they must agree.
  "yarn_in_rope_scaling_next_to_linear_parameters": (
    _set(
      rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
      rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
    ),
    "conflicting RoPE scaling",
  ),
  "legacy_type_key": (
    _set(rope_scaling={"type": "longrope", "factor": 2.0}),
    "RoPE type 'longrope' in rope_scaling",
  ),
  "yarn_without_its_original_length": (
    _set(rope_parameters={"rope_type": "yarn", "factor": 2.0, "rope_theta": 10000.0}),
    "yarn RoPE scaling needs original_max_position_embeddings",
  ),
  "per_layer_type_rope": (
    _set(rope_parameters={"full_attention": {"rope_type": "longrope", "factor": 8.0}}),
    "RoPE type 'longrope' in rope_parameters.full_attention",
  ),
  "rope_parameters_not_object": (
    _set(rope_parameters=[10000.0]),
    "rope_parameters must be a JSON object",
  ),
  "conflicting_theta": (
    _set(rope_theta=1e6),
    "conflicting rope_theta: rope_parameters.rope_theta=10000.0, rope_theta=1000000.0",
  ),
  "conflicting_theta_between_dicts": (
    _set(rope_scaling={"rope_type": "default", "rope_theta": 5e5}),
    "conflicting rope_theta: rope_parameters.rope_theta=10000.0, rope_scaling.rope_theta=500000.0",
  ),
  "sliding_window": (_set(use_sliding_window=True), "sliding-window attention"),
  "string_layer_types": (_set(layer_types="full_attention"), "layer_types must be a list"),
  "architectures_not_a_list": (
    _set(architectures="Qwen3ForCausalLM"),
    "unsupported architectures 'Qwen3ForCausalLM'",
  ),
}


@pytest.mark.parametrize("case", sorted(BAD_CONFIGS))
def test_bad_config_json_is_a_config_error_naming_file_and_field(saved, tmp_path, case):
  edit, fragment = BAD_CONFIGS[case]
  model_dir = _copy(saved, "target", tmp_path)
  _edit_json(os.path.join(model_dir, CONFIG), edit)
  message = _raises(jaxspec.ConfigError, fragment, jaxspec.load_model, model_dir)
  assert os.path.join(model_dir, CONFIG) in message


def test_config_json_that_is_not_an_object_or_not_json(saved, tmp_path):
  model_dir = _copy(saved, "target", tmp_path)
  path = os.path.join(model_dir, CONFIG)
  _edit_json(path, lambda c: [c])
  _raises(
    jaxspec.ConfigError,
    f"{path} must hold a JSON object, got a JSON list",
    jaxspec.load_model,
    model_dir,
  )
  # Unparseable (or undecodable) JSON is a damaged checkpoint: CheckpointError, naming the file.
  for data in (b'{"hidden_size": 32,', b"\xff\xfe{}"):
    with open(path, "wb") as f:
      f.write(data)
    _raises(jaxspec.CheckpointError, f"{path} is not readable JSON", jaxspec.load_model, model_dir)


def test_unknown_override_is_a_config_error(saved):
  message = _raises(
    jaxspec.ConfigError,
    "unknown ModelConfig field(s) moe_backnd",
    jaxspec.load_model,
    saved["target"],
    moe_backnd="dense",
  )
  assert CONFIG in message


BASE = dict(
  architecture="Qwen3ForCausalLM",
  vocab_size=16,
  hidden_size=16,
  num_layers=1,
  num_heads=2,
  num_kv_heads=1,
  head_dim=8,
  intermediate_size=16,
)


@pytest.mark.parametrize(
  "field, value, fragment",
  [
    ("vocab_size", 64.0, "vocab_size must be an integer, got 64.0"),
    ("hidden_size", True, "hidden_size must be an integer, got True"),
    ("num_layers", "2", "num_layers (num_hidden_layers) must be an integer, got '2'"),
    ("decoder_sparse_step", None, "decoder_sparse_step must be an integer, got None"),
    ("num_experts", -1, "num_experts must be ≥ 0, got -1"),
    ("num_mtp_layers", -1, "num_mtp_layers (num_nextn_predict_layers) must be ≥ 0"),
    ("intermediate_size", 0, "intermediate_size must be positive for the dense MLP layers"),
    ("rms_norm_eps", math.nan, "rms_norm_eps must be a finite number, got nan"),
    ("rms_norm_eps", -1e-6, "rms_norm_eps must be positive"),
    ("rope_theta", -1.0, "rope_theta must be positive"),
    ("rope_theta", math.inf, "rope_theta must be a finite number, got inf"),
    ("partial_rotary_factor", 1.5, "partial_rotary_factor must be in (0, 1], got 1.5"),
    ("routed_scaling_factor", 0.0, "routed_scaling_factor must be positive"),
    ("attention_bias", "yes", "attention_bias must be True or False, got 'yes'"),
    ("tie_word_embeddings", 1, "tie_word_embeddings must be True or False, got 1"),
    ("pad_token_id", 1.0, "pad_token_id must be an integer or None, got 1.0"),
    ("eos_token_ids", (1, "2"), "eos_token_ids must be a tuple of integers"),
  ],
)
def test_model_config_checks_every_numeric_field(field, value, fragment):
  _raises(jaxspec.ConfigError, fragment, jaxspec.ModelConfig, **{**BASE, field: value})


@pytest.mark.parametrize(
  "field, value, fragment",
  [
    ("param_dtype", "int8", "unsupported param_dtype 'int8'"),
    ("attention_chunk", 0, "attention_chunk must be positive, got 0"),
    ("linear_snapshots", 2.0, "linear_snapshots must be an integer, got 2.0"),
    ("scan_layers", 1, "scan_layers must be True or False, got 1"),
    ("moe_backend", "fast", "unknown moe_backend 'fast'"),
    ("ep_capacity_factor", math.inf, "ep_capacity_factor must be a finite number >= 0"),
    ("gmm_impl", "cuda", "unknown gmm_impl 'cuda'"),
  ],
)
def test_run_options_check_every_field(field, value, fragment):
  _raises(jaxspec.ConfigError, fragment, jaxspec.RunOptions, **{field: value})
  _raises(jaxspec.ConfigError, fragment, jaxspec.RunOptions().replace, **{field: value})


def test_run_options_are_not_config_fields():
  with pytest.raises(TypeError, match="attention_impl"):
    jaxspec.ModelConfig(**BASE, attention_impl="xla")
  config = jaxspec.ModelConfig(**BASE)
  _raises(
    jaxspec.ConfigError,
    "unknown ModelConfig field(s) moe_backend (run options: with_options)",
    config.replace,
    moe_backend="dense",
  )
  with pytest.raises(AttributeError):
    config.linear_chunk  # pylint: disable=pointless-statement
  # Run options: dtypes stay readable on the config, as drafter configs have them.
  config = jaxspec.ModelConfig(**BASE).with_options(attention_impl="xla", dtype="bfloat16")
  assert config.options.attention_impl == "xla" and config.dtype == "bfloat16"
  assert hash(config) != hash(config.with_options(attention_chunk=8))  # a different program


def test_replace_checks_types_and_names():
  config = jaxspec.ModelConfig(**BASE)
  _raises(jaxspec.ConfigError, "must be an integer, got 2.5", config.replace, num_layers=2.5)
  _raises(
    jaxspec.ConfigError, "unknown ModelConfig field(s) num_layer", config.replace, num_layer=2
  )


def _hf_dict(name: str) -> dict:
  """config.json as transformers 5 writes it for one of tests/hf_models' configurations."""
  config_cls, model_cls, kwargs = hf_models.CONFIGS[name]
  hf = getattr(transformers, config_cls)(**kwargs).to_dict()
  hf["architectures"] = [model_cls]
  return hf


def test_from_hf_accepts_transformers_dicts_and_refuses_hidden_rope_settings():
  glm = _hf_dict("glm4moe_grouped_shared_partial")
  config = config_from_hf(glm)
  assert config.partial_rotary_factor == 0.5 and config.rope_theta == 10000.0
  assert config_from_hf(config_to_hf(config)) == config
  # The headline case: yarn in the legacy key, which transformers prefers, next to a default
  # rope_parameters that used to hide it: now read (and refused when incomplete).
  yarn = dict(glm, rope_scaling={"rope_type": "yarn", "factor": 4.0})
  _raises(
    jaxspec.ConfigError,
    "yarn RoPE scaling needs original_max_position_embeddings",
    config_from_hf,
    yarn,
  )
  yarn["rope_scaling"]["original_max_position_embeddings"] = 64
  assert dict(config_from_hf(yarn).rope_scaling)["factor"] == 4.0
  # GLM rotates part of each head: the factor given twice must agree.
  partial = dict(glm, partial_rotary_factor=0.25)
  _raises(
    jaxspec.ConfigError,
    "conflicting partial_rotary_factor: rope_parameters.partial_rotary_factor=0.5, "
    "partial_rotary_factor=0.25",
    config_from_hf,
    partial,
  )
  # Qwen3 rotates whole heads and never reads the factor, so a stray one is not a conflict.
  qwen = _hf_dict("qwen3_gqa_bias_headdim")
  assert config_from_hf(dict(qwen, partial_rotary_factor=0.25)).rotary_dim == 16
  _raises(
    jaxspec.ConfigError,
    "decoder_sparse_step must be positive, got 0",
    config_from_hf,
    dict(_hf_dict("qwen3moe_norm_mlponly"), decoder_sparse_step=0),
  )
  _raises(jaxspec.ConfigError, "must hold a JSON object, got list", config_from_hf, [glm])


def test_every_built_architecture_has_one_mapping_module():
  from jaxspec.family import supported_architectures  # pylint: disable=import-outside-toplevel
  from jaxspec.io import architectures  # pylint: disable=import-outside-toplevel

  assert tuple(architectures.ARCHITECTURES) == supported_architectures()
  for name in hf_models.CONFIGS:
    hf = _hf_dict(name)
    config = config_from_hf(hf)
    assert architectures.ARCHITECTURES[config.architecture].name == hf["architectures"][0]
    assert config_from_hf(config_to_hf(config)) == config


# ------------------------------------------------------------------------------------------------
# 4. The shard index: JSON, weight_map, paths confined to the model directory
# ------------------------------------------------------------------------------------------------


def _index(model_dir: str) -> str:
  return os.path.join(model_dir, hf_io.INDEX_FILE)


def _outside_shard(tmp_path, saved) -> str:
  """A real shard file outside the model directory (so reading it would succeed)."""
  outside = tmp_path / "elsewhere"
  outside.mkdir()
  shard = sorted(f for f in os.listdir(saved["sharded"]) if f.endswith(".safetensors"))[0]
  shutil.copy(os.path.join(saved["sharded"], shard), outside / shard)
  return str(outside / shard)


@pytest.mark.parametrize(
  "case, fragment",
  [
    ("invalid_json", "is not readable JSON"),
    ("weight_map_list", "has no weight_map object"),
    ("no_weight_map", "has no weight_map object"),
    ("shard_not_a_string", "weight_map must map tensor names to shard file names"),
    ("dotdot", "is outside the model directory"),
    ("absolute", "is outside the model directory"),
    ("symlink_outside", "is outside the model directory"),
  ],
)
def test_bad_shard_index_is_a_checkpoint_error(saved, tmp_path, case, fragment):
  model_dir = _copy(saved, "sharded", tmp_path)
  index = _index(model_dir)
  with open(index) as f:
    data = json.load(f)
  weight_map = data["weight_map"]
  victim = sorted(weight_map)[0]
  outside = _outside_shard(tmp_path, saved)
  if case == "invalid_json":
    data = "{"
  elif case == "weight_map_list":
    data["weight_map"] = sorted(weight_map)
  elif case == "no_weight_map":
    del data["weight_map"]
  elif case == "shard_not_a_string":
    weight_map[victim] = 3
  elif case == "dotdot":
    weight_map[victim] = os.path.relpath(outside, model_dir)
  elif case == "absolute":
    weight_map[victim] = outside
  else:
    os.symlink(outside, os.path.join(model_dir, "link.safetensors"))
    weight_map[victim] = "link.safetensors"
  with open(index, "w") as f:
    f.write(data) if isinstance(data, str) else json.dump(data, f)
  message = _raises(jaxspec.CheckpointError, fragment, jaxspec.load_model, model_dir)
  assert index in message


def test_symlinks_inside_the_directory_and_into_the_hub_cache_load(saved, tmp_path, target):
  # The Hugging Face hub cache: snapshots/<rev>/* are symlinks into the repository's blobs/.
  repo = tmp_path / "models--org--tiny"
  (repo / "blobs").mkdir(parents=True)
  snapshot = repo / "snapshots" / "0123abc"
  snapshot.mkdir(parents=True)
  for name in os.listdir(saved["sharded"]):
    shutil.copy(os.path.join(saved["sharded"], name), repo / "blobs" / f"blob-{name}")
    os.symlink(os.path.join("..", "..", "blobs", f"blob-{name}"), snapshot / name)
  loaded = jaxspec.load_model(str(snapshot), scan_layers=True)  # the fixture's layout: exact logits
  ids = [[1, 2, 3, 4]]
  np.testing.assert_array_equal(np.asarray(loaded.logits(ids)), np.asarray(target.logits(ids)))


def test_drafter_index_is_confined_too(saved, tmp_path, target):
  model_dir = _copy(saved, "dflash", tmp_path)
  names = load_file(os.path.join(model_dir, TENSORS))
  (tmp_path / "elsewhere").mkdir()
  shutil.move(os.path.join(model_dir, TENSORS), tmp_path / "elsewhere" / TENSORS)
  with open(_index(model_dir), "w") as f:
    json.dump({"weight_map": {n: f"../elsewhere/{TENSORS}" for n in names}}, f)
  _raises(
    jaxspec.CheckpointError,
    f"shard path '../elsewhere/{TENSORS}' is outside the model directory",
    jaxspec.load_drafter,
    model_dir,
    target,
  )


# ------------------------------------------------------------------------------------------------
# 5. Tensors the layout does not use
# ------------------------------------------------------------------------------------------------


def test_unknown_target_tensors_are_named_with_a_count(saved, tmp_path):
  model_dir = _copy(saved, "target", tmp_path)
  extra = {f"model.layers.0.mlp.bogus_{i:02d}.weight": np.zeros(2, np.float32) for i in range(12)}
  _edit_tensors(model_dir, lambda t: t.update(extra))
  message = _raises(
    jaxspec.CheckpointError,
    "has 12 tensor(s) the config does not use",
    jaxspec.load_model,
    model_dir,
  )
  assert "model.layers.0.mlp.bogus_00.weight" in message and "(and 7 more)" in message


def test_layers_past_the_config_are_an_error_unless_fewer_were_asked_for(saved, tmp_path):
  model_dir = _copy(saved, "target", tmp_path)
  _edit_json(os.path.join(model_dir, CONFIG), _set(num_hidden_layers=2))
  _raises(
    jaxspec.CheckpointError,
    "'model.layers.2.input_layernorm.weight'",
    jaxspec.load_model,
    model_dir,
  )
  # Asking for fewer layers than stored (an override) skips the rest, with a warning.
  _copy(saved, "target", tmp_path / "again")
  with pytest.warns(UserWarning, match=r"ignoring \d+ tensor\(s\).*model\.layers\.2\."):
    model = jaxspec.load_model(str(tmp_path / "again" / "target"), num_layers=2)
  assert model.config.num_layers == 2


def test_bias_tensors_the_config_turns_off_are_an_error(saved, tmp_path):
  model_dir = _copy(saved, "target", tmp_path)
  _edit_tensors(
    model_dir,
    lambda t: t.update({"model.layers.1.self_attn.q_proj.bias": np.zeros(32, np.float32)}),
  )
  _raises(jaxspec.CheckpointError, "self_attn.q_proj.bias", jaxspec.load_model, model_dir)


def test_redundant_tensors_of_published_layouts_warn(saved, tmp_path, target):
  model_dir = _copy(saved, "target", tmp_path)
  inv_freq = "model.layers.0.self_attn.rotary_emb.inv_freq"
  _edit_tensors(model_dir, lambda t: t.update({inv_freq: np.ones(4, np.float32)}))
  with pytest.warns(UserWarning, match=re.escape(inv_freq)):
    jaxspec.load_model(model_dir)
  # A tied model whose checkpoint still carries lm_head.weight: transformers ignores it too.
  _edit_json(os.path.join(model_dir, CONFIG), _set(tie_word_embeddings=True))
  with pytest.warns(UserWarning, match="lm_head.weight"):
    tied = jaxspec.load_model(model_dir)
  assert tied.config.tie_word_embeddings and "lm_head" not in tied.params


def test_drafter_inv_freq_warns_and_unknown_tensor_raises(saved, tmp_path, target):
  model_dir = _copy(saved, "dflash", tmp_path)
  _edit_tensors(
    model_dir,
    lambda t: t.update({"layers.0.self_attn.rotary_emb.inv_freq": np.ones(4, np.float32)}),
  )
  with pytest.warns(UserWarning, match="rotary_emb.inv_freq"):
    jaxspec.load_drafter(model_dir, target)
  _edit_tensors(
    model_dir, lambda t: t.update({"layers.0.mlp.bogus.weight": np.ones(4, np.float32)})
  )
  _raises(
    jaxspec.CheckpointError,
    "this drafter layout does not use (another architecture or config?): "
    "['layers.0.mlp.bogus.weight']",
    jaxspec.load_drafter,
    model_dir,
    target,
  )


# ------------------------------------------------------------------------------------------------
# 6. Non-finite weights
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_target_weight_is_named(saved, tmp_path, bad):
  model_dir = _copy(saved, "target", tmp_path)
  name = "model.layers.1.mlp.down_proj.weight"
  _edit_tensors(model_dir, lambda t: t[name].__setitem__((3, 5), bad))
  _raises(jaxspec.CheckpointError, f"tensor {name} in ", jaxspec.load_model, model_dir)


def test_weight_overflowing_param_dtype_is_named(saved, tmp_path):
  model_dir = _copy(saved, "target", tmp_path)
  name = "model.layers.0.self_attn.o_proj.weight"
  _edit_tensors(model_dir, lambda t: t[name].__setitem__((0, 0), 1e6))
  assert jaxspec.load_model(model_dir).config.param_dtype == "float32"
  _raises(
    jaxspec.CheckpointError,
    f"tensor {name} in {os.path.join(model_dir, TENSORS)} overflows param_dtype float16",
    jaxspec.load_model,
    model_dir,
    options=jaxspec.RunOptions(param_dtype="float16"),
  )


def test_non_finite_drafter_weight_is_named(saved, tmp_path, target):
  model_dir = _copy(saved, "eagle3", tmp_path)
  _edit_tensors(model_dir, lambda t: t["midlayer.mlp.up_proj.weight"].__setitem__((0, 0), np.nan))
  _raises(
    jaxspec.CheckpointError,
    "tensor midlayer.mlp.up_proj.weight in",
    jaxspec.load_drafter,
    model_dir,
    target,
  )


# ------------------------------------------------------------------------------------------------
# Drafter config.json
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
  "name, edit, error, fragment",
  [
    (
      "dflash",
      _pop("num_hidden_layers"),
      jaxspec.ConfigError,
      "missing required field(s): num_hidden_layers",
    ),
    (
      "dflash",
      _set(hidden_size="128"),
      jaxspec.ConfigError,
      "hidden_size must be an integer, got '128'",
    ),
    ("dflash", _set(block_size=4.5), jaxspec.ConfigError, "block_size must be an integer, got 4.5"),
    (
      "dflash",
      lambda c: c["dflash_config"].update(mask_token_id=None),
      jaxspec.ConfigError,
      "dflash_config.mask_token_id is missing",
    ),
    (
      "dflash",
      _set(rope_scaling={"rope_type": "yarn", "factor": 4.0}),  # read, but incomplete
      jaxspec.ConfigError,
      "yarn RoPE scaling needs original_max_position_embeddings",
    ),
    (
      "dflash",
      _set(rope_scaling={"rope_type": "longrope", "factor": 4.0}),
      jaxspec.ConfigError,
      "RoPE type 'longrope' in rope_scaling",
    ),
    ("eagle3", _set(rms_norm_eps=0), jaxspec.ConfigError, "rms_norm_eps must be positive, got 0.0"),
    (
      "eagle3",
      _set(vocab_size=None),
      jaxspec.ConfigError,
      "null required field(s): vocab_size=null",
    ),
    ("eagle3", _set(fc_norm="no"), jaxspec.ConfigError, "fc_norm must be true or false, got 'no'"),
    ("eagle3", lambda c: [c], jaxspec.ConfigError, "must hold a JSON object, got a JSON list"),
    (
      "eagle3",
      _set(architectures="x"),
      jaxspec.ConfigError,
      "architectures must be a list of strings",
    ),
  ],
)
def test_bad_drafter_config_is_a_config_error(saved, tmp_path, target, name, edit, error, fragment):
  model_dir = _copy(saved, name, tmp_path)
  _edit_json(os.path.join(model_dir, CONFIG), edit)
  _raises(error, fragment, jaxspec.load_drafter, model_dir, target)


# ------------------------------------------------------------------------------------------------
# 7. convert and the orbax path
# ------------------------------------------------------------------------------------------------


def test_convert_refuses_bad_input_before_loading(saved, tmp_path):
  dst = str(tmp_path / "out")
  _raises(
    jaxspec.CheckpointError,
    "'/nonexistent/model' does not exist",
    checkpoint.convert,
    "/nonexistent/model",
    dst,
    "hf",
  )
  (tmp_path / "empty").mkdir()
  _raises(
    jaxspec.CheckpointError,
    "holds neither a HF checkpoint (config.json) nor a jaxspec orbax checkpoint (params/)",
    checkpoint.convert,
    str(tmp_path / "empty"),
    dst,
    "orbax",
  )
  _raises(
    jaxspec.ConfigError,
    "unknown checkpoint format 'gguf'",
    checkpoint.convert,
    saved["target"],
    dst,
    "gguf",
  )
  _raises(
    jaxspec.ConfigError,
    "unsupported dtype 'int8'",
    checkpoint.convert,
    saved["target"],
    dst,
    "hf",
    dtype="int8",
  )
  (tmp_path / "file").write_text("")
  _raises(
    jaxspec.CheckpointError,
    "exists and is not a directory",
    checkpoint.convert,
    saved["target"],
    str(tmp_path / "file"),
    "hf",
  )
  assert not os.path.exists(dst)


def test_orbax_checkpoint_that_does_not_match_its_config(saved, tmp_path):
  orbax_dir = str(tmp_path / "orbax")
  checkpoint.convert(saved["target"], orbax_dir, "orbax")
  _edit_json(os.path.join(orbax_dir, CONFIG), _set(intermediate_size=64))
  _raises(
    jaxspec.CheckpointError,
    "cannot restore",
    checkpoint.convert,
    orbax_dir,
    str(tmp_path / "hf"),
    "hf",
  )
  _edit_json(os.path.join(orbax_dir, CONFIG), _pop("vocab_size"))
  message = _raises(
    jaxspec.ConfigError, "missing required field(s): vocab_size", checkpoint.restore, orbax_dir
  )
  assert os.path.join(orbax_dir, CONFIG) in message
