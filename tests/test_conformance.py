"""One conformance table: the same checks for every target family, against transformers.

Each row of `ROWS` is a `Row`: a name, the transformers config and model classes, the tiny
config kwargs (hidden ≤ 64, 2 or 3 layers, vocab < 128), the (key, value) pairs a config.json must
be refused for (the ConfigError names the key), and an optional hook for the family's own
assertions; a multimodal wrapper's row names the text model jaxspec builds from it
(`text_model`). To add a family, append a row; every check below runs on it:

  (a) logits within 1e-4 of transformers' (random weights perturbed away from HF's init);
  (b) config.json read, written back (config_to_hf) and read by transformers: the same config;
  (c) the row's unsupported keys refused by name;
  (d) save_hf → transformers loads it, same logits;
  (e) cached greedy decoding (SpecEngine, no drafter) = the argmax of transformers' full
      (uncached) forward over jaxspec's output, token by token;
  (f) lossless speculation: a small DFlash drafter's DDTree output = plain greedy decoding;
  (g) `jaxspec.quantize`'s default policy: runs, logits finite and near the float ones, and
      the quantized checkpoint reads back to the same logits;
  (h) the planner: its formula agrees with the traced model, whose parameter count is
      transformers'.

Each row's HF model, checkpoint and jaxspec model are built once (lazily, by the `built`
fixture) and shared by the checks, as are its plain engine's outputs, so a row compiles one
logits program, one plain and one speculative engine and one quantized model. The engine and
quantization checks of a row run with the slow tests only where its `slow` says so (another
row or module covers the same path in the default suite); `pytest -m slow` runs them all,
but those a row `omit`s as not applying to it. A family's own checks beyond the table live in
its hook or its module (tests/test_minimax_m2.py, tests/test_gpt_oss.py, tests/test_gemma3.py).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import re
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
import transformers
from safetensors import safe_open

import jaxspec
from jaxspec.errors import ConfigError
from jaxspec.io.architectures import config_from_hf, config_to_hf
from jaxspec.models import layers
from jaxspec.plan import arch as plan_arch
from jaxspec.quant.formats import QTensor
from jaxspec.speculative.engine import SpecEngine
from jaxspec.speculative.engine_config import EngineConfig
from jaxspec.state import DecodingState, SlidingKV

from tests import drafter_models, hf_models, near_ties


@dataclasses.dataclass(frozen=True)
class Row:
  """One family's configuration and what is particular to it.

  Attributes:
    name: the test id.
    config_cls, model_cls: the transformers class names that build the reference.
    kwargs: the config's keyword arguments (tiny: 2 or 3 layers, vocab < 128).
    refused: (config.json key, value) pairs that must raise a ConfigError naming the key.
    extra: the family's own assertions, given the row's `Built`.
    slow: the checks ("greedy", "speculation": each compiles an engine for the row;
      "quantize") that run only with the slow tests, where the default suite covers the same
      path with another row or module.
    omit: the checks that do not apply to the row at all (the reason beside it).
    text_model: for a multimodal wrapper, the (config, model) classes of its text model, which
      jaxspec builds and `save_hf` writes; the reference's vision tower is not counted.
  """

  name: str
  config_cls: str
  model_cls: str
  kwargs: dict[str, Any]
  refused: tuple[tuple[str, Any], ...] = ()
  extra: Callable[["Built"], None] | None = None
  slow: tuple[str, ...] = ()
  omit: tuple[str, ...] = ()
  text_model: tuple[str, str] = ()


@dataclasses.dataclass
class Built:
  """A row's reference model, its checkpoint directory and the jaxspec model read from it."""

  row: Row
  hf: transformers.PreTrainedModel
  path: str
  model: jaxspec.TargetModel

  @property
  def hf_config(self) -> dict[str, Any]:
    with open(os.path.join(self.path, "config.json")) as f:
      return json.load(f)

  def ids(self, shape=(2, 24), seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, self.model.config.vocab_size, shape)

  @functools.cached_property
  def engine_config(self) -> EngineConfig:
    return EngineConfig(max_len=48, batch_size=2, use_eos=False)

  @functools.cached_property
  def prompts(self) -> list[list[int]]:
    return drafter_models.prompts(2, self.model.config.vocab_size)

  @functools.cached_property
  def quantized(self) -> tuple[jaxspec.TargetModel, str]:
    """`jaxspec.quantize`'s default policy applied to the model, and the directory of the
    checkpoint save_hf writes of it (shared by check (g) and the row's hook)."""
    q = jaxspec.quantize(self.model)
    path = os.path.join(self.path, "quantized")
    os.makedirs(path)
    jaxspec.save_hf(q, path)
    return q, path

  @functools.cached_property
  def plain_tokens(self) -> list[list[int]]:
    """Cached greedy decoding of `prompts` by the plain engine (24 new tokens each)."""
    engine = SpecEngine(self.model, None, self.engine_config)
    return [list(t) for t in engine.generate(self.prompts, max_new_tokens=24).tokens]


