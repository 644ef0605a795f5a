"""compressed-tensors checkpoints (issue 49): INT4 pack-quantized experts as Kimi-K2-Thinking
ships them, FP8 per-channel float-quantized weights as GLM-4.5-FP8 and RedHat's FP8 models do.

Each checkpoint is a transformers-built tiny model whose targeted weights are quantized here and
packed by the compressed-tensors package itself (the oracle of the published layout), written
in shards as a publisher's index names them. The reference is transformers run on the
dequantized weights.
"""

from __future__ import annotations

import json
import os
import shutil

import ml_dtypes
import numpy as np
import pytest
import torch
from compressed_tensors.compressors import pack_to_int32, unpack_from_int32
from safetensors.numpy import load_file, save_file

import jaxspec
from jaxspec import quant
from jaxspec.io import compressed_tensors as ct
from jaxspec.io import safetensors_files
from tests import hf_models, near_ties

F8 = np.dtype(ml_dtypes.float8_e4m3fn)
BF16 = np.dtype(ml_dtypes.bfloat16)
GROUP = 16  # Kimi's is 32; the tiny experts' down_proj has 16 inputs
# Kimi-K2-Thinking's quantization_config, but the group size.
KIMI_QC = {
  "config_groups": {
    "group_0": {
      "input_activations": None,
      "output_activations": None,
      "targets": ["Linear"],
      "weights": {
        "actorder": None,
        "block_structure": None,
        "dynamic": False,
        "group_size": GROUP,
        "num_bits": 4,
        "observer": "minmax",
        "observer_kwargs": {},
        "strategy": "group",
        "symmetric": True,
        "type": "int",
      },
    }
  },
  "format": "pack-quantized",
  "ignore": [
    "lm_head",
    "re:.*self_attn.*",
    "re:.*shared_experts.*",
    "re:.*mlp\\.(gate|up|gate_up|down)_proj.*",
  ],
  "kv_cache_scheme": None,
  "quant_method": "compressed-tensors",
  "quantization_status": "compressed",
}
# GLM-4.5-FP8 / RedHat FP8-dynamic: FP8 weights per channel, dynamic per-token activations.
FP8_QC = {
  "config_groups": {
    "group_0": {
      "input_activations": {
        "dynamic": True,
        "num_bits": 8,
        "strategy": "token",
        "symmetric": True,
        "type": "float",
      },
      "output_activations": None,
      "targets": ["Linear"],
      "weights": {
        "dynamic": False,
        "num_bits": 8,
        "strategy": "channel",
        "symmetric": True,
        "type": "float",
      },
    }
  },
  "format": "float-quantized",
  "ignore": ["lm_head", "re:.*mlp\\.gate$"],
  "kv_cache_scheme": None,
  "quant_method": "compressed-tensors",
  "quantization_status": "compressed",
}


def _int4(w: np.ndarray, high_first: bool = False) -> tuple[dict, np.ndarray]:
  """(stored tensors by suffix, dequantized weight) of w [out, in], packed by the package."""
  out, inp = w.shape
  groups = w.reshape(out, -1, GROUP)
  scale = (np.abs(groups).max(-1) / 7.0).astype(BF16)
  q = np.clip(np.round(groups / scale.astype(np.float32)[..., None]), -8, 7).astype(np.int8)
  q = q.reshape(out, inp)
  packed = pack_to_int32(torch.from_numpy(q), 4).numpy()
  if high_first:  # a writer putting value 8k + i in nibble 7 − i
    nib = [(packed >> (4 * i)) & 0xF for i in range(8)]
    packed = sum(nib[7 - i] << (4 * i) for i in range(8)).astype(np.uint32).view(np.int32)
  deq = (q.reshape(out, -1, GROUP) * scale.astype(np.float32)[..., None]).reshape(out, inp)
  stored = {"weight_packed": packed, "weight_scale": scale, "weight_shape": np.array(w.shape)}
  return stored, deq


def _fp8(w: np.ndarray) -> tuple[dict, np.ndarray]:
  scale = (np.abs(w).max(1, keepdims=True) / 448.0).astype(BF16)
  s = scale.astype(np.float32)
  q = (w / s).astype(F8)
  return {"weight": q, "weight_scale": scale}, q.astype(np.float32) * s


