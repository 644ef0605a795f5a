"""jaxspec.io.gguf: GGUF files as llama.cpp's converter writes them, read as HF checkpoints.

Tiny random transformers models are written to GGUF (tests/gguf_files.py: llama.cpp's names,
its llama q/k permutation, stacked experts, each quantization type) and loaded both by jaxspec
and by transformers (`gguf_file=`, the reference): logits must agree. Each block format's
dequantization equals the gguf package's `gguf.quants.dequantize` (the oracle), and a nibble
order read the wrong way round fails it; the llama permutation left in place fails the logits.
"""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest
import torch
import transformers

import jaxspec
from jaxspec.errors import CheckpointError, ConfigError
from jaxspec.io import checkpoint
from jaxspec.io import gguf as gguf_io
from jaxspec.io import gguf_file, gguf_tokenizer
from jaxspec.io import hf as hf_io
from jaxspec.io.tokenizer import Tokenizer
from jaxspec.models import layers
from jaxspec.serve import text as text_lib

gguf = pytest.importorskip("gguf")
from tests import gguf_files  # pylint: disable=wrong-import-position

IDS = np.array([[1, 5, 9, 33, 2, 70, 11, 4, 63, 17]])
_COMMON = dict(
  vocab_size=96,
  hidden_size=64,
  num_hidden_layers=2,
  num_attention_heads=2,
  num_key_value_heads=1,
  head_dim=32,
  intermediate_size=256,  # ffn_down's rows hold whole K-quant blocks (256 values)
  max_position_embeddings=128,
  rms_norm_eps=1e-6,
  tie_word_embeddings=False,
)
# (GGUF architecture, transformers config class, model class, extra config)
MODELS = {
  "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, {}),
  "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, {}),
  "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, {}),
  "qwen3moe": (
    transformers.Qwen3MoeConfig,
    transformers.Qwen3MoeForCausalLM,
    dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=256, norm_topk_prob=True),
  ),
  # llama.cpp's gemma3 graph: every 6th layer full, the query scaled by 1/sqrt(head_dim).
  "gemma3": (
    transformers.Gemma3TextConfig,
    transformers.Gemma3ForCausalLM,
    dict(num_hidden_layers=6, sliding_window=4, query_pre_attn_scalar=32, tie_word_embeddings=True),
  ),
}


def _hf_model(arch: str, seed: int = 0) -> tuple[transformers.PreTrainedModel, dict]:
  config_cls, model_cls, extra = MODELS[arch]
  torch.manual_seed(seed)
  config = config_cls(**{**_COMMON, **extra})
  model = model_cls(config).eval()
  if arch == "gemma3":  # (1 + w) norms are zero at init: make the stored 1 + w count
    with torch.no_grad():
      for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
          p.normal_(0, 0.3)
  if arch == "qwen2":  # q/k/v biases are zero at init: make them count
    with torch.no_grad():
      for layer in model.model.layers:
        for p in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
          p.bias.normal_(0, 0.5)
  return model, dict(config.to_dict(), head_dim=_COMMON["head_dim"])


def _write(tmp_path, arch: str, qtype: str) -> str:
  model, config = _hf_model(arch)
  path = str(tmp_path / f"{arch}-{qtype}.gguf")
  tensors = {k: v.numpy() for k, v in model.state_dict().items()}
  gguf_files.write_gguf(path, arch, config, tensors, qtype)
  return path


def _reference_logits(path: str) -> np.ndarray:
  """transformers' logits on the same file. It reads neither qwen3.attention.key_length nor
  qwen3moe.expert_feed_forward_length, and gives gemma3 its config class's query scale (256)
  where llama.cpp uses 1/sqrt(head_dim): those are given to it."""
  arch = os.path.basename(path).split("-")[0]
  given = {
    "qwen3": dict(head_dim=_COMMON["head_dim"]),
    "qwen3moe": dict(moe_intermediate_size=MODELS["qwen3moe"][2]["moe_intermediate_size"]),
    "gemma3": dict(query_pre_attn_scalar=MODELS["gemma3"][2]["query_pre_attn_scalar"]),
  }.get(arch, {})
  ref = transformers.AutoModelForCausalLM.from_pretrained(
    os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32, **given
  ).eval()
  with torch.no_grad():
    return ref(torch.tensor(IDS)).logits.numpy()


