"""Quantized weights (issue 15, part): MXFP4 and FP8 formats, the matmul seam, policies.

MXFP4 is checked bit for bit against a numpy transcription of OCP Microscaling v1.0 (scale
2^(floor(log2 amax) − 2), E2M1 round-to-nearest-even with saturation) and of gpt-oss's
`*_blocks`/`*_scales` decoding (low nibble = even element, value · 2^(scale − 127)). A
quantized model must give the logits of the float model whose weights were replaced by their
dequantized values, in both layer layouts and through every expert backend.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

import jaxspec
from jaxspec import quant
from jaxspec.drafters import registry
from jaxspec.quant import formats
from tests import near_ties
from tests.drafter_models import small_target

GRID = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def np_mxfp4(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """Reference quantizer over the last axis: (packed uint8 [..., n/32, 16], E8M0 [..., n/32])."""
  blocks = x.astype(np.float32).reshape(*x.shape[:-1], -1, 32)
  amax = np.abs(blocks).max(-1)
  _, e = np.frexp(np.where(amax > 0, amax, 1.0))
  shared = np.where(amax > 0, e - 1 - 2, -127).clip(-127, 127)
  scaled = blocks / np.ldexp(1.0, shared)[..., None]
  mag = np.minimum(np.abs(scaled), 6.0)
  dist = np.abs(mag[..., None] - GRID)
  best = dist.min(-1, keepdims=True)
  # Nearest grid point; of two equally near, the one with an even code (mantissa bit 0).
  candidates = np.where(np.isclose(dist, best, rtol=0, atol=0), np.arange(8), 99)
  even_first = np.where(candidates % 2 == 0, candidates, candidates + 100)
  code = np.min(even_first, -1)
  code = np.where(code >= 100, code - 100, code)
  code = code + 8 * ((scaled < 0) & (code > 0))
  code = code.astype(np.uint8)
  packed = code[..., 0::2] | (code[..., 1::2] << 4)
  return packed, (shared + 127).astype(np.uint8)


def np_gpt_oss_dequantize(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
  """gpt-oss's decoding: LUT of the low then the high nibble, times 2^(scale − 127)."""
  lut = np.array([*GRID, *(-GRID)], np.float32)
  out = np.empty((*blocks.shape[:-1], 32), np.float32)
  out[..., 0::2] = lut[blocks & 0x0F]
  out[..., 1::2] = lut[blocks >> 4]
  out = np.ldexp(out, scales.astype(np.int32)[..., None] - 127)
  return out.reshape(*blocks.shape[:-2], -1)


def _weights(seed=0, shape=(3, 5, 128)):
  rng = np.random.default_rng(seed)
  x = rng.normal(size=shape).astype(np.float32) * np.exp(rng.normal(size=shape[:-1] + (1,)) * 3)
  x[0, 0, :32] = 0.0  # an all-zero block
  x[0, 1, :32] = np.linspace(-7, 7, 32) * 2.0**-3  # ties and saturation after scaling
  x[0, 2, :32] = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0] * 4  # amax 6: scale 2^0, ties
  return x


def test_mxfp4_bits_equal_the_ocp_reference_and_decode_like_gpt_oss():
  x = _weights()
  packed, scales = formats.mxfp4_quantize(jnp.asarray(x), axis=-1)
  want_packed, want_scales = np_mxfp4(x)
  np.testing.assert_array_equal(np.asarray(scales), want_scales)
  np.testing.assert_array_equal(np.asarray(packed), want_packed)
  assert np.asarray(scales)[0, 0, 0] == 0 and not np.asarray(packed)[0, 0, 0].any()
  # The tie row: 0.25→0, 0.75→1, 1.25→1, 1.75→2, 2.5→2, 3.5→4, 5→4, 6→6.
  got = np.asarray(formats.mxfp4_dequantize(packed, scales))
  np.testing.assert_array_equal(got[0, 2, :8], [0, 1, 1, 2, 2, 4, 4, 6])
  np.testing.assert_array_equal(got, np_gpt_oss_dequantize(want_packed, want_scales))


def test_mxfp4_error_bounds_and_exact_round_trip():
  """|x − q| ≤ X/4 where |x|/X ≤ 2, X/2 to 4, X to 6, and |x| − 6X above (saturation),
  X = the block's scale; quantizing the dequantized values again changes nothing."""
  x = _weights(1)
  packed, scales = formats.mxfp4_quantize(jnp.asarray(x))
  q = np.asarray(formats.mxfp4_dequantize(packed, scales))
  scale = np.repeat(np.ldexp(1.0, np.asarray(scales, np.int32) - 127), 32, axis=-1)
  a = np.abs(x) / scale
  bound = np.select([a <= 2, a <= 4, a <= 6], [0.25, 0.5, 1.0], a - 6) * scale
  assert np.all(np.abs(x - q) <= bound * (1 + 1e-6))
  again = formats.mxfp4_quantize(jnp.asarray(q))
  np.testing.assert_array_equal(np.asarray(again[0]), np.asarray(packed))