def _quantize_copy(float_dir: str, out_dir: str, qc: dict, shards: int = 3, **kw) -> None:
  """Quantizes the modules `qc` targets in the checkpoint in `float_dir` into `out_dir` (in
  `shards` files with an index), overwriting `float_dir`'s weights with the dequantized ones.
  The modules to quantize are chosen as compressed-tensors chooses them: `qc`'s targets and
  ignore list over the module names, "Linear" being every 2-D `*proj.weight` / lm_head."""
  src = load_file(os.path.join(float_dir, "model.safetensors"))
  cfg = ct.parse(qc)
  packer = _int4 if cfg.schemes[0].format == ct.PACKED else _fp8
  stored, deq = {}, {}
  for name, w in src.items():
    module = name[: -len(".weight")]
    linear = w.ndim == 2 and name.endswith(("proj.weight", "lm_head.weight"))
    if name.endswith(".weight") and ct.scheme_of(cfg, module, linear) is not None:
      tensors, deq[name] = packer(w, **kw)
      stored.update({f"{module}.{k}": v for k, v in tensors.items()})
    else:
      stored[name] = deq[name] = w
  os.makedirs(out_dir)
  names = sorted(stored)
  weight_map = {}
  for i in range(shards):
    fname = f"model-{i + 1:05d}-of-{shards:06d}.safetensors"
    part = {n: stored[n] for n in names[i::shards]}
    safetensors_files.write_file(part, os.path.join(out_dir, fname))
    weight_map.update({n: fname for n in part})
  with open(os.path.join(out_dir, safetensors_files.INDEX_FILE), "w") as f:
    json.dump({"metadata": {}, "weight_map": weight_map}, f)
  save_file(deq, os.path.join(float_dir, "model.safetensors"))
  with open(os.path.join(float_dir, "config.json")) as f:
    config = json.load(f)
  with open(os.path.join(out_dir, "config.json"), "w") as f:
    json.dump(dict(config, quantization_config=qc), f)


def _build(root, name: str, qc: dict, **kw) -> tuple[str, str]:
  float_dir, q_dir = str(root / f"{name}_float"), str(root / f"{name}_ct")
  hf_models.save_hf_model(name, float_dir)
  _quantize_copy(float_dir, q_dir, qc, **kw)
  return q_dir, float_dir


@pytest.fixture(scope="module")
def kimi(tmp_path_factory):
  """(int4 dir, float dir with the dequantized weights) of a tiny Kimi-K2-Thinking."""
  return _build(tmp_path_factory.mktemp("kimi"), "deepseek_v3_qlora_grouped_yarn", KIMI_QC)


@pytest.fixture(scope="module")
def kimi_model(kimi):
  return jaxspec.load_model(kimi[0])


IDS = np.random.default_rng(0).integers(0, 96, (2, 11))  # one shape: one compile per model


def _reference_logits(float_dir: str, ids: np.ndarray) -> np.ndarray:
  import transformers  # pylint: disable=import-outside-toplevel

  model = transformers.AutoModelForCausalLM.from_pretrained(float_dir, dtype=torch.float32)
  return hf_models.hf_logits(model.eval(), ids)


def _qtensors(params) -> list:
  import jax  # pylint: disable=import-outside-toplevel

  is_q = lambda x: isinstance(x, quant.QTensor)
  return [x for x in jax.tree_util.tree_leaves(params, is_leaf=is_q) if is_q(x)]


def test_kimi_int4_experts_match_transformers_on_the_dequantized_weights(kimi, kimi_model):
  _, float_dir = kimi
  model = kimi_model
  qs = _qtensors(model.params)
  # Routed experts only (2 MoE layers × gate/up/down), packed: attention, shared experts, the
  # dense layer and lm_head are in `ignore`.
  assert len(qs) == 6 and all(x.format == "int4" and x.values.dtype == np.uint8 for x in qs)
  layer = model.params["layers_1"]["0"]
  assert isinstance(layer["mlp"]["gate_proj"], quant.QTensor)
  assert not isinstance(layer["self_attn"]["o_proj"]["kernel"], quant.QTensor)
  ref = _reference_logits(float_dir, IDS)
  near_ties.assert_logits_match(model, IDS, np.asarray(model.logits(IDS)), ref, atol=1e-4)