def _llama3_scaling_matters(b: Built) -> None:
  """The rotary tables are Llama's own (LlamaRotaryEmbedding) and not the unscaled ones."""
  c = b.model.config
  assert dict(c.rope_scaling)["rope_type"] == "llama3"
  pos = np.arange(0, 64, 3)[None]
  with torch.no_grad():
    cos_hf, _ = b.hf.model.rotary_emb(torch.zeros(1), torch.as_tensor(pos))
  cos, _ = layers.rope_tables(pos, c.rotary_dim, c.rope_theta, c.rope_scaling)
  # XLA's vectorised float32 division may round a blended frequency one ulp off torch's:
  # 3.4e-6 of angle at position 57.
  np.testing.assert_allclose(np.asarray(cos), cos_hf.numpy(), atol=1e-5)
  plain, _ = layers.rope_tables(pos, c.rotary_dim, c.rope_theta)
  assert np.abs(np.asarray(plain) - cos_hf.numpy()).max() > 1e-2


def _mistral_window(b: Built) -> None:
  """Every layer slides: the decoding state is rings only; and the window is what the
  reference's logits (matched in (a)) depend on."""
  c = b.model.config
  assert c.layer_windows == (8, 8)
  state = DecodingState.create(c, 1, b.engine_config.max_len, "float", slack=4)
  assert all(isinstance(s, SlidingKV) for s in state.segments)
  ids = b.ids()
  windowed = hf_models.hf_logits(b.hf, ids)
  b.hf.config.sliding_window = None
  try:
    assert np.abs(hf_models.hf_logits(b.hf, ids) - windowed).max() > 1e-3
  finally:
    b.hf.config.sliding_window = 8


def _qwen2_biases(b: Built) -> None:
  """q/k/v biased, o_proj not; published configs' sliding keys read as transformers does."""
  attn = b.model.with_scan_layers(True).params["layers_0"]["self_attn"]
  assert "bias" in attn["k_proj"] and "bias" not in attn["o_proj"]
  published = {**b.hf_config, "use_sliding_window": False, "sliding_window": 4096}
  published.pop("layer_types", None)
  assert config_from_hf(published).layer_windows == (0, 0)
  windowed = config_from_hf({**published, "use_sliding_window": True, "max_window_layers": 1})
  assert windowed.layer_windows == (0, 4096)


_DENSE = dict(
  vocab_size=96,
  hidden_size=32,
  intermediate_size=64,
  num_hidden_layers=2,
  num_attention_heads=4,
  num_key_value_heads=2,
  max_position_embeddings=256,
)
_LONGROPE = {"rope_type": "longrope", "factor": 2.0, "rope_theta": 10000.0}

