"""The planner from config.json (jaxspec.plan.arch / scale) against the code and the live arrays.

Per-device bytes are checked against live arrays on 1 device here and on 8 virtual CPU devices
in a child process (XLA's device count is fixed when the backend starts), parameters in every
policy and the decoding state in every KV format, within 5% (they agree exactly today).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys
import textwrap

import jax
import pytest

import jaxspec as js
from jaxspec import sharding
from jaxspec.errors import ConfigError
from jaxspec.plan import arch, scale
from jaxspec.speculative.memory import tree_bytes
from jaxspec.quant.formats import QTensor
from tests import virtual_devices

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TARGET = os.path.join(REPO, "jaxspec", "assets", "target")
TOLERANCE = 0.05

_BASE = dict(
  vocab_size=96,
  hidden_size=64,
  num_hidden_layers=3,
  num_attention_heads=4,
  num_key_value_heads=2,
  head_dim=16,
  intermediate_size=128,
)
SMALL = {
  "qwen3": dict(_BASE, architectures=["Qwen3ForCausalLM"]),
  "qwen3_moe": dict(
    _BASE,
    architectures=["Qwen3MoeForCausalLM"],
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    decoder_sparse_step=2,
    tie_word_embeddings=True,
  ),
  "gpt_oss": dict(
    _BASE,
    architectures=["GptOssForCausalLM"],
    num_local_experts=4,
    num_experts_per_tok=2,
    intermediate_size=64,
  ),
  "glm4_moe": dict(
    _BASE,
    architectures=["Glm4MoeForCausalLM"],
    n_routed_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    n_shared_experts=1,
    first_k_dense_replace=1,
    num_nextn_predict_layers=1,
    use_qk_norm=True,
    attention_bias=True,
  ),
  "mimo_v2_flash": dict(
    _BASE,
    architectures=["MiMoV2FlashForCausalLM"],
    num_hidden_layers=4,
    hybrid_layer_pattern=[0, 1, 1, 0],
    moe_layer_freq=[0, 1, 1, 1],
    sliding_window_size=8,
    swa_num_key_value_heads=4,
    head_dim=24,
    v_head_dim=16,
    n_routed_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    add_swa_attention_sink_bias=True,
    num_nextn_predict_layers=2,
  ),
  "minimax_m2": dict(
    _BASE,
    architectures=["MiniMaxM2ForCausalLM"],
    num_local_experts=4,
    num_experts_per_tok=2,
    rotary_dim=8,
    use_qk_norm=True,
    qk_norm_type="per_layer",
    scoring_func="sigmoid",
    use_routing_bias=True,
  ),
}


def _hf(name: str) -> dict:
  with open(os.path.join(REPO, "configs", "hf", name)) as f:
    return json.load(f)


def _bundled() -> dict:
  with open(os.path.join(TARGET, "config.json")) as f:
    return json.load(f)


# -- the formula against the traced parameter tree ----------------------------------------------


@pytest.mark.parametrize("name", [*SMALL, "bundled"])
def test_formula_matches_the_traced_parameter_tree(name):
  # Mutation checked: dropping the qk-norm scales from _gqa_attention fails the Qwen3, Qwen3-MoE
  # and GLM configs.
  hf = _bundled() if name == "bundled" else SMALL[name]
  as_table = lambda spec: {w.path: (w.shape, w.dtype, w.axes) for w in spec.weights}
  traced = as_table(arch.model_spec(hf, source="traced"))
  formula = as_table(arch.model_spec(hf, source="formula"))
  assert formula == traced


@pytest.mark.parametrize("name", ["deepseek_v3.json", "kimi_k2.json", "glm_5.json"])
def test_mla_targets_are_traced_and_the_formula_agrees(name):
  # The real module tree (eval_shape of the initialiser) is what the planner counts; the formula
  # stays as a cross-check, entry for entry. Mutation checked: the formula's old
  # "kv_a_proj" name (the model's is kv_a_proj_with_mqa) fails all three.
  hf = _hf(name)
  traced = arch.model_spec(hf)
  assert traced.counted == "traced"
  as_table = lambda spec: {w.path: (w.shape, w.dtype, w.axes) for w in spec.weights}
  assert as_table(traced) == as_table(arch.model_spec(hf, source="formula"))


# Published totals. DeepSeek-V3: 671B main model + 14B MTP module = 685B on the hub, where the
# MTP module keeps its own copy of the embedding and head (jaxspec's shares the target's, so
# they are added here). GLM-5: 744B (its technical report, arXiv 2602.15763), the main model
# without its MTP layer. Kimi-K2: "1T" on the model card, 1.04T in its technical report
# (arXiv 2507.20534); the published config gives 1.026T, 1.3% under the report, and neither
# figure is precise enough for 0.5%.
def _main(spec) -> int:
  return sum(w.size for w in spec.weights if not w.path.startswith("mtp_"))


@pytest.mark.parametrize(
  "name, count, published, within",
  [
    ("deepseek_v3.json", _main, 671e9, 0.005),
    ("deepseek_v3.json", lambda s: s.num_params + 2 * 129280 * 7168, 685e9, 0.005),
    ("glm_5.json", _main, 744e9, 0.005),
    ("kimi_k2.json", lambda s: s.num_params, 1.04e12, 0.015),
    ("kimi_k2.json", lambda s: s.num_params, 1e12, 0.03),
    ("qwen3_235b_a22b.json", lambda s: s.num_params, 235e9, 0.005),
    ("gpt_oss_120b.json", lambda s: s.num_params, 116.8e9, 0.005),
    ("mimo_v2_flash.json", lambda s: s.num_params, 309e9, 0.01),  # without its MTP layers
    ("qwen3_5_397b_a17b.json", lambda s: s.num_params, 397e9, 0.005),
  ],  # Qwen3.5: text model only (no vision tower, no MTP)
)
def test_published_parameter_counts(name, count, published, within):
  # Mutation checked: leaving out the MTP layers puts DeepSeek-V3's 685B 1.7% short; leaving
  # out GLM-5's indexer (models/dsa.py not yet traced) puts it 0.1% short of 744B.
  spec = arch.model_spec(_hf(name))
  assert abs(count(spec) / published - 1) < within, count(spec)


def test_mla_plan_on_eight_h200_and_h100():
  # MXFP4 experts + FP8 attention (MLA's q_a/q_b/kv_a/kv_b/o and GLM-5's indexer) at 128K on
  # expert=8: DeepSeek-V3 fits both, Kimi-K2 and GLM-5 fit 8×H200 only.
  verdicts = {}
  for name in ("deepseek_v3.json", "kimi_k2.json", "glm_5.json"):
    spec = arch.model_spec(_hf(name))
    formats = {
      w.path.split("/")[-2]: scale.weight_format(w, scale.POLICIES["mxfp4_fp8"], spec.config)
      for w in spec.weights
      if w.path.startswith("layers_") and "self_attn" in w.path and w.path.endswith("kernel")
    }
    attention = {"q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"}
    assert attention <= formats.keys() and {formats[k] for k in formats} == {"fp8"}, formats
    p = scale.plan(spec, "expert=8", "mxfp4_fp8", max_len=131072)
    assert set(p.params) == {"none", "fp8", "mxfp4"}
    verdicts[name] = (p.fits("h200"), p.fits("h100"))
  assert verdicts == {
    "deepseek_v3.json": (True, True),
    "kimi_k2.json": (True, False),
    "glm_5.json": (True, False),
  }


def test_mla_and_hybrid_state_is_counted_analytically():
  # Mutation checked: keys_only for every kind (no V) fails the Qwen3.5 growth.
  for source in ("traced", "formula"):  # the latent cache kinds jaxspec allocates, and the formula
    ds = arch.model_spec(_hf("deepseek_v3.json"), source=source)
    per_token = sum(t.nbytes for t in ds.state(1, 2)) - sum(t.nbytes for t in ds.state(1, 1))
    assert per_token == 61 * (512 + 64) * 2, source  # the bf16 latent once per layer (K = V)
    glm = arch.model_spec(_hf("glm_5.json"), source=source)
    for kv, width in (("float", 2), ("fp8", 1)):
      grow = sum(t.nbytes for t in glm.state(1, 2, kv)) - sum(t.nbytes for t in glm.state(1, 1, kv))
      scale_bytes = 4 * 78 if kv == "fp8" else 0  # a float32 scale per latent vector
      # the latent in the cache's format; the indexer keys stay in the float (bf16) dtype
      assert grow == 78 * (576 * width + 128 * 2) + scale_bytes, (source, kv)
  # The formula and the state jaxspec allocates for its own Qwen3.5 build (traced) agree.
  for source in ("formula", "traced"):
    qwen = arch.model_spec(_hf("qwen3_5_397b_a17b.json"), source=source)
    assert qwen.counted == source
    grow = lambda s: sum(t.nbytes for t in s(1, 1024)) - sum(t.nbytes for t in s(1, 512))
    assert grow(qwen.state) == 512 * 15 * 2 * 2 * 256 * 2  # only the 15 full-attention layers
    recurrent = (".conv", ".delta", ".ssm")
    fixed = sum(t.nbytes for t in qwen.state(1, 1) if t.path.endswith(recurrent))
    assert fixed == 45 * (3 * (2 * 16 * 128 + 64 * 128) * 2 + 64 * 128 * 128 * 4), source


def test_every_hybrid_family_counts_its_tree_snapshots():
  # Qwen3.5 dense is a hybrid like Qwen3.5-MoE: a verify block keeps a recurrent-state snapshot
  # per token and linear layer. The planner once kept its own hybrid list without it and
  # counted none (46 MiB where the engine allocates 3.4 GiB on Qwen3.5-27B).
  shapes = dict(
    _BASE,
    num_hidden_layers=4,
    full_attention_interval=2,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=8,
    linear_value_head_dim=8,
    linear_conv_kernel_dim=4,
  )
  dense = arch.model_spec(dict(shapes, architectures=["Qwen3_5ForCausalLM"]))
  moe = arch.model_spec(
    dict(
      shapes,
      architectures=["Qwen3_5MoeForCausalLM"],
      num_experts=4,
      num_experts_per_tok=2,
      moe_intermediate_size=32,
      shared_expert_intermediate_size=32,
    )
  )
  sizes = {"data": 1, "expert": 1, "tensor": 1}

  def snapshot_bytes(spec):
    without = dataclasses.replace(spec, dims={**spec.dims, "linear_layers": 0})
    return scale.activation_bytes(spec, 2, 8, sizes) - scale.activation_bytes(without, 2, 8, sizes)

  per_layer = (2 * 2 * 8 + 4 * 8) * 3 * 2 + 4 * 8 * 8 * 4  # conv window (bf16) + delta (f32)
  assert dense.dims["linear_layers"] == moe.dims["linear_layers"] == 2
  assert snapshot_bytes(dense) == snapshot_bytes(moe) == 8 * 2 * 2 * per_layer > 0


# -- the planner against live arrays on one device (`target`: the bundled one, conftest.py) -----


@pytest.mark.parametrize(
  # Quantizing costs ~10 s on CPU; the fast run checks quantized bytes on 8 devices instead.
  "policy",
  ["bf16", *(pytest.param(p, marks=pytest.mark.slow) for p in ("fp8", "mxfp4_fp8"))],
)
def test_parameter_bytes_match_the_live_model(target, policy):
  # Mutation checked: stored_tensors returning the unquantized weight fails fp8 and mxfp4_fp8.
  spec = arch.model_spec(_bundled(), param_dtype=target.config.param_dtype)
  planned = scale.params_by_format(spec, policy, {"data": 1})
  live_model = js.quantize(target, scale.POLICIES[policy]) if policy != "bf16" else target
  live: dict = {}
  for leaf in jax.tree_util.tree_leaves(
    live_model.params, is_leaf=lambda x: isinstance(x, QTensor)
  ):
    fmt = leaf.format if isinstance(leaf, QTensor) else "none"
    live[fmt] = live.get(fmt, 0) + (leaf.nbytes if isinstance(leaf, QTensor) else tree_bytes(leaf))
  assert planned.keys() == live.keys()
  for fmt, n in live.items():
    assert abs(planned[fmt] / n - 1) <= TOLERANCE, (fmt, planned[fmt], n)


@pytest.mark.parametrize("kv_format", ["float", "fp8", "q4_0"])
def test_state_bytes_match_the_live_state(target, kv_format):
  # Mutation checked: ModelSpec.state ignoring kv_format (always "float") fails fp8 and q4_0.
  spec = arch.model_spec(_bundled(), param_dtype=target.config.param_dtype)
  live = tree_bytes(target.init_state(2, 96, kv_format))
  planned = scale.state_bytes(spec, 2, 96, kv_format, {"data": 1})
  assert abs(planned / live - 1) <= TOLERANCE, (planned, live)


# -- on 8 virtual devices --------------------------------------------------------------------------

SCRIPT = textwrap.dedent(r"""
    import json, sys
    import jax
    import numpy as np
    from jax.sharding import PartitionSpec as P
    import jaxspec as js
    from jaxspec import sharding as sh
    from jaxspec.io.architectures import config_from_hf, config_to_hf
    from jaxspec.models import target as target_lib
    from jaxspec.plan import arch, scale
    from jaxspec.quant.formats import QTensor, stored_axes

    assert len(jax.devices()) == 8, jax.devices()
    hf_small, mesh_shape, quantized = (json.loads(a) for a in sys.argv[1:4])
    mesh = sh.make_mesh(mesh_shape)
    is_q = lambda x: isinstance(x, QTensor)

    def per_device(tree):
        out = {}
        for leaf in jax.tree_util.tree_leaves(tree):
            for s in leaf.addressable_shards:
                out[s.device.id] = out.get(s.device.id, 0) + s.data.nbytes
        return max(out.values())

    def logical_of(params, logical):
        # A quantized weight's values and scales carry the names stored_axes gives them.
        return jax.tree_util.tree_map(
            lambda x, spec: x.replace(values=P(*stored_axes(tuple(spec), x.format, x.axes)[0]),
                                      scales=P(*stored_axes(tuple(spec), x.format, x.axes)[1]))
            if is_q(x) else spec,
            params, logical, is_leaf=lambda x: is_q(x) or isinstance(x, P))

    report = {}
    models = {"bundled": js.load_model("jaxspec/assets/target", scan_layers=False)}
    # Random values without compiling the initialiser (seconds on a busy CPU).
    cfg = config_from_hf(hf_small).with_options(scan_layers=False)
    rng = np.random.default_rng(1)
    models["random"] = target_lib.TargetModel(cfg, jax.tree_util.tree_map(
        lambda s: (0.02 * rng.standard_normal(s.shape)).astype(s.dtype),
        target_lib.param_shapes(cfg)))
    for name, model in models.items():
        hf = config_to_hf(model.config) if name == "random" else json.load(
            open("jaxspec/assets/target/config.json"))
        spec = arch.model_spec(hf, param_dtype=model.config.param_dtype)
        logical = target_lib.logical_axes(model.config)
        for policy in ("bf16", "mxfp4_fp8") if name in quantized else ("bf16",):
            m = model if policy == "bf16" else js.quantize(model, scale.POLICIES[policy])
            placed = sh.shard_tree(m.params, logical_of(m.params, logical), mesh)
            by_format = {}
            for leaf in jax.tree_util.tree_leaves(placed, is_leaf=is_q):
                by_format.setdefault(leaf.format if is_q(leaf) else "none", []).append(leaf)
            planned = scale.params_by_format(spec, policy, mesh_shape)
            assert planned.keys() == by_format.keys(), (planned.keys(), by_format.keys())
            for fmt, leaves in by_format.items():
                report[f"{name}/params/{policy}/{fmt}"] = [planned[fmt], per_device(leaves)]
        for kv in ("float", "fp8", "q4_0"):
            state = model.init_state(4, 64, kv)
            live = per_device(sh.shard_tree(state, arch.state_logical_axes(state), mesh))
            report[f"{name}/state/{kv}"] = [scale.state_bytes(spec, 4, 64, kv, mesh_shape), live]
    print(json.dumps(report))