@pytest.mark.slow  # an engine build and its decode compile: ~2 min on 2 busy cores
def test_kimi_int4_cached_greedy_equals_the_full_forward_argmax(kimi, kimi_model):
  """Cached greedy decoding (the MoE decode path reads only the selected int4 experts) = the
  argmax of transformers' uncached forward over jaxspec's own output."""
  from jaxspec.speculative.engine import SpecEngine  # pylint: disable=import-outside-toplevel
  from jaxspec.speculative.engine_config import EngineConfig  # pylint: disable=import-outside-toplevel

  prompt = IDS[0, :7].tolist()
  engine = SpecEngine(kimi_model, None, EngineConfig(max_len=32, batch_size=1, use_eos=False))
  got = engine.generate([prompt], max_new_tokens=10).tokens[0]
  full = _reference_logits(kimi[1], np.asarray([prompt + list(got)[:-1]]))
  want = full[0, len(prompt) - 1 :].argmax(-1).tolist()
  near_ties.assert_greedy_match(kimi_model, [prompt], [want], [got])


def test_int4_format_equals_the_package_dequantization(kimi, kimi_model):
  """The loaded QTensor of one expert = compressed-tensors' unpack × scale; its stored bytes
  are the published int32 words."""
  q_dir, _ = kimi
  w = kimi_model.params["layers_1"]["0"]["mlp"]["down_proj"]  # [E, I, H] stacked
  src = safetensors_files.TensorSource(q_dir)
  base = "model.layers.1.mlp.experts.5.down_proj"
  packed, scale = src.get(f"{base}.weight_packed"), src.get(f"{base}.weight_scale")
  shape = tuple(src.get(f"{base}.weight_shape"))
  q = unpack_from_int32(torch.from_numpy(packed), 4, torch.Size(shape)).numpy()
  want = q.astype(np.float32) * np.repeat(scale.astype(np.float32), GROUP, axis=1)
  got = np.asarray(quant.take(w, np.array([5]), np.float32))[0]  # jaxspec [in, out]
  np.testing.assert_array_equal(got.T, want)
  np.testing.assert_array_equal(np.asarray(w.values[5]).view(np.int32), packed)
  # 4 bits a weight plus a bf16 scale per 16 (4 + 16/16 = 5 bits here; 4.5 at Kimi's 32).
  assert quant.nbytes(w) * 8 == w.values.size * 8 + w.scales.size * 16


def test_nibbles_read_high_first_break_the_logits(kimi, tmp_path):
  """The same weights packed with value 8k + i in nibble 7 − i: a reader of that order would
  agree with its writer, so a test that did not check the order against the package would
  pass; the logits must differ from the reference."""
  _, float_dir = kimi
  swapped = str(tmp_path / "swapped")
  shutil.copytree(float_dir, tmp_path / "float")
  _quantize_copy(str(tmp_path / "float"), swapped, KIMI_QC, high_first=True)
  model = jaxspec.load_model(swapped)
  gap = np.abs(np.asarray(model.logits(IDS)) - _reference_logits(str(tmp_path / "float"), IDS))
  assert gap.max() > 1e-2


def test_ignore_list_is_honoured(kimi, tmp_path):
  """Dropping `ignore` makes the config quantize attention, shared experts and the dense MLP,
  which the checkpoint stores in float: refused, naming a module; an ignored module stored
  packed is refused too."""
  q_dir, _ = kimi
  bad = tmp_path / "no_ignore"
  shutil.copytree(q_dir, bad)
  with open(bad / "config.json") as f:
    cfg = json.load(f)
  cfg["quantization_config"] = dict(KIMI_QC, ignore=[])
  with open(bad / "config.json", "w") as f:
    json.dump(cfg, f)
  with pytest.raises(jaxspec.CheckpointError, match=r"not in `ignore`.*lacks"):
    jaxspec.load_model(str(bad))
  cfg["quantization_config"] = dict(KIMI_QC, ignore=KIMI_QC["ignore"] + ["re:.*experts.*"])
  with open(bad / "config.json", "w") as f:
    json.dump(cfg, f)
  with pytest.raises(jaxspec.CheckpointError, match=r"experts.*stored quantized.*float"):
    jaxspec.load_model(str(bad))


@pytest.mark.parametrize(
  "key, value, match",
  [
    ("symmetric", False, "symmetric"),
    ("num_bits", 8, "num_bits"),
    ("actorder", "group", "actorder"),
    ("strategy", "tensor", "strategy"),
    ("targets", ["Embedding"], "Embedding.*names no module"),
  ],
)
def test_unsupported_schemes_are_refused_by_name(kimi, tmp_path, key, value, match):
  q_dir, _ = kimi
  bad = tmp_path / "bad"
  shutil.copytree(q_dir, bad)
  with open(bad / "config.json") as f:
    cfg = json.load(f)
  group = cfg["quantization_config"]["config_groups"]["group_0"]
  (group if key == "targets" else group["weights"])[key] = value
  with open(bad / "config.json", "w") as f:
    json.dump(cfg, f)
  with pytest.raises(jaxspec.ConfigError, match=match):
    jaxspec.load_model(str(bad))


