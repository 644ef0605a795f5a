"""Block-scaled FP8 checkpoints (DeepSeek-V3 / Qwen3-FP8 layout, issue 15 part): imported as
they are stored, their logits equal a float model holding the dequantized weights."""

from __future__ import annotations

import json
import os

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import jaxspec
from jaxspec import quant
from jaxspec.config import ModelConfig

BLOCK = (16, 16)
F8 = np.dtype(ml_dtypes.float8_e4m3fn)


def _moe_config() -> ModelConfig:
  return ModelConfig(
    architecture="Qwen3MoeForCausalLM",
    vocab_size=64,
    hidden_size=48,  # not a multiple of the block: the last blocks are partial
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    intermediate_size=40,
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=24,
    tie_word_embeddings=False,
  )


def _quantizable(name: str, w: np.ndarray) -> bool:
  """What FP8 checkpoints quantize: the linear layers, not embeddings, norms, head, router."""
  return (
    w.ndim == 2
    and name.endswith(("_proj.weight", "_proj_with_mqa.weight"))
    and "embed" not in name
    and not name.startswith("lm_head")
  )


def _block_quantize(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  out, inp = w.shape
  grid = (-(-out // BLOCK[0]), -(-inp // BLOCK[1]))
  scales = np.zeros(grid, np.float32)
  q = np.zeros(w.shape, F8)
  for i in range(grid[0]):
    for j in range(grid[1]):
      blk = w[i * BLOCK[0] : (i + 1) * BLOCK[0], j * BLOCK[1] : (j + 1) * BLOCK[1]]
      s = max(np.abs(blk).max() / 448.0, 1e-12)
      scales[i, j] = s
      q[i * BLOCK[0] : (i + 1) * BLOCK[0], j * BLOCK[1] : (j + 1) * BLOCK[1]] = (blk / s).astype(F8)
  return q, scales


def _dequantize(q: np.ndarray, scales: np.ndarray) -> np.ndarray:
  s = np.repeat(np.repeat(scales, BLOCK[0], 0), BLOCK[1], 1)[: q.shape[0], : q.shape[1]]
  return q.astype(np.float32) * s


def _write_fp8_copy(float_dir: str, fp8_dir: str) -> None:
  """Block-quantizes the linear layers of the checkpoint in `float_dir` into `fp8_dir` and
  overwrites `float_dir`'s weights with their dequantized values (the reference)."""
  tensors = load_file(os.path.join(float_dir, "model.safetensors"))
  fp8, deq = {}, {}
  for name, w in tensors.items():
    if _quantizable(name, w):
      q, s = _block_quantize(w)
      fp8[name], fp8[name + "_scale_inv"] = q, s
      deq[name] = _dequantize(q, s)
    else:
      fp8[name] = deq[name] = w
  os.makedirs(fp8_dir)
  save_file(deq, os.path.join(float_dir, "model.safetensors"))
  save_file(fp8, os.path.join(fp8_dir, "model.safetensors"))
  with open(os.path.join(float_dir, "config.json")) as f:
    cfg = json.load(f)
  cfg["quantization_config"] = {
    "quant_method": "fp8",
    "fmt": "e4m3",
    "activation_scheme": "dynamic",
    "weight_block_size": list(BLOCK),
  }
  with open(os.path.join(fp8_dir, "config.json"), "w") as f:
    json.dump(cfg, f)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
  """(fp8 dir, float dir holding the fp8 weights' dequantized values)."""
  root = tmp_path_factory.mktemp("fp8")
  model = jaxspec.TargetModel.random(_moe_config(), seed=1)
  float_dir, fp8_dir = str(root / "float"), str(root / "fp8")
  jaxspec.save_hf(model, float_dir)
  _write_fp8_copy(float_dir, fp8_dir)
  return fp8_dir, float_dir


def _blocks(params):
  import jax  # pylint: disable=import-outside-toplevel

  is_q = lambda x: isinstance(x, quant.QTensor)
  return [x for x in jax.tree_util.tree_leaves(params, is_leaf=is_q) if is_q(x)]


@pytest.mark.parametrize("scan", [False, True])
def test_block_fp8_logits_equal_the_dequantized_float_model(checkpoints, scan):
  fp8_dir, float_dir = checkpoints
  q = jaxspec.load_model(fp8_dir, scan_layers=scan)
  ref = jaxspec.load_model(float_dir, scan_layers=scan)
  blocks = _blocks(q.params)
  assert blocks and all(b.format == "fp8_block" for b in blocks)
  assert all(b.values.dtype == F8 for b in blocks)  # kept as stored
  ids = np.random.default_rng(0).integers(0, 64, (2, 11))
  np.testing.assert_allclose(
    np.asarray(q.logits(ids)), np.asarray(ref.logits(ids)), atol=1e-5, rtol=1e-5
  )


def test_block_fp8_saves_back_as_stored(checkpoints, tmp_path):
  fp8_dir, _ = checkpoints
  q = jaxspec.load_model(fp8_dir, scan_layers=False)
  jaxspec.save_hf(q, str(tmp_path))
  with open(tmp_path / "config.json") as f:
    assert json.load(f)["quantization_config"]["weight_block_size"] == list(BLOCK)
  from jaxspec.io.quantized import read_raw  # pylint: disable=import-outside-toplevel

  name = "model.layers.1.mlp.experts.3.down_proj.weight"
  for d in (fp8_dir, str(tmp_path)):
    np.testing.assert_array_equal(
      read_raw(os.path.join(d, "model.safetensors"), name, F8).view(np.uint8),
      read_raw(os.path.join(fp8_dir, "model.safetensors"), name, F8).view(np.uint8),
    )
  again = jaxspec.load_model(str(tmp_path), scan_layers=False)
  ids = np.arange(9)[None] % 64
  np.testing.assert_array_equal(np.asarray(again.logits(ids)), np.asarray(q.logits(ids)))


def test_bad_block_scales_are_refused(checkpoints, tmp_path):
  import shutil  # pylint: disable=import-outside-toplevel

  fp8_dir, _ = checkpoints
  shutil.copytree(fp8_dir, tmp_path / "bad")
  path = str(tmp_path / "bad" / "model.safetensors")
  from safetensors import safe_open  # pylint: disable=import-outside-toplevel
  from jaxspec.io.quantized import read_raw  # pylint: disable=import-outside-toplevel

  tensors = {}
  with safe_open(path, "numpy") as f:
    for k in f.keys():
      tensors[k] = (
        read_raw(path, k, F8)
        if k.endswith("proj.weight") and "scale" not in k and (k + "_scale_inv" in f.keys())
        else f.get_tensor(k)
      )
  name = "model.layers.0.self_attn.q_proj.weight_scale_inv"
  tensors[name] = tensors[name][:, :1]
  save_file(tensors, path)
  with pytest.raises(jaxspec.CheckpointError, match="blocks of"):
    jaxspec.load_model(str(tmp_path / "bad"))


# DeepSeek-V3 (MLA): q_a_proj, q_b_proj, kv_a_proj_with_mqa, kv_b_proj, o_proj, the dense MLP,
# the routed and shared experts all block-scaled. kv_b_proj's output rows (heads · (dn + dv) =
# 4 · 20) are cut into blocks of 16 that straddle heads: the weight is dequantized in HF's
# [out, in] layout before the per-head reshape, so no block needs to divide a head.
MLA_NAME = "deepseek_v3_qlora_grouped_yarn"
MLA_PROJECTIONS = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")


@pytest.fixture(scope="module")
def mla_checkpoints(tmp_path_factory):
  """(fp8 dir, float dir) of a small DeepSeek-V3 saved by transformers."""
  from tests import hf_models  # pylint: disable=import-outside-toplevel

  root = tmp_path_factory.mktemp("fp8_mla")
  float_dir, fp8_dir = str(root / "float"), str(root / "fp8")
  hf_models.save_hf_model(MLA_NAME, float_dir)
  _write_fp8_copy(float_dir, fp8_dir)
  return fp8_dir, float_dir


def test_block_fp8_mla_logits_equal_the_dequantized_float_model(mla_checkpoints):
  fp8_dir, float_dir = mla_checkpoints
  q = jaxspec.load_model(fp8_dir)
  ref = jaxspec.load_model(float_dir)
  layer = q.params["layers_1"]["0"]  # per-layer layout: segment 1 (MoE), its first layer
  for p in MLA_PROJECTIONS:
    w = layer["self_attn"][p]["kernel"]
    assert isinstance(w, quant.QTensor) and w.format == "fp8_block", p
    assert w.values.dtype == F8
  blocks = _blocks(q.params)
  assert all(b.format == "fp8_block" for b in blocks)
  ids = np.random.default_rng(0).integers(0, q.config.vocab_size, (2, 11))
  got, want = np.asarray(q.logits(ids)), np.asarray(ref.logits(ids))
  np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-5)
  # The absorbed form over the latent cache reads kv_b_proj through the same dequantization.
  from jaxspec.models import target as target_lib  # pylint: disable=import-outside-toplevel
  from jaxspec.state import DecodingState  # pylint: disable=import-outside-toplevel

  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel

  state = DecodingState.create(q.config, 2, 16, "float")
  res = target_lib.forward(q.config, q.params, jnp.asarray(ids), jnp.zeros((2,), jnp.int32), state)
  np.testing.assert_allclose(np.asarray(res.logits), want, atol=1e-4, rtol=1e-4)


def test_block_fp8_mla_saves_back_as_stored(mla_checkpoints, tmp_path):
  fp8_dir, _ = mla_checkpoints
  q = jaxspec.load_model(fp8_dir)
  jaxspec.save_hf(q, str(tmp_path))
  from jaxspec.io.quantized import read_raw  # pylint: disable=import-outside-toplevel

  name = "model.layers.1.self_attn.kv_b_proj.weight"
  np.testing.assert_array_equal(
    read_raw(str(tmp_path / "model.safetensors"), name, F8).view(np.uint8),
    read_raw(os.path.join(fp8_dir, "model.safetensors"), name, F8).view(np.uint8),
  )