_SLIDING, _FULL = "sliding_attention", "full_attention"
_GEMMA3 = dict(
  _DENSE,
  head_dim=8,
  sliding_window=4,
  query_pre_attn_scalar=12,
  layer_types=[_SLIDING, _FULL],
  rope_parameters={
    _SLIDING: {"rope_type": "default", "rope_theta": 100.0},
    _FULL: {"rope_type": "linear", "factor": 4.0, "rope_theta": 1000.0},
  },
)
_SIGLIP = dict(
  hidden_size=16,
  intermediate_size=32,
  num_hidden_layers=1,
  num_attention_heads=2,
  image_size=16,
  patch_size=8,
)


def _differs_from_hf(b: Built, model: jaxspec.TargetModel) -> None:
  """`model` (the row's weights under a changed config) moves the logits off transformers'."""
  ids = b.ids()
  assert np.abs(np.asarray(model.logits(ids)) - hf_models.hf_logits(b.hf, ids)).max() > 1e-3


def _gemma3_rings(b: Built) -> None:
  """The sliding layer keeps a ring; the softmax scale is query_pre_attn_scalar's and the
  full layer's RoPE linearly scaled (tests/test_gemma3.py has the rest)."""
  c = b.model.config
  state = DecodingState.create(c, 1, b.engine_config.max_len, "float", slack=4)
  assert [isinstance(s, SlidingKV) for s in state.segments] == [True, False]
  _differs_from_hf(b, b.model.with_config(query_pre_attn_scalar=0.0))
  _differs_from_hf(b, b.model.with_config(rope_scaling=()))


def _safetensors_names(path: str) -> set[str]:
  with safe_open(os.path.join(path, "model.safetensors"), "np") as f:
    return set(f.keys())


def _minimax_layout(b: Built) -> None:
  """MiniMax-M2 is written in its published (Mixtral-style) tensor names, float and quantized;
  the default policy quantizes the experts MXFP4 and attention FP8, and keeps the router, its
  correction bias and the q/k norms float32 (as the FP8 release does), while DEFAULT_POLICY
  itself (the router FP8) applies when asked for. (tests/test_minimax_m2.py has the rest.)"""
  saved = os.path.join(b.path, "saved")
  jaxspec.save_hf(b.model, saved)
  names = _safetensors_names(saved)
  assert "model.layers.1.block_sparse_moe.experts.5.w3.weight" in names
  assert not any(".mlp." in n for n in names)
  q, q_path = b.quantized
  assert "model.layers.1.block_sparse_moe.experts.w2_blocks" in _safetensors_names(q_path)
  layer = q.with_scan_layers(True).params["layers_0"]
  mlp, attn = layer["mlp"], layer["self_attn"]
  assert isinstance(mlp["gate_proj"], QTensor) and mlp["gate_proj"].format == "mxfp4"
  for w in (mlp["router"], mlp["e_score_correction_bias"], attn["q_norm"]["scale"]):
    assert not isinstance(w, QTensor) and w.dtype == np.float32
  asked = jaxspec.quantize(b.model, jaxspec.quant.DEFAULT_POLICY).with_scan_layers(True)
  assert asked.params["layers_0"]["mlp"]["router"].format == "fp8"