def test_int4_saves_back_as_compressed_tensors(kimi, kimi_model, tmp_path):
  q_dir, _ = kimi
  model = kimi_model
  jaxspec.save_hf(model, str(tmp_path))
  with open(tmp_path / "config.json") as f:
    qc = json.load(f)["quantization_config"]
  assert qc["quant_method"] == "compressed-tensors" and qc["format"] == "pack-quantized"
  assert ct.parse(qc).schemes[0].group == GROUP
  name = "model.layers.2.mlp.experts.7.up_proj.weight_packed"
  src = safetensors_files.TensorSource(q_dir)
  np.testing.assert_array_equal(load_file(str(tmp_path / "model.safetensors"))[name], src.get(name))
  again = jaxspec.load_model(str(tmp_path))
  np.testing.assert_array_equal(np.asarray(again.logits(IDS)), np.asarray(model.logits(IDS)))


def test_kimi_k25_wrapper_reads_its_text_config_quantization(kimi, kimi_model, tmp_path):
  """Kimi-K2.5 as published: the text model under `language_model.*`, a vision tower and
  projector beside it, quantization_config inside text_config, its ignore list (as Moonshot's
  wrapper checkpoints publish it) naming modules by their stored, prefixed names."""
  q_dir, _ = kimi
  src = safetensors_files.TensorSource(q_dir)
  rename = lambda n: "language_model." + (n if n.startswith("model.") else "lm_head." + n[8:])
  tensors = {rename(n): src.get(n) for n in src.keys()}  # noqa: SIM118 (a TensorSource)
  tensors["vision_tower.encoder.blocks.0.wqkv.weight"] = np.zeros((6, 2), np.float32)
  tensors["mm_projector.proj.0.weight"] = np.zeros((2, 2), np.float32)
  os.makedirs(tmp_path / "k25")
  safetensors_files.write_file(tensors, str(tmp_path / "k25" / "model.safetensors"))
  with open(os.path.join(q_dir, "config.json")) as f:
    text = json.load(f)
  qc = dict(text.pop("quantization_config"))
  qc["ignore"] = [
    "re:.*self_attn.*",
    "re:.*shared_experts.*",
    "re:.*mlp\\.(gate|up|gate_up|down)_proj.*",
    "re:.*lm_head.*",
    "re:.*vision_tower.*",
    "re:.*mm_projector.*",
  ]
  config = {
    "architectures": ["KimiK25ForConditionalGeneration"],
    "model_type": "kimi_k25",
    "text_config": dict(text, model_type="kimi_k2", quantization_config=qc),
    "vision_config": {"patch_size": 14},
  }
  with open(tmp_path / "k25" / "config.json", "w") as f:
    json.dump(config, f)
  with pytest.warns(UserWarning, match="vision-tower"):
    model = jaxspec.load_model(str(tmp_path / "k25"))
  assert [x.format for x in _qtensors(model.params)] == ["int4"] * 6
  np.testing.assert_array_equal(np.asarray(model.logits(IDS)), np.asarray(kimi_model.logits(IDS)))


@pytest.mark.parametrize("name", ["glm4moe_grouped_shared_partial", "qwen3_gqa_bias_headdim"])
def test_fp8_channel_matches_transformers_on_the_dequantized_weights(tmp_path, name):
  """GLM-4.5-FP8 (Glm4MoeForCausalLM) and a RedHat-style FP8-dynamic Qwen3: every Linear but
  lm_head (and the router) FP8 per output channel, into jaxspec's "fp8" format."""
  q_dir, float_dir = _build(tmp_path, name, FP8_QC)
  model = jaxspec.load_model(q_dir)
  qs = _qtensors(model.params)
  assert qs and all(x.format == "fp8" and x.values.dtype == F8 for x in qs)
  assert not isinstance(model.params["lm_head"]["kernel"], quant.QTensor)
  ids = np.random.default_rng(1).integers(0, model.config.vocab_size, (2, 10))
  ref = _reference_logits(float_dir, ids)
  near_ties.assert_logits_match(model, ids, np.asarray(model.logits(ids)), ref, atol=1e-4)


