"""MiniMax-M2 targets (MiniMaxM2ForCausalLM): what is particular to the family.

tests/test_conformance.py's rows "minimax_m2_partial" and "minimax_m2_full" (tests/hf_models.py
MINIMAX_CONFIGS) run the checks every family gets: logits, config round trip and refused keys,
save_hf → transformers in the published Mixtral-style tensor names
(`block_sparse_moe.experts.{e}.w1/w2/w3`), greedy and speculative decoding, the default
quantization policy (MXFP4 experts, router and norms float32) and the planner. Here, on the
same two configurations (saved once by transformers): "partial" rotates 4 of 8 features per
head (MiniMax's `rotary_dim`) with 2 query heads per KV head; "full" rotates whole heads of 16
with 3 KV heads of 6 query heads. Norms (the per-layer q/k norms included) and the routing
correction bias are perturbed, so every piece moves the logits.
"""

from __future__ import annotations

import dataclasses
import json
import os
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import jaxspec
from jaxspec.io.architectures import config_from_hf, config_to_hf
from jaxspec.models import moe
from jaxspec.plan import arch as plan_arch
from jaxspec.quant.formats import QTensor

from tests import drafter_models, hf_models, virtual_devices

NAMES = {"partial": "minimax_m2_partial", "full": "minimax_m2_full"}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  """name → (HF model, checkpoint dir saved by transformers), as the conformance table's rows
  (tests/hf_models.py MINIMAX_CONFIGS, seed 3)."""
  out = {}
  for name, config in NAMES.items():
    hf = hf_models.build_hf_model_from(*hf_models.MINIMAX_CONFIGS[config], seed=3)
    d = str(tmp_path_factory.mktemp(f"minimax_{name}"))
    hf.save_pretrained(d)
    out[name] = (hf, d)
  return out


def _ids(vocab: int, shape=(2, 11), seed=0) -> np.ndarray:
  return np.random.default_rng(seed).integers(0, vocab, shape)


def _hf_config(d: str) -> dict:
  with open(os.path.join(d, "config.json")) as f:
    return json.load(f)


def test_routing_equals_transformers_router(saved):
  """jaxspec's sigmoid router (one group, normalised, scale 1) against MiniMaxM2TopKRouter:
  the same experts with the same weights, the correction bias steering the choice only."""
  hf, d = saved["full"]
  c = jaxspec.load_model(d).config
  block = hf.model.layers[0].mlp
  x = torch.randn(64, c.hidden_size, generator=torch.Generator().manual_seed(0))
  with torch.no_grad():
    logits, ref_w, ref_ids = block.gate(x, block.e_score_correction_bias)
  bias = jnp.asarray(block.e_score_correction_bias.numpy())
  w, ids = moe.route(c, jnp.asarray(logits.numpy()), bias)
  order = np.argsort(ref_ids.numpy(), -1)
  ref_ids, ref_w = np.take_along_axis(ref_ids.numpy(), order, -1), np.take_along_axis(
    ref_w.numpy(), order, -1
  )
  order = np.argsort(np.asarray(ids), -1)
  np.testing.assert_array_equal(np.take_along_axis(np.asarray(ids), order, -1), ref_ids)
  np.testing.assert_allclose(np.take_along_axis(np.asarray(w), order, -1), ref_w, atol=1e-6)
  # The bias changes the choice for some tokens (it is not a no-op here).
  unbiased = moe.route(c, jnp.asarray(logits.numpy()), jnp.zeros_like(bias))[1]
  assert (np.sort(np.asarray(unbiased), -1) != ref_ids).any()


def test_per_head_qk_norm_is_wrong_for_minimax(saved):
  """The same weights normalised per head (Qwen3's q/k norm, the scale's first row shared)
  move the logits: the per-layer norm is what the match depends on."""
  hf, d = saved["partial"]
  model = jaxspec.load_model(d, scan_layers=True)
  ids = _ids(model.config.vocab_size)
  params = jax.tree_util.tree_map(lambda x: x, model.params)
  for norm in ("q_norm", "k_norm"):
    attn = params["layers_0"]["self_attn"]
    attn[norm] = {"scale": attn[norm]["scale"][:, 0]}  # [layers, heads, D] → [layers, D]
  broken = dataclasses.replace(model, params=params).with_config(qk_norm_type="per_head")
  assert np.abs(np.asarray(broken.logits(ids)) - hf_models.hf_logits(hf, ids)).max() > 1e-3