def test_mxfp4_on_any_contraction_axis_and_4_25_bits_per_weight():
  x = np.random.default_rng(2).normal(size=(4, 64, 96)).astype(np.float32)
  for axes in ((-2,), (-1,), (-3, -2)):
    if x.shape[axes[-1]] % 32:
      continue
    q = quant.quantize_weight(x, "mxfp4", axes)
    assert q.shape == x.shape
    moved = np.moveaxis(x, axes[-1], -1)
    np.testing.assert_array_equal(np.asarray(q.values), np_mxfp4(moved)[0])
    assert q.nbytes * 8 / x.size == 4.25
  with pytest.raises(jaxspec.ConfigError, match="multiple of 32"):
    quant.quantize_weight(x[:, :48], "mxfp4", (-2,))


def test_nan_scales_are_refused():
  scales = np.array([[127, 0xFF, 3]], np.uint8)
  with pytest.raises(jaxspec.CheckpointError, match="0xFF"):
    formats.check_mxfp4_scales(scales, "model.layers.0.mlp.experts.gate_up_proj_scales")
  formats.check_mxfp4_scales(scales[:, ::2], "ok")


def test_fp8_weights_scale_per_output_channel():
  rng = np.random.default_rng(3)
  x = (rng.normal(size=(6, 32, 10)) * np.exp(rng.normal(size=(6, 1, 10)) * 3)).astype(np.float32)
  q = quant.quantize_weight(x, "fp8", (-2,))
  assert q.scales.shape == (6, 10) and q.values.dtype == jnp.float8_e4m3fn
  d = np.asarray(q.dequantize())
  amax = np.abs(x).max(axis=-2, keepdims=True)
  np.testing.assert_allclose(np.abs(d).max(axis=-2, keepdims=True), amax, rtol=1e-6)
  normal = np.abs(x) >= amax / 448 * 2.0**-6  # E4M3 normals: 3 mantissa bits
  assert np.all(np.abs(d - x)[normal] <= np.abs(x)[normal] * 2.0**-4)


# ------------------------------------------------------------------------------------------------
# Policies and the model seam
# ------------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _bundled(scan: bool = False):
  return jaxspec.load_model(registry.bundled_dir("target"), scan_layers=scan)


def _dequantized(model):
  is_q = lambda x: isinstance(x, quant.QTensor)
  params = jax.tree_util.tree_map(
    lambda x: x.dequantize() if is_q(x) else x, model.params, is_leaf=is_q
  )
  return dataclasses.replace(model, params=params, quant_report=None)


def test_default_policy_quantizes_experts_attention_and_router():
  q = jaxspec.quantize(_bundled())
  formats_by_role = {}
  for path, fmt in q.quant_report.formats.items():
    formats_by_role.setdefault(quant.role_of(path), set()).add(fmt)
  assert formats_by_role == {"experts": {"mxfp4"}, "attention": {"fp8"}, "router": {"fp8"}}
  # Shared experts, the dense first layer's MLP, norms, embedding and MTP stay as they were.
  untouched = [
    "layers_1/0/mlp/shared_experts/gate_proj/kernel",
    "layers_0/0/mlp/gate_proj/kernel",
    "embed",
    "norm/scale",
  ]
  for path in untouched:
    assert path not in q.quant_report.formats
  # Experts: exactly 4.25 bits per weight, against 32 for float32.
  experts = [p for p in q.quant_report.formats if quant.role_of(p) == "experts"]
  leaves = dict(
    (jax.tree_util.keystr(k, simple=True, separator="/"), v)
    for k, v in jax.tree_util.tree_flatten_with_path(
      q.params, is_leaf=lambda x: isinstance(x, quant.QTensor)
    )[0]
  )
  for p in experts:
    assert leaves[p].nbytes * 8 / np.prod(leaves[p].shape) == 4.25


@pytest.mark.parametrize("scan", [False, True])
def test_quantized_logits_equal_the_dequantized_float_model(scan):
  """Prefill-sized blocks (dense expert backend) and decode steps (gather: only the selected
  experts are dequantized), in both layer layouts."""
  q = jaxspec.quantize(_bundled(scan))
  ref = _dequantized(q)
  ids = np.random.default_rng(0).integers(0, q.config.vocab_size, (2, 12))
  np.testing.assert_allclose(
    np.asarray(q.logits(ids)), np.asarray(ref.logits(ids)), atol=1e-5, rtol=1e-5
  )
  from jaxspec.models import target as target_lib  # pylint: disable=import-outside-toplevel

  outs = []
  for model in (q, ref):
    state = model.init_state(2, 16)
    pre = target_lib.forward(model.config, model.params, jnp.asarray(ids[:, :11]), None, state)
    step = target_lib.forward(
      model.config, model.params, jnp.asarray(ids[:, 11:]), jnp.full((2,), 11), pre.state
    )
    outs.append(np.asarray(step.logits))
  np.testing.assert_allclose(outs[0], outs[1], atol=1e-5, rtol=1e-5)
  # The quantization is real: the float model gives other logits.
  assert np.abs(np.asarray(_bundled(scan).logits(ids)) - np.asarray(ref.logits(ids))).max() > 1e-3