ROWS = (
  Row(
    "llama",
    "LlamaConfig",
    "LlamaForCausalLM",
    dict(_DENSE, attention_bias=True, tie_word_embeddings=False),
    refused=(("mlp_bias", True), ("hidden_act", "gelu"), ("rope_parameters", _LONGROPE)),
    slow=("greedy", "speculation", "quantize"),  # llama3_rope runs Llama's in the default suite
  ),
  # Llama 3.1's RoPE over 16 original positions; head_dim stated apart from hidden / heads.
  Row(
    "llama3_rope",
    "LlamaConfig",
    "LlamaForCausalLM",
    dict(
      _DENSE,
      head_dim=16,
      tie_word_embeddings=True,
      rope_parameters={
        "rope_type": "llama3",
        "rope_theta": 500.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16,
      },
    ),
    refused=(
      ("low_freq_factor", None),  # (read inside rope_parameters: see _with)
      ("high_freq_factor", 0.5),
    ),
    extra=_llama3_scaling_matters,
    slow=("speculation",),
  ),
  Row(
    "mistral_sliding",
    "MistralConfig",
    "MistralForCausalLM",
    dict(_DENSE, sliding_window=8, rope_theta=1000.0, tie_word_embeddings=False),
    refused=(("sliding_window", 0), ("hidden_act", "gelu")),
    extra=_mistral_window,
    slow=("speculation",),  # gpt-oss's sliding layers run DDTree in the default suite
  ),
  Row(
    "qwen2",
    "Qwen2Config",
    "Qwen2ForCausalLM",
    dict(_DENSE, tie_word_embeddings=False),
    refused=(
      ("use_sliding_window", "no"),
      ("layer_types", ["sliding_attention", "full_attention"]),
      ("layer_types", ["full_attention", "linear_attention"]),
    ),
    extra=_qwen2_biases,
    slow=("greedy", "speculation"),  # its biases are the full forward's, checked in (a)
  ),
  # Qwen2 with its sliding layers switched on: layer 1 slides over 8 positions, layer 0 not.
  Row(
    "qwen2_sliding",
    "Qwen2Config",
    "Qwen2ForCausalLM",
    dict(
      _DENSE,
      use_sliding_window=True,
      sliding_window=8,
      max_window_layers=1,
      tie_word_embeddings=True,
    ),
    refused=(("sliding_window", 0),),
    slow=("greedy", "speculation", "quantize"),  # gpt-oss decodes mixed windows by default
  ),
  Row(
    "qwen3",
    "Qwen3Config",
    "Qwen3ForCausalLM",
    dict(_DENSE, head_dim=8, attention_bias=True, tie_word_embeddings=True),
    refused=(("use_sliding_window", True), ("rope_parameters", _LONGROPE)),
    slow=("greedy", "speculation", "quantize"),  # as the rest of the suite's Qwen3 targets
  ),
  Row(
    "gemma3",
    "Gemma3TextConfig",
    "Gemma3ForCausalLM",
    _GEMMA3,
    refused=(
      ("attn_logit_softcapping", 50.0),
      ("use_bidirectional_attention", True),
      ("hidden_activation", "gelu"),
    ),
    extra=_gemma3_rings,
    slow=("speculation",),  # DDTree over rings: gpt-oss and Gemma 4 run it by default
  ),
  # The text model of the multimodal wrapper as transformers saves it (language_model.model.*).
  Row(
    "gemma3_multimodal",
    "Gemma3Config",
    "Gemma3ForConditionalGeneration",
    dict(text_config=_GEMMA3, vision_config=_SIGLIP, mm_tokens_per_image=4),
    slow=("greedy", "speculation"),  # the gemma3 row's engines
    text_model=("Gemma3TextConfig", "Gemma3ForCausalLM"),
  ),
  # Per-layer q/k norms, sigmoid routing with a correction bias (tests/test_minimax_m2.py).
  Row(
    "minimax_m2_partial",
    *hf_models.MINIMAX_CONFIGS["minimax_m2_partial"],
    refused=(
      ("attn_type_list", [0, 1]),
      ("sliding_window", 128),
      ("scoring_func", "softmax"),
      ("use_routing_bias", False),
      ("use_qk_norm", False),
      ("qk_norm_type", "per_head"),
      ("shared_intermediate_size", 64),
      ("layernorm_mlp_alpha", 3.5),
      ("postnorm", True),
      ("routed_scaling_factor", 2.0),
      ("rotary_dim", 6),  # disagrees with the saved partial_rotary_factor 0.5
    ),
    omit=("quantize",),  # its experts (16 wide) are too narrow for MXFP4 blocks of 32
  ),
  Row(
    "minimax_m2_full",
    *hf_models.MINIMAX_CONFIGS["minimax_m2_full"],
    extra=_minimax_layout,
    slow=("greedy", "speculation"),  # the minimax_m2_partial row's, by default
  ),
  # Sliding, full, sliding layers with sinks; biased experts (tests/test_gpt_oss.py).
  Row(
    "gpt_oss",
    *hf_models.CONFIGS["gptoss_sliding_sinks"],
    refused=(
      ("layer_types", ["sliding_attention", "chunked", "full_attention"]),
      ("layer_types", ["full_attention"]),
      ("sliding_window", 0),
    ),
    # tests/test_gpt_oss.py runs chain and DDTree over its MXFP4 checkpoint by default.
    slow=("speculation",),
    # MXFP4 on 32-wide experts moves this tiny model's logits past (g)'s bound (routing
    # flips); tests/test_gpt_oss.py matches them to transformers' own MXFP4 reading instead.
    omit=("quantize",),
  ),
)
BY_NAME = {row.name: row for row in ROWS}


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Callable[[str], Built]:
  """Row name → its Built, made on first use and shared by every check of the module."""

  @functools.cache
  def build(name: str) -> Built:
    row = BY_NAME[name]
    hf = hf_models.build_hf_model_from(row.config_cls, row.model_cls, row.kwargs, seed=3)
    path = str(tmp_path_factory.mktemp(name))
    hf.save_pretrained(path)
    with warnings.catch_warnings():  # a wrapper's vision tower, left out
      warnings.simplefilter("ignore" if row.text_model else "default")
      return Built(row, hf, path, jaxspec.load_model(path))

  return build