# --------------------------------------------------------------------------------------------------
# Block formats against the gguf package's dequantization
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("qtype", gguf_files.QUANT_TYPES)
def test_dequantize_equals_the_gguf_oracle(qtype):
  rng = np.random.default_rng(1)
  x = rng.standard_normal((3, 512)).astype(np.float32)
  data, t = gguf_files.encode(x, qtype, rng)
  assert t == gguf.GGMLQuantizationType[qtype]
  raw = np.ascontiguousarray(data).view(np.uint8).reshape(-1)
  got = gguf_file.dequantize(raw, int(t), x.shape)
  oracle = gguf.quants.dequantize(np.ascontiguousarray(data), t).reshape(x.shape)
  np.testing.assert_array_equal(got, oracle)
  if qtype in ("Q8_0", "Q4_0", "Q4_1"):  # quantized from x: near it, not equal
    assert 0 < np.abs(got - x).max() < 0.5


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1"])
def test_nibbles_read_high_first_fail_the_oracle(qtype, monkeypatch):
  rng = np.random.default_rng(2)
  x = rng.standard_normal((2, 64)).astype(np.float32)
  data, t = gguf_files.encode(x, qtype, rng)
  oracle = gguf.quants.dequantize(data, t).reshape(x.shape)
  high_first = lambda qs: np.concatenate([qs >> 4, qs & 0x0F], axis=-1).astype(np.float32)
  monkeypatch.setattr(gguf_file, "_nibbles", high_first)
  broken = gguf_file.dequantize(np.ascontiguousarray(data).reshape(-1), int(t), x.shape)
  assert np.abs(broken - oracle).max() > 0.1


@pytest.mark.parametrize("qtype", gguf_files.QUANT_TYPES)
def test_every_tensor_reads_as_the_oracle(tmp_path, qtype):
  """What load_params reads (HF name, HF shape) is the oracle's dequantized tensor."""
  path = _write(tmp_path, "qwen3", qtype)
  src = gguf_io.GGUFCheckpoint(path).tensor_source()
  stored = {t.name: t for t in gguf.GGUFReader(path).tensors}
  assert len(src.keys()) == len(stored)
  for hf_name in src.keys():
    t = stored[_gguf_name(hf_name)]
    oracle = gguf.quants.dequantize(t.data, t.tensor_type)
    assert src.shape(hf_name) == oracle.shape  # GGUF's innermost-first dims, reversed
    np.testing.assert_array_equal(src.get(hf_name), oracle, err_msg=hf_name)
  if qtype in ("Q4_K", "Q5_K", "Q6_K"):
    assert stored["blk.0.ffn_down.weight"].tensor_type.name == qtype


def _gguf_name(hf_name: str) -> str:
  if hf_name in gguf_io.GLOBAL_NAMES:
    return gguf_io.GLOBAL_NAMES[hf_name]
  _, _, layer, rest = hf_name.split(".", 3)
  return f"blk.{layer}.{gguf_io.LAYER_NAMES[rest]}"


# --------------------------------------------------------------------------------------------------
# Models against transformers reading the same file
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
  "arch, qtype",
  [
    ("llama", "Q4_1"),
    ("qwen2", "F16"),
    ("qwen3", "Q4_K"),
    ("qwen3", "Q8_0"),
    ("qwen3moe", "Q6_K"),
    ("gemma3", "Q5_K"),
  ],
)
def test_logits_equal_transformers_on_the_same_file(tmp_path, arch, qtype):
  path = _write(tmp_path, arch, qtype)
  model = jaxspec.load_model(path)
  assert model.config.architecture == MODELS[arch][1].__name__
  assert model.tokenizer is None  # the file has no tokenizer.ggml.*
  got = np.asarray(model.logits(IDS))
  np.testing.assert_allclose(got, _reference_logits(path), atol=1e-4, rtol=0)


def test_llama_permutation_left_in_place_fails(tmp_path):
  path = _write(tmp_path, "llama", "F32")
  ckpt = gguf_io.GGUFCheckpoint(path)
  config, _ = hf_io._config(ckpt.hf_config, path, {})  # pylint: disable=protected-access
  ref = _reference_logits(path)
  for unpermute, close in ((True, True), (False, False)):
    params = hf_io.load_params(path, config, source=ckpt.tensor_source(unpermute=unpermute))
    model = jaxspec.TargetModel(config, params)
    err = np.abs(np.asarray(model.logits(IDS)) - ref).max()
    assert (err < 1e-4) == close, (unpermute, err)