def test_w4a16_dense_int4_matches_transformers(tmp_path):
  """A RedHat-style W4A16 Qwen3: every Linear but lm_head INT4 (q/k/v per head, o_proj over
  heads, the MLP) through the dense matmul seam."""
  qc = dict(KIMI_QC, ignore=["lm_head"])
  q_dir, float_dir = _build(tmp_path, "qwen3_gqa_bias_headdim", qc)
  model = jaxspec.load_model(q_dir)
  qs = _qtensors(model.params)
  assert len(qs) == 2 * 7 and all(x.format == "int4" for x in qs)  # 2 layers × q/k/v/o/MLP
  ids = np.random.default_rng(1).integers(0, model.config.vocab_size, (2, 10))
  ref = _reference_logits(float_dir, ids)
  near_ties.assert_logits_match(model, ids, np.asarray(model.logits(ids)), ref, atol=1e-4)


def test_static_activation_scales_are_refused():
  qc = json.loads(json.dumps(FP8_QC))
  qc["config_groups"]["group_0"]["input_activations"]["dynamic"] = False
  with pytest.raises(jaxspec.ConfigError, match="input_activations.*static"):
    ct.parse(qc)


def test_planner_counts_int4_bytes_and_jaxspec_int4_saves_as_compressed_tensors(kimi, tmp_path):
  """The planner's "int4_experts" policy (Kimi-K2's layout) = the bytes of the model
  jaxspec.quantize makes (4-bit values + a bf16 scale per 32 inputs); that model saves as a
  pack-quantized checkpoint and reads back to the same packed weights."""
  from jaxspec.plan import arch, scale  # pylint: disable=import-outside-toplevel

  _, float_dir = kimi
  float_model = jaxspec.load_model(float_dir)
  model = jaxspec.quantize(float_model, scale.POLICIES["int4_experts"])
  with open(os.path.join(float_dir, "config.json")) as f:
    spec = arch.model_spec(json.load(f), param_dtype=model.config.param_dtype)
  planned = scale.params_by_format(spec, "int4_experts", {"data": 1})
  live = quant.bytes_by_format(model.params)
  assert planned == live and set(live) == {"int4", "none"}
  jaxspec.save_hf(model, str(tmp_path))
  again = jaxspec.load_model(str(tmp_path))
  for a, b in zip(_qtensors(model.params), _qtensors(again.params)):
    assert a.layout == b.layout and a.shape == b.shape
    np.testing.assert_array_equal(np.asarray(a.values), np.asarray(b.values))
    np.testing.assert_array_equal(np.asarray(b.dequantize()), np.asarray(a.dequantize()))


def test_each_shard_header_is_parsed_once(tmp_path, monkeypatch):
  """8 shards × 200 tensors: one header parse and one open per shard, not per tensor (each
  read parsed its shard's whole header before: time quadratic in a shard's tensor count)."""
  shards, per = 8, 200
  weight_map = {}
  for s in range(shards):
    fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
    part = {f"t.{s}.{i}": np.full((2, 3), i, BF16 if i % 2 else np.float32) for i in range(per)}
    safetensors_files.write_file(part, str(tmp_path / fname))
    weight_map.update({k: fname for k in part})
  with open(tmp_path / safetensors_files.INDEX_FILE, "w") as f:
    json.dump({"weight_map": weight_map}, f)
  calls: dict = {}

  def counted(fn):
    def wrapper(path, *a, **k):
      calls[(fn.__name__, path)] = calls.get((fn.__name__, path), 0) + 1
      return fn(path, *a, **k)

    return wrapper

  monkeypatch.setattr(safetensors_files, "read_header", counted(safetensors_files.read_header))
  monkeypatch.setattr(
    safetensors_files, "open_safetensors", counted(safetensors_files.open_safetensors)
  )
  src = safetensors_files.TensorSource(str(tmp_path))
  for name in weight_map:
    assert src.shape(name) == (2, 3)
    assert float(src.get(name)[0, 0]) == int(name.rsplit(".", 1)[1])
  src.close()
  assert len(calls) == 2 * shards and set(calls.values()) == {1}


def test_raw_reads_find_tensors_under_their_stored_prefixed_names(tmp_path):
  """A wrapper checkpoint's F8 tensor (`language_model.model.*`) read under its text name."""
  w = np.linspace(-2, 2, 12, dtype=np.float32).reshape(3, 4).astype(F8)
  name = "language_model.model.layers.0.mlp.down_proj.weight"
  safetensors_files.write_file({name: w}, str(tmp_path / safetensors_files.SINGLE_FILE))
  src = safetensors_files.TensorSource(str(tmp_path))
  got = src.raw("model.layers.0.mlp.down_proj.weight", F8)
  np.testing.assert_array_equal(got.view(np.uint8), w.view(np.uint8))