""")

# (mesh, models whose MXFP4+FP8 weights are sharded too): quantizing costs seconds per model on
# CPU, so the default run quantizes the random model only.
MESHES = [
  pytest.param(({"data": 2, "expert": 2, "tensor": 2}, ["random"]), id="data2-expert2-tensor2"),
  pytest.param(({"expert": 8}, ["random", "bundled"]), id="expert8", marks=pytest.mark.slow),
]


@pytest.fixture(scope="module", params=MESHES)
def eight_devices(request):
  small = dict(
    SMALL["glm4_moe"],
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=4,
    head_dim=32,
    n_routed_experts=8,
    moe_intermediate_size=64,
  )
  return virtual_devices.run_json(SCRIPT, json.dumps(small), *(json.dumps(a) for a in request.param))


def test_per_device_bytes_match_live_shards(eight_devices):
  # Mutations checked: device_bytes ignoring the sharding (t.nbytes) fails; stored_tensors
  # leaving out the scales fails the mxfp4 entries (6% short).
  assert len(eight_devices) >= 9
  for key, (planned, live) in eight_devices.items():
    assert abs(planned / live - 1) <= TOLERANCE, (key, planned, live)


# -- inputs, fits and traffic ----------------------------------------------------------------------


def test_bad_inputs_are_config_errors():
  spec = arch.model_spec(SMALL["qwen3"])
  with pytest.raises(ConfigError, match="unknown policy"):
    scale.plan(spec, "expert=8", "int3")
  with pytest.raises(ConfigError, match="unknown mesh axes"):
    scale.plan(spec, "experts=8")
  with pytest.raises(ConfigError, match="positive"):
    scale.plan(spec, "expert=-1")
  with pytest.raises(ConfigError, match="axis=size"):
    scale.plan(spec, "expert8")
  with pytest.raises(ConfigError, match="cannot count"):
    arch.model_spec({"architectures": ["PhiForCausalLM"]})
  with pytest.raises(ConfigError, match="accelerator"):
    scale.plan(spec, "data=1").margin("a100")


def test_fits_and_traffic_model():
  # Mutation checked: swapping the a2a/replicate choice fails the decode/verify modes.
  ds = arch.model_spec(_hf("deepseek_v3.json"))
  p = scale.plan(ds, "expert=8", "mxfp4_fp8", max_len=131072, block=16)
  assert p.fits("h200") and not scale.plan(ds, "expert=8", "bf16", max_len=32768).fits("h200")
  # Tokens replicated over the expert group: an all-to-all also all-gathers its outputs, so
  # with 8 of 8 experts per token spread over 8 devices replicating is cheaper at any block.
  assert p.decode_traffic["expert_mode"] == "replicate"
  assert p.verify_traffic["expert_mode"] == "replicate"
  h, act, e = 7168, 2, 8
  assert p.decode_traffic["expert"] == int(58 * 2 * (e - 1) / e * h * act)
  assert p.verify_traffic["expert"] == int(58 * 2 * (e - 1) / e * 16 * h * act)
  # The batch split over the expert axis too (data-parallel attention): the all-to-all wins.
  split_rules = (("batch", ("data", "expert")),) + tuple(
    r for r in sharding.DEFAULT_RULES if r[0] != "batch"
  )
  dp = scale.plan(ds, "expert=8", "mxfp4_fp8", batch=8, block=16, rules=split_rules)
  remote = (e - 1) * (1 - (1 - 1 / e) ** 8)
  assert dp.decode_traffic["expert_mode"] == dp.verify_traffic["expert_mode"] == "all_to_all"
  assert dp.decode_traffic["expert"] == int(58 * 2 * 1 * remote * h * act)
  assert dp.verify_traffic["expert"] == int(58 * 2 * 16 * remote * h * act)
  tp = scale.plan(ds, "tensor=8", "bf16", max_len=1024)
  assert tp.decode_traffic["tensor"] == int(61 * 2 * 2 * 7 / 8 * h * act + 7 / 8 * 129280 * 4)
  assert math.isclose(p.total, sum(p.params.values()) + p.state + p.drafter + p.activations)


def test_drafters_are_traced_from_their_modules():
  spec = arch.model_spec(_hf("qwen3_235b_a22b.json"))
  dflash = scale.drafter_spec("dflash", spec)
  layers = {w.path.split("/")[0] for w in dflash.weights if w.path.startswith("layers")}
  assert dflash.weights and len(layers) >= 1
  eagle = scale.drafter_spec("eagle3", spec)
  assert sum(w.size for w in eagle.weights) < sum(w.size for w in dflash.weights)
  assert scale.drafter_spec("mtp", spec) is None
  with pytest.raises(ConfigError, match="unknown drafter"):
    scale.drafter_spec("medusa", spec)


def test_launch_script_prints_the_plan():
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  cmd = [
    sys.executable,
    os.path.join(REPO, "launch", "plan.py"),
    "--config=configs/hf/deepseek_v3.json",
    "--mesh=expert=8",
    "--policy=mxfp4_fp8",
    "--max_len=131072",
    "--batch=1",
  ]
  out = subprocess.run(
    cmd, capture_output=True, text=True, cwd=REPO, env=env, timeout=300, check=False
  )
  assert out.returncode == 0, out.stderr[-2000:]
  assert "H200 141 GB: fits" in out.stdout and "interconnect" in out.stdout