def test_config_reads_minimax_and_its_published_keys(saved):
  """Per-layer q/k norms, normalised sigmoid routing, MiniMax's `rotary_dim` (read and
  written); the published config.json's keys accepted; absent keys MiniMaxM2Config's."""
  for name, factor in (("partial", 0.5), ("full", 1.0)):
    c = config_from_hf(_hf_config(saved[name][1]))
    assert c.qk_norm_type == "per_layer" and c.router == "sigmoid" and c.norm_topk_prob
    assert c.partial_rotary_factor == factor
  _, d = saved["partial"]
  hf = _hf_config(d)
  c = config_from_hf(hf)
  assert config_to_hf(c)["rotary_dim"] == 4
  # The published config.json's legacy keys, at their published values, are accepted.
  published = {
    **hf,
    "rotary_dim": 4,
    "partial_rotary_factor": 0.5,
    "use_qk_norm": True,
    "qk_norm_type": "per_layer",
    "scoring_func": "sigmoid",
    "use_routing_bias": True,
    "attn_type_list": [1, 1],
    "sliding_window": None,
    "shared_intermediate_size": 0,
    "layernorm_full_attention_beta": 1.0,
    "layernorm_mlp_beta": 1.0,
    "router_aux_loss_coef": 0.001,
  }
  published.pop("rope_parameters")
  assert config_from_hf(published) == c.replace(rope_theta=5000000.0)
  with_mtp = {**published, "use_mtp": True, "num_mtp_modules": 3, "mtp_transformer_layers": 1}
  assert config_from_hf(with_mtp) == config_from_hf(published)
  # Absent keys take MiniMaxM2Config's defaults.
  keys = ("architectures", "vocab_size", "hidden_size", "num_hidden_layers", "intermediate_size")
  dflt = config_from_hf({**{k: hf[k] for k in keys}, "num_attention_heads": 16})
  assert (dflt.head_dim, dflt.num_kv_heads, dflt.num_experts, dflt.num_experts_per_tok) == (
    128, 8, 256, 8
  )
  assert (dflt.rope_theta, dflt.max_position_embeddings, dflt.eos_token_ids) == (
    5000000.0, 196608, (200020,)
  )


@pytest.mark.slow  # DDTree over this target runs by default in tests/test_conformance.py
def test_chain_speculation_is_lossless_in_partly_filled_engines(saved):
  """DFlash chain verification equals plain greedy decoding, batch 1 and 4 (engines of 4
  slots: compiled once)."""
  _, d = saved["partial"]
  target = jaxspec.load_model(d)
  drafter = drafter_models.small_dflash(target, target_layer_ids=(0, 1))
  check = drafter_models.GreedyCheck(target, drafter, max_len=32, batch_size=4)
  for batch in (1, 4):
    check.check(batch, new=12)