def test_convert_writes_the_gguf_as_a_hf_directory(tmp_path):
  path = _write(tmp_path, "qwen3moe", "Q4_0")
  model = checkpoint.convert(path, str(tmp_path / "hf"), "hf")
  back = jaxspec.load_model(str(tmp_path / "hf"))
  assert back.config == model.config
  np.testing.assert_array_equal(np.asarray(back.logits(IDS)), np.asarray(model.logits(IDS)))


LLAMA3_ROPE = {
  "rope_type": "llama3",
  "rope_theta": 500000.0,
  "factor": 8.0,
  "low_freq_factor": 1.0,
  "high_freq_factor": 4.0,
  "original_max_position_embeddings": 8192,
}


def test_llama3_rope_freqs_read_back_as_its_scaling(tmp_path):
  """Llama 3.1-3.3 files store the llama3 scaling as rope_freqs.weight: read back, the model
  equals transformers' own (HF) Llama with that scaling; other divisors are refused."""
  torch.manual_seed(0)
  hf = transformers.LlamaConfig(**{**_COMMON, "rope_parameters": LLAMA3_ROPE})
  model = transformers.LlamaForCausalLM(hf).eval()
  config = dict(hf.to_dict(), head_dim=_COMMON["head_dim"])
  tensors = {k: v.numpy() for k, v in model.state_dict().items()}
  path = str(tmp_path / "llama3.gguf")
  gguf_files.write_gguf(path, "llama", config, tensors)
  loaded = jaxspec.load_model(path)
  c = loaded.config
  assert dict(c.rope_scaling)["rope_type"] == "llama3"
  # The frequencies jaxspec turns are the default ones divided by the stored divisors (the
  # logits of a short prompt barely see the scaling: the frequencies show it).
  inv, _ = layers.rope_frequencies(c.head_dim, c.rope_theta, c.rope_scaling)
  default, _ = layers.rope_frequencies(c.head_dim, c.rope_theta)
  divisors = gguf_files.rope_freqs(config)
  assert divisors.max() == 8.0 and divisors.min() == 1.0 and ((divisors > 1) & (divisors < 8)).any()
  np.testing.assert_allclose(np.asarray(default) / np.asarray(inv), divisors, rtol=1e-5)
  with torch.no_grad():
    want = model(torch.tensor(IDS)).logits.numpy()
  np.testing.assert_allclose(np.asarray(loaded.logits(IDS)), want, atol=1e-4, rtol=0)
  other = dict(config, rope_parameters=dict(LLAMA3_ROPE, high_freq_factor=2.0))
  gguf_files.write_gguf(str(tmp_path / "other.gguf"), "llama", other, tensors)
  with pytest.raises(ConfigError, match="rope_freqs.weight"):
    jaxspec.load_model(str(tmp_path / "other.gguf"))


def test_config_from_metadata(tmp_path):
  path = _write(tmp_path, "qwen3moe", "F32")
  cfg = gguf_io.GGUFCheckpoint(path).hf_config
  assert cfg["architectures"] == ["Qwen3MoeForCausalLM"]
  assert (cfg["num_experts"], cfg["num_experts_per_tok"], cfg["moe_intermediate_size"]) == (
    4,
    2,
    256,
  )
  assert cfg["norm_topk_prob"] is True and cfg["tie_word_embeddings"] is False
  assert (cfg["head_dim"], cfg["num_key_value_heads"], cfg["rms_norm_eps"]) == (
    32,
    1,
    pytest.approx(1e-6),
  )


# --------------------------------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------------------------------


def _write_with_vocab(path: str, vocab: dict) -> None:
  model, config = _hf_model("llama")
  config["vocab_size"] = len(vocab["tokens"])
  model.resize_token_embeddings(config["vocab_size"])
  tensors = {k: v.numpy() for k, v in model.state_dict().items()}
  gguf_files.write_gguf(path, "llama", config, tensors, "F32", tokenizer=vocab)