def _with(hf: dict[str, Any], key: str, value: Any) -> dict[str, Any]:
  """config.json `hf` with `key` set to `value`; a RoPE parameter is set inside
  rope_parameters, where the config states it."""
  rope = hf.get("rope_parameters") or {}
  if key in rope and key != "rope_type":
    return {**hf, "rope_parameters": {**rope, key: value}}
  return {**hf, key: value}


names = pytest.mark.parametrize("name", [row.name for row in ROWS])


def _rows(check: str) -> list[Any]:
  """Every row's name (but those omitting `check`), marked slow where the row says so."""
  return [
    pytest.param(row.name, marks=[pytest.mark.slow] if check in row.slow else [])
    for row in ROWS
    if check not in row.omit
  ]


@names
def test_logits_match_transformers(built, name):
  b = built(name)
  ids = b.ids()
  ref = hf_models.hf_logits(b.hf, ids)
  near_ties.assert_logits_match(b.model, ids, b.model.logits(ids), ref, atol=1e-4)


@names
def test_config_round_trip_through_transformers(built, name):
  b = built(name)
  c = config_from_hf(b.hf_config)
  written = config_to_hf(c)
  assert config_from_hf(written) == c
  # transformers reads what jaxspec wrote as the same model.
  config_cls = (b.row.text_model or (b.row.config_cls,))[0]
  theirs = getattr(transformers, config_cls)(**written).to_dict()
  assert config_from_hf({**theirs, "architectures": written["architectures"]}) == c


@pytest.mark.parametrize(
  "name,key,value",
  [(row.name, key, value) for row in ROWS for key, value in row.refused],
)
def test_unsupported_keys_are_refused_by_name(built, name, key, value):
  hf = built(name).hf_config
  with pytest.raises(ConfigError, match=re.escape(key)):
    config_from_hf(_with(hf, key, value))


@names
def test_save_hf_loads_in_transformers(built, name, tmp_path):
  b = built(name)
  jaxspec.save_hf(b.model, str(tmp_path))
  back = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32)
  assert type(back).__name__ == (b.row.text_model or (None, b.row.model_cls))[1]
  ids = b.ids(seed=1)
  np.testing.assert_allclose(
    hf_models.hf_logits(back.eval(), ids), hf_models.hf_logits(b.hf, ids), atol=1e-5
  )