def test_a_dense_model_with_mlp_and_lm_head_rules():
  target = small_target(num_layers=2, vocab=64)
  policy = (("mlp", "fp8"), ("lm_head", "mxfp4"), ("*/self_attn/q_proj/kernel", "fp8"))
  q = jaxspec.quantize(target, policy)
  roles = {(quant.role_of(p), f) for p, f in q.quant_report.formats.items()}
  assert roles == {("mlp", "fp8"), ("lm_head", "mxfp4"), ("attention", "fp8")}
  assert [p for p in q.quant_report.formats if "attn" in p] == ["layers_0/self_attn/q_proj/kernel"]
  ids = np.random.default_rng(1).integers(0, 64, (1, 9))
  np.testing.assert_allclose(
    np.asarray(q.logits(ids)), np.asarray(_dequantized(q).logits(ids)), atol=1e-5, rtol=1e-5
  )
  # An MXFP4 weight needs blocks of 32 along its contraction axis (the MLP's is 48 here).
  with pytest.raises(jaxspec.ConfigError, match="down_proj/kernel .mxfp4.*multiple of 32"):
    jaxspec.quantize(target, (("mlp", "mxfp4"),))


def test_a_tied_head_is_quantized_apart_from_the_embedding():
  """An lm_head rule on a tied target quantizes a copy of the head (llama.cpp quantizes a tied
  output too); token lookups keep the float embedding. Without the rule nothing is untied."""
  target = small_target(num_layers=2, vocab=64, tie=True)
  ids = np.random.default_rng(1).integers(0, 64, (1, 9))
  untied = quant.untie_head(target)
  assert not untied.config.tie_word_embeddings
  np.testing.assert_array_equal(np.asarray(untied.logits(ids)), np.asarray(target.logits(ids)))
  q = jaxspec.quantize(target, (("lm_head", "fp8"),))
  assert q.quant_report.formats == {"lm_head/kernel": "fp8"}
  assert not formats.is_quantized(q.params["embed"]) and not q.config.tie_word_embeddings
  np.testing.assert_allclose(
    np.asarray(q.logits(ids)), np.asarray(_dequantized(q).logits(ids)), atol=1e-5, rtol=1e-5
  )
  assert np.abs(np.asarray(q.logits(ids)) - np.asarray(target.logits(ids))).max() > 1e-4
  body = jaxspec.quantize(target, (("mlp", "fp8"),))
  assert body.config.tie_word_embeddings and "lm_head" not in body.params


def test_speculation_on_a_quantized_target_equals_plain_decoding_on_it():
  q = jaxspec.quantize(_bundled())
  drafter = registry.make_drafter("dflash", q, draft_dir=registry.bundled_dir("dflash"))
  cfg = jaxspec.EngineConfig(max_len=96, batch_size=2, use_eos=False)
  prompts = ["def fib(n):", "import os\nimport sys\n"]
  plain = jaxspec.SpecEngine(q, None, cfg).generate(prompts, max_new_tokens=32)
  spec = jaxspec.SpecEngine(q, drafter, cfg).generate(prompts, max_new_tokens=32)
  ids = [q.tokenizer.encode(p) for p in prompts]
  near_ties.assert_greedy_match(q, ids, plain.tokens, spec.tokens)


def test_policy_errors_and_config_form():
  with pytest.raises(jaxspec.ConfigError, match="matches no role"):
    quant.check_policy([("expertz", "mxfp4")])
  with pytest.raises(jaxspec.ConfigError, match="unknown format"):
    quant.check_policy([("experts", "int3")])
  with pytest.raises(jaxspec.ConfigError, match="never quantized"):
    quant.check_policy([("embed", "fp8")])
  with pytest.raises(jaxspec.ConfigError, match="pair"):
    quant.check_policy(["experts"])
  cfg = ml_collections.ConfigDict({"rules": [("experts", "mxfp4"), ("router", "none")]})
  assert quant.policy_from_config(cfg) == (("experts", "mxfp4"), ("router", "none"))
  with pytest.raises(jaxspec.ConfigError, match="rules"):
    quant.policy_from_config(ml_collections.ConfigDict({"other": 1}))


# ------------------------------------------------------------------------------------------------
# Checkpoints: saved and loaded in their formats
# ------------------------------------------------------------------------------------------------


