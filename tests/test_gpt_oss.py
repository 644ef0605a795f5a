"""gpt-oss targets (GptOssForCausalLM) against transformers on a small random configuration.

The configuration (tests/hf_models.py, "gptoss_sliding_sinks") has a sliding window of 4 on
layers 0 and 2 and full attention on layer 1, per-head sinks, biased q/k/v/o, a biased top-k
router, biased experts with gpt-oss's clamped SwiGLU and YaRN RoPE, so sequences of 11+
tokens exercise every piece. Its float logits are checked against transformers with every
MoE backend in tests/test_models.py, and tests/test_conformance.py's "gpt_oss" row runs the
checks every family gets (logits, config round trip, refused keys, save_hf → transformers,
greedy decoding against transformers' full forward, the planner); here: the MXFP4 checkpoint
jaxspec writes (what transformers loads and dequantizes), the decoding state (windows over
cached slots, chunked prefix reads), greedy and speculative decoding of the MXFP4 target
with a DFlash drafter in its published layout, and the errors.
"""

from __future__ import annotations

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from safetensors import safe_open

import jaxspec
from jaxspec.errors import CheckpointError, ConfigError
from jaxspec.models import target as target_lib
from jaxspec.quant.formats import QTensor
from jaxspec.io.architectures import config_from_hf

from tests import drafter_models, engine_models, hf_models, near_ties

NAME = "gptoss_sliding_sinks"
MXFP4_EXPERTS = (("experts", "mxfp4"),)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  """(hf float model, float checkpoint dir, jaxspec MXFP4 checkpoint dir)."""
  float_dir = str(tmp_path_factory.mktemp("gptoss_float"))
  hf_model = hf_models.save_hf_model(NAME, float_dir)
  mx_dir = str(tmp_path_factory.mktemp("gptoss_mxfp4"))
  jaxspec.save_hf(jaxspec.quantize(jaxspec.load_model(float_dir), MXFP4_EXPERTS), mx_dir)
  return hf_model, float_dir, mx_dir


def _hf_mxfp4(path: str) -> transformers.PreTrainedModel:
  """transformers' own reading of an MXFP4 checkpoint, dequantized (its CPU path)."""
  return transformers.AutoModelForCausalLM.from_pretrained(
    path, dtype=torch.float32, quantization_config=transformers.Mxfp4Config(dequantize=True)
  ).eval()


def _ids(model, shape=(2, 13), seed=0) -> np.ndarray:
  return np.random.default_rng(seed).integers(0, model.config.vocab_size, shape)


def test_config_reads_the_layer_pattern(saved):
  _, float_dir, _ = saved
  model = jaxspec.load_model(float_dir, scan_layers=True)  # config_from_hf's default options
  c = model.config
  assert c.layer_windows == (4, 0, 4)
  assert c.attention_sinks and c.expert_bias and c.fused_gate_up and c.router == "topk_softmax"
  assert dict(c.rope_scaling)["rope_type"] == "yarn"
  # Growing the model keeps gpt-oss's alternation.
  assert c.replace(num_layers=6).layer_windows == (4, 0, 4, 0, 4, 0)


def test_mxfp4_checkpoint_is_gpt_oss_layout_and_matches_transformers(saved):
  hf_float, float_dir, mx_dir = saved
  with open(os.path.join(mx_dir, "config.json")) as f:
    assert json.load(f)["quantization_config"]["quant_method"] == "mxfp4"
  with safe_open(os.path.join(mx_dir, "model.safetensors"), "np") as f:
    names = set(f.keys())
    blocks = f.get_tensor("model.layers.1.mlp.experts.gate_up_proj_blocks")
  assert "model.layers.1.mlp.experts.gate_up_proj" not in names  # no float copy
  assert blocks.dtype == np.uint8 and blocks.shape == (4, 64, 1, 16)  # [E, 2I, H/32, 16]

  ours = jaxspec.load_model(mx_dir, scan_layers=True)  # stacked layers
  experts = ours.params["layers_0"]["mlp"]["gate_up_proj"]
  assert isinstance(experts, QTensor) and experts.format == "mxfp4"  # kept packed in memory
  # Sliding and full layers are separate runs (their decoding states differ): layer 0 alone.
  assert experts.shape == (1, 4, 32, 64)  # [layers, E, H, 2I]
  assert experts.nbytes * 16 == np.prod(experts.shape) * 2 * 4.25  # 4.25 bits/weight vs bf16

  ids = _ids(ours)
  logits = np.asarray(ours.logits(ids))
  ref = hf_models.hf_logits(_hf_mxfp4(mx_dir), ids)
  near_ties.assert_logits_match(ours, ids, logits, ref, atol=1e-4)
  # The quantization is real: the float model's logits are elsewhere.
  assert np.abs(logits - hf_models.hf_logits(hf_float, ids)).max() > 1e-2
  # Saving the loaded model again writes the same bytes.
  again = jaxspec.load_model(mx_dir, scan_layers=True)  # the layout of `ours`
  np.testing.assert_array_equal(np.asarray(again.logits(ids)), logits)