def test_tokenizer_and_chat_template_equal_transformers(tmp_path):
  path = str(tmp_path / "tok.gguf")
  vocab = gguf_files.tiny_vocab()
  _write_with_vocab(path, vocab)
  model = jaxspec.load_model(path)
  tok = model.tokenizer
  ref = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="tok.gguf")
  for text in ("hello world", "<|im_start|>user\nhello 2024<|im_end|>", "héllo, wörld!"):
    ids = tok.encode(text)
    assert ids == ref(text, add_special_tokens=False)["input_ids"], text
    assert tok.decode(ids) == text
  assert tok.encode("hello") == [vocab["tokens"].index("hello")]
  assert tok.encode("<|im_end|>") == [2]  # a control token stays whole
  assert tok.encode("2024") == [tok.token_to_id(c) for c in "2024"]  # smollm: digit by digit
  assert tok.special_tokens["eos_token"] == "<|im_end|>"
  assert Tokenizer.from_file(path).encode("hello world") == tok.encode("hello world")
  chat = [{"role": "user", "content": "hello"}]
  want = ref.apply_chat_template(chat, tokenize=False)
  assert text_lib.chat_template_of(tok).render(chat, add_generation_prompt=False) == want
  # Written back as a HF directory (chat_template.jinja, the special tokens), transformers
  # reads the same tokenizer and template.
  out = str(tmp_path / "hf")
  jaxspec.save_hf(model, out)
  saved = transformers.AutoTokenizer.from_pretrained(out)
  assert saved.apply_chat_template(chat, tokenize=False) == want
  assert saved("hello world 42")["input_ids"] == tok.encode("hello world 42")
  assert saved.eos_token == "<|im_end|>"


def test_unknown_pre_tokenizer_is_refused_by_name(tmp_path):
  path = str(tmp_path / "tok.gguf")
  _write_with_vocab(path, dict(gguf_files.tiny_vocab(), pre="mystery-bpe"))
  with pytest.raises(ConfigError, match="mystery-bpe"):
    jaxspec.load_model(path)


# --------------------------------------------------------------------------------------------------
# Bad files
# --------------------------------------------------------------------------------------------------


def test_bad_files_raise_named_errors(tmp_path):
  path = _write(tmp_path, "qwen3", "Q8_0")
  with open(path, "rb") as f:
    data = f.read()
  truncated = tmp_path / "truncated.gguf"
  truncated.write_bytes(data[: len(data) - 1000])
  with pytest.raises(CheckpointError, match="truncated"):
    jaxspec.load_model(str(truncated))
  not_gguf = tmp_path / "not.gguf"
  not_gguf.write_bytes(b"PK\x03\x04" + data[4:200])
  with pytest.raises(CheckpointError, match="not a GGUF file"):
    jaxspec.load_model(str(not_gguf))
  with pytest.raises(CheckpointError, match="does not exist"):
    jaxspec.load_model(str(tmp_path / "absent.gguf"))


def test_unsupported_architecture_is_refused(tmp_path):
  writer = gguf.GGUFWriter(str(tmp_path / "phi.gguf"), "phi2")
  writer.add_block_count(1)
  for w in (
    writer.write_header_to_file,
    writer.write_kv_data_to_file,
    writer.write_tensors_to_file,
  ):
    w()
  writer.close()
  with pytest.raises(ConfigError, match="'phi2'"):
    jaxspec.load_model(str(tmp_path / "phi.gguf"))


def test_k_quants_without_the_gguf_package_say_how_to_install_it(monkeypatch):
  rng = np.random.default_rng(3)
  data, t = gguf_files.encode(rng.standard_normal((1, 256)).astype(np.float32), "Q4_K", rng)
  monkeypatch.setitem(sys.modules, "gguf", None)  # import gguf now raises ImportError
  with pytest.raises(CheckpointError, match="needs the gguf package: pip install gguf"):
    gguf_file.dequantize(data.reshape(-1), int(t), (1, 256))
  # The block formats read in numpy need no package.
  q8, t8 = gguf_files.encode(np.ones((1, 32), np.float32), "Q8_0", rng)
  np.testing.assert_allclose(gguf_file.dequantize(q8.reshape(-1), int(t8), (1, 32)), 1.0, atol=1e-2)


def test_sentencepiece_vocabulary_loads_without_a_tokenizer_and_says_so():
  fields = {"general.architecture": "gemma3", "tokenizer.ggml.model": "llama"}
  meta = gguf_io.Metadata("g.gguf", fields, set())
  with pytest.warns(UserWarning, match="'llama'.*without a tokenizer"):
    assert gguf_tokenizer.from_metadata(meta, "g.gguf") is None