@pytest.mark.parametrize("name", _rows("greedy"))
def test_cached_greedy_is_the_full_forward_argmax(built, name):
  b = built(name)
  for prompt, tokens in zip(b.prompts, b.plain_tokens):
    assert len(tokens) == 24
    near_ties.assert_greedy_is_full_forward_argmax(b.hf, prompt, tokens, model=b.model)


@pytest.mark.parametrize("name", _rows("speculation"))
def test_speculative_decoding_is_lossless(built, name):
  """DFlash DDTree verification (6 nodes) produces plain greedy decoding's tokens."""
  b = built(name)
  drafter = drafter_models.small_dflash(b.model, target_layer_ids=(0, 1))
  cfg = dataclasses.replace(b.engine_config, verify="tree", tree_budget=6)
  spec = SpecEngine(b.model, drafter, cfg).generate(b.prompts, max_new_tokens=24)
  near_ties.assert_greedy_match(b.model, b.prompts, b.plain_tokens, spec.tokens)


@pytest.mark.parametrize("name", _rows("quantize"))
def test_default_quantize_policy(built, name):
  """FP8 attention (the default policy's): finite logits near the float ones (but not
  equal), and the checkpoint jaxspec writes reads back to the same logits."""
  b = built(name)
  q, path = b.quantized
  kernel = q.with_scan_layers(True).params["layers_0"]["self_attn"]["q_proj"]["kernel"]
  assert isinstance(kernel, QTensor) and kernel.format == "fp8"
  ids = b.ids(seed=4)
  logits = np.asarray(q.logits(ids))
  ref = hf_models.hf_logits(b.hf, ids)
  assert np.isfinite(logits).all()
  assert 1e-5 < np.abs(logits - ref).max() < 0.25 * np.abs(ref).max()
  again = jaxspec.load_model(path)
  np.testing.assert_array_equal(np.asarray(again.logits(ids)), logits)


@names
def test_planner_counts_the_traced_model(built, name):
  b = built(name)
  traced = plan_arch.model_spec(b.hf_config)
  assert traced.counted == "traced"
  as_table = lambda spec: {w.path: (w.shape, w.dtype, w.axes) for w in spec.weights}
  assert as_table(traced) == as_table(plan_arch.model_spec(b.hf_config, source="formula"))
  counted = [*b.hf.parameters()]
  if b.row.text_model:  # the text model and its head (once where tied)
    head = b.hf.get_output_embeddings().parameters()
    counted = {id(p): p for p in (*b.hf.get_decoder().parameters(), *head)}.values()
  # A routing correction bias is a buffer to transformers, a checkpoint tensor to the planner.
  counted = [*counted, *(t for n, t in b.hf.named_buffers() if n.endswith("correction_bias"))]
  assert traced.num_params == sum(p.numel() for p in counted)


@pytest.mark.parametrize("name", [row.name for row in ROWS if row.extra])
def test_family_specifics(built, name):
  b = built(name)
  b.row.extra(b)


def test_published_llama_3_1_is_planned_from_the_traced_model():
  """configs/hf/llama_3_1_8b_instruct.json (the release config.json): read with its llama3
  RoPE, traced by the planner, its formula agreeing, exactly the checkpoint's 8030261248."""
  repo = os.path.join(os.path.dirname(__file__), "..")
  with open(os.path.join(repo, "configs", "hf", "llama_3_1_8b_instruct.json")) as f:
    hf = json.load(f)
  traced = plan_arch.model_spec(hf)
  assert traced.counted == "traced" and traced.num_params == 8030261248
  as_table = lambda spec: {w.path: (w.shape, w.dtype, w.axes) for w in spec.weights}
  assert as_table(traced) == as_table(plan_arch.model_spec(hf, source="formula"))
  scaling = dict(traced.config.rope_scaling)
  assert scaling["rope_type"] == "llama3" and scaling["original_max_position_embeddings"] == 8192