def test_block_fp8_checkpoint_in_the_published_layout(saved, tmp_path):
  """Published MiniMax-M2 weights are FP8 with block scales (`weight_scale_inv`) on the
  attention projections and the experts' w1/w2/w3, the router left float: such a checkpoint
  loads as stored (fp8_block), its logits those of the dequantized float weights, and saves
  back byte for byte."""
  from safetensors.numpy import load_file, save_file  # pylint: disable=import-outside-toplevel

  from jaxspec.io.quantized import read_raw  # pylint: disable=import-outside-toplevel
  from tests import test_fp8_block as fp8  # pylint: disable=import-outside-toplevel

  _, d = saved["full"]
  quantized = (".q_proj.weight", ".k_proj.weight", ".v_proj.weight", ".o_proj.weight")
  quantized += (".w1.weight", ".w2.weight", ".w3.weight")
  stored, deq = {}, {}
  for name, w in load_file(os.path.join(d, "model.safetensors")).items():
    if name.endswith(quantized):
      q, s = fp8._block_quantize(w)  # pylint: disable=protected-access
      stored[name], stored[name + "_scale_inv"] = q, s
      deq[name] = fp8._dequantize(q, s)  # pylint: disable=protected-access
    else:
      stored[name] = deq[name] = w
  hf = _hf_config(d)
  fp8_dir, float_dir, back = (tmp_path / n for n in ("fp8", "float", "back"))
  quantization = {  # as published (with a 16 × 16 block for these small shapes)
    "quant_method": "fp8",
    "fmt": "float8_e4m3fn",
    "activation_scheme": "dynamic",
    "weight_block_size": list(fp8.BLOCK),
    "modules_to_not_convert": ["gate", "e_score_correction_bias", "lm_head"],
  }
  for out, tensors, extra in (
    (fp8_dir, stored, {"quantization_config": quantization}),
    (float_dir, deq, {}),
  ):
    out.mkdir()
    save_file(tensors, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps({**hf, **extra}))
  q = jaxspec.load_model(str(fp8_dir), scan_layers=True)
  w1 = q.params["layers_0"]["mlp"]["gate_proj"]
  assert isinstance(w1, QTensor) and w1.format == "fp8_block"
  ids = _ids(q.config.vocab_size, seed=5)
  ref = np.asarray(jaxspec.load_model(str(float_dir), scan_layers=True).logits(ids))
  np.testing.assert_allclose(np.asarray(q.logits(ids)), ref, atol=1e-5, rtol=1e-5)
  jaxspec.save_hf(q, str(back))
  name = "model.layers.1.block_sparse_moe.experts.5.w2.weight"
  np.testing.assert_array_equal(
    read_raw(str(back / "model.safetensors"), name, fp8.F8).view(np.uint8),
    stored[name].view(np.uint8),
  )


def test_published_config_is_planned_from_the_traced_model():
  """configs/hf/minimax_m2.json (the published config.json's numbers): traced by the planner,
  its formula agreeing entry for entry; ~229B parameters (published: 230B total)."""
  with open(os.path.join(os.path.dirname(__file__), "..", "configs", "hf", "minimax_m2.json")) as f:
    hf = json.load(f)
  traced = plan_arch.model_spec(hf)
  assert traced.counted == "traced" and traced.config.qk_norm_type == "per_layer"
  as_table = lambda spec: {w.path: (w.shape, w.dtype, w.axes) for w in spec.weights}
  assert as_table(traced) == as_table(plan_arch.model_spec(hf, source="formula"))
  assert 228e9 < traced.num_params < 231e9, traced.num_params
  assert traced.config.rotary_dim == 64 and traced.config.num_mtp_layers == 0


MESH_SCRIPT = textwrap.dedent(r"""
    import json
    import jax, numpy as np
    from jaxspec import sharding as sh
    from jaxspec.io.architectures import config_from_hf
    from jaxspec.models import target as target_lib
    from jaxspec.models.target import TargetModel
    from tests.drafter_models import random_params

    assert len(jax.devices()) == 4, jax.devices()
    cfg = config_from_hf(dict(
      architectures=["MiniMaxM2ForCausalLM"], vocab_size=64, hidden_size=32, intermediate_size=16,
      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8, rotary_dim=4,
      num_local_experts=4, num_experts_per_tok=2,
    ))
    params = random_params(target_lib.param_shapes(cfg), 3)
    target = TargetModel(cfg, params)
    ids = np.random.default_rng(0).integers(0, 64, (2, 9))
    one = np.asarray(target.logits(ids))
    mesh = sh.make_mesh({"tensor": 2, "expert": 2})
    with sh.use_mesh(mesh):
      placed = sh.shard_tree(params, target.logical_axes(), mesh)
      q = placed["layers_0"]["self_attn"]["q_norm"]["scale"]
      got = np.asarray(jax.jit(lambda p: TargetModel(cfg, p).logits(ids))(placed))
    print(json.dumps(dict(err=float(np.abs(got - one).max()), spec=str(q.sharding.spec),
                          local=list(q.addressable_shards[0].data.shape), shape=list(q.shape))))
""")


def test_per_layer_qk_norm_over_heads_split_by_the_mesh():
  """Heads split over tensor=2 (the q/k norm scales with them): the norm still spans every
  head, and the logits equal one device's."""
  out = virtual_devices.run_json(MESH_SCRIPT, devices=4)
  assert out["shape"] == [2, 4, 8] and out["local"] == [2, 2, 8], out  # [layers, heads, D]
  assert out["err"] < 1e-5, out