def _header(path):
  import json  # pylint: disable=import-outside-toplevel
  import struct  # pylint: disable=import-outside-toplevel

  with open(path, "rb") as f:
    (n,) = struct.unpack("<Q", f.read(8))
    return json.loads(f.read(n))


def _qleaves(params):
  is_q = lambda x: isinstance(x, quant.QTensor)
  flat = jax.tree_util.tree_flatten_with_path(params, is_leaf=is_q)[0]
  return {jax.tree_util.keystr(k, simple=True, separator="/"): v for k, v in flat if is_q(v)}


@pytest.mark.parametrize(
  "policy",
  [quant.DEFAULT_POLICY, (("attention", "mxfp4"), ("experts", "fp8"), ("router", "fp8"))],
  ids=["default", "mxfp4_attention_fp8_experts"],
)
def test_quantized_checkpoint_round_trip_is_exact(tmp_path, policy):
  q = jaxspec.quantize(_bundled(), policy)
  jaxspec.save_hf(q, str(tmp_path))
  loaded = jaxspec.load_model(str(tmp_path), scan_layers=False)
  want, got = _qleaves(q.params), _qleaves(loaded.params)
  assert sorted(got) == sorted(want)
  for name, w in want.items():
    assert (got[name].format, got[name].axes) == (w.format, w.axes)
    np.testing.assert_array_equal(np.asarray(got[name].values), np.asarray(w.values))
    np.testing.assert_array_equal(np.asarray(got[name].scales), np.asarray(w.scales))
  ids = np.random.default_rng(5).integers(0, q.config.vocab_size, (1, 10))
  np.testing.assert_array_equal(np.asarray(loaded.logits(ids)), np.asarray(q.logits(ids)))
  # Saved again, the files are the same tensors.
  jaxspec.save_hf(loaded, str(tmp_path / "again"))
  assert _header(tmp_path / "again" / "model.safetensors") == _header(
    tmp_path / "model.safetensors"
  )


def test_experts_are_stored_in_the_gpt_oss_layout(tmp_path):
  from safetensors import safe_open  # pylint: disable=import-outside-toplevel

  q = jaxspec.quantize(_bundled())
  jaxspec.save_hf(q, str(tmp_path))
  c = q.config
  header = _header(tmp_path / "model.safetensors")
  with safe_open(str(tmp_path / "model.safetensors"), "numpy") as f:
    blocks = f.get_tensor("model.layers.1.mlp.experts.gate_proj_blocks")
    scales = f.get_tensor("model.layers.1.mlp.experts.gate_proj_scales")
  e, i, h = c.num_experts, c.moe_intermediate_size, c.hidden_size
  assert blocks.shape == (e, i, h // 32, 16) and scales.shape == (e, i, h // 32)
  assert "model.layers.1.mlp.experts.0.gate_proj.weight" not in header
  # Decoded as gpt-oss decodes it: the [E, out, in] weights, our dequantized values transposed.
  gate = _qleaves(q.params)["layers_1/0/mlp/gate_proj"].dequantize()
  np.testing.assert_array_equal(
    np_gpt_oss_dequantize(blocks, scales), np.swapaxes(np.asarray(gate), -1, -2)
  )
  assert blocks.nbytes + scales.nbytes == e * i * h * 4.25 / 8
  # FP8: E4M3 weights in HF's [out, in] layout with one float32 scale per output channel.
  q_proj = header["model.layers.0.self_attn.q_proj.weight"]
  assert q_proj["dtype"] == "F8_E4M3"
  assert q_proj["shape"] == [c.num_heads * c.head_dim, h]
  assert header["model.layers.0.self_attn.q_proj.weight_scale"]["shape"] == [
    c.num_heads * c.head_dim
  ]


def test_bad_quantized_checkpoints_are_refused(tmp_path):
  import json  # pylint: disable=import-outside-toplevel

  from safetensors.numpy import load_file, save_file  # pylint: disable=import-outside-toplevel

  q = jaxspec.quantize(_bundled(), (("experts", "mxfp4"),))
  jaxspec.save_hf(q, str(tmp_path))
  path = tmp_path / "model.safetensors"
  tensors = load_file(str(path))
  name = "model.layers.1.mlp.experts.up_proj_scales"
  tensors[name] = tensors[name].copy()
  tensors[name][0, 0, 0] = 0xFF
  save_file(tensors, str(path))
  with pytest.raises(jaxspec.CheckpointError, match="0xFF"):
    jaxspec.load_model(str(tmp_path))
  cfg = json.loads((tmp_path / "config.json").read_text())
  cfg["quantization_config"] = {"quant_method": "awq"}
  (tmp_path / "config.json").write_text(json.dumps(cfg))
  with pytest.raises(jaxspec.CheckpointError, match="'awq' is not supported"):
    jaxspec.load_model(str(tmp_path))