def test_window_and_sinks_are_what_the_logits_depend_on(saved):
  hf_float, float_dir, _ = saved
  model = jaxspec.load_model(float_dir, scan_layers=True)  # stacked layers
  ids = _ids(model)
  ref = hf_models.hf_logits(hf_float, ids)
  full = np.asarray(model.with_config(layer_windows=(1000, 0, 1000)).logits(ids))  # wider than any text
  # Inside the first window nothing changes; past it, a model that ignores windows is wrong.
  np.testing.assert_allclose(full[:, :4], ref[:, :4], atol=1e-4)
  assert np.abs(full[:, 5:] - ref[:, 5:]).max() > 1e-3
  params = jax.tree_util.tree_map(lambda x: x, model.params)
  params["layers_0"]["self_attn"]["sinks"] = jnp.full_like(
    params["layers_0"]["self_attn"]["sinks"], -1e9
  )
  no_sinks = np.asarray(dataclasses.replace(model, params=params).logits(ids))
  assert np.abs(no_sinks - ref).max() > 1e-3


def test_cached_blocks_equal_the_full_forward(saved):
  """Blocks written into the decoding state, prefix read 2 slots per chunk: sliding layers
  skip whole chunks below their window and mask inside the first one they read."""
  _, float_dir, mx_dir = saved
  for path in (float_dir, mx_dir):
    model = jaxspec.load_model(path, options=jaxspec.RunOptions(attention_chunk=2))
    b, t = 2, 14
    ids = _ids(model, (b, t), seed=3)
    full = np.asarray(model.logits(ids))
    blocks = engine_models.blockwise_logits(model, ids, (5, 1, 3, 1, 4))
    near_ties.assert_logits_match(model, ids, blocks, full, atol=1e-4)


def test_dflash_in_published_layout_decodes_losslessly(saved, tmp_path):
  """A DFlash drafter for gpt-oss (taps, the target's width, its embedding and LM head),
  saved in the published layout and loaded back: chain and DDTree outputs equal plain
  greedy decoding of the MXFP4 target, which is the argmax of transformers' full forward
  over the dequantized checkpoint, token by token."""
  _, _, mx_dir = saved
  target = jaxspec.load_model(mx_dir, scan_layers=False)
  drafter = drafter_models.small_dflash(target, target_layer_ids=(0, 2))
  jaxspec.save_drafter(drafter, str(tmp_path))
  loaded = jaxspec.load_drafter(str(tmp_path), target)
  assert loaded.config.target_layer_ids == (0, 2)
  check = drafter_models.GreedyCheck(target, loaded, max_len=64)
  plain, _ = check.check(batch=2, new=16)
  check.check(batch=2, new=16, tree_budget=6)
  hf_mxfp4 = _hf_mxfp4(mx_dir)
  for prompt, tokens in zip(drafter_models.prompts(2, target.config.vocab_size), plain.tokens):
    near_ties.assert_greedy_is_full_forward_argmax(hf_mxfp4, prompt, tokens, model=target)


def test_mxfp4_import_refuses_nan_scales(saved, tmp_path):
  _, _, mx_dir = saved
  with safe_open(os.path.join(mx_dir, "model.safetensors"), "np") as f:
    tensors = {k: f.get_tensor(k) for k in f.keys()}
  name = "model.layers.0.mlp.experts.down_proj_scales"
  tensors[name] = tensors[name].copy()
  tensors[name].flat[3] = 0xFF
  from safetensors.numpy import save_file  # pylint: disable=import-outside-toplevel

  save_file(tensors, str(tmp_path / "model.safetensors"))
  with open(os.path.join(mx_dir, "config.json")) as f:
    (tmp_path / "config.json").write_text(f.read())
  with pytest.raises(CheckpointError, match="0xFF"):
    jaxspec.load_model(str(tmp_path))


def test_bad_gpt_oss_configs_are_refused(saved):
  _, float_dir, _ = saved
  with open(os.path.join(float_dir, "config.json")) as f:
    hf = json.load(f)
  # Bad layer_types and sliding_window: refused by name in tests/test_conformance.py's table.
  # A null window means no window at all (transformers' reading).
  assert config_from_hf({**hf, "sliding_window": None}).layer_windows == (0, 0, 0)
  with pytest.raises(ConfigError, match="Pallas"):
    config_from_hf(hf, options=jaxspec.RunOptions(attention_impl="pallas"))
  qwen = hf_models.CONFIGS["qwen3_gqa_bias_headdim"][2]
  qwen_hf = {**qwen, "architectures": ["Qwen3ForCausalLM"]}
  with pytest.raises(ConfigError, match="sinks and sliding windows are features of .*GptOss"):
    config_from_hf(qwen_hf, attention_sinks=True)
  with pytest.raises(ConfigError, match="gpt-oss"):
    config_from_hf(qwen_hf, swiglu_limit=7.0)


def test_mxfp4_experts_through_the_pallas_grouped_matmul(saved):
  """gmm_impl="pallas" puts the ragged backend's expert products on the MXFP4 grouped-matmul
  kernel (interpret mode on CPU): the model's logits equal those of the XLA path (dequantize,
  then ragged_dot), and the kernel really is in the program."""
  _, _, mx_dir = saved
  xla = jaxspec.load_model(mx_dir, options=jaxspec.RunOptions(moe_backend="ragged", gmm_impl="xla"))
  pallas = jaxspec.load_model(
    mx_dir, options=jaxspec.RunOptions(moe_backend="ragged", gmm_impl="pallas")
  )
  ids = _ids(xla, (2, 7), seed=5)
  ref = np.asarray(xla.logits(ids))
  near_ties.assert_logits_match(xla, ids, np.asarray(pallas.logits(ids)), ref, atol=1e-5)

  def program(model):
    tokens = jnp.asarray(ids, jnp.int32)
    fwd = lambda params: target_lib.forward(model.config, params, tokens).logits
    return str(jax.make_jaxpr(fwd)(model.params))

  assert "pallas_call" in program(pallas)
  assert "pallas_call" not in program(xla)
