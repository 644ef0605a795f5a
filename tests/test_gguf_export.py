"""jaxspec.io.gguf_export: a float Qwen3 target as GGUF, read back with gguf's own reader,
and (when llama-cpp-python is installed, slow) decoded by llama.cpp to jaxspec's tokens."""

from __future__ import annotations

import numpy as np
import pytest

import jaxspec
from jaxspec.io import gguf_export
from jaxspec.io import hf as hf_io
from jaxspec.profiling import roofline

gguf = pytest.importorskip("gguf")

# The keys llama.cpp's qwen3 loader reads (llama-model.cpp, llama-vocab.cpp).
REQUIRED_KEYS = (
  "general.architecture",
  "qwen3.context_length",
  "qwen3.embedding_length",
  "qwen3.block_count",
  "qwen3.feed_forward_length",
  "qwen3.attention.head_count",
  "qwen3.attention.head_count_kv",
  "qwen3.attention.key_length",
  "qwen3.attention.value_length",
  "qwen3.attention.layer_norm_rms_epsilon",
  "qwen3.rope.freq_base",
  "qwen3.vocab_size",
  "tokenizer.ggml.model",
)


def _tiny() -> jaxspec.TargetModel:
  config = roofline.dense_config(
    hidden=64, layers=2, intermediate=128, vocab=512, head_dim=16, kv_heads=2
  ).with_options(scan_layers=False)
  return jaxspec.TargetModel.random(config, seed=3)


def _field(reader, key):
  field = reader.fields[key]
  value = field.parts[field.data[0]]
  if key == "general.architecture" or key == "tokenizer.ggml.model":
    return bytes(value).decode()
  return value.item()


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
  target = _tiny()
  path = str(tmp_path_factory.mktemp("gguf") / "tiny-f32.gguf")
  gguf_export.write_gguf(target.config, target.params, path)
  return target, path


def test_round_trip_names_shapes_values(tiny_gguf):
  target, path = tiny_gguf
  reader = gguf.GGUFReader(path)
  got = {t.name: t for t in reader.tensors}
  hf = hf_io.export_tensors(target.config, target.params)
  assert set(got) == {gguf_export.gguf_name(n) for n in hf}
  assert "output.weight" in got and "blk.1.ffn_down.weight" in got
  for name, w in hf.items():
    t = got[gguf_export.gguf_name(name)]
    assert t.tensor_type == gguf.GGMLQuantizationType.F32
    # GGUF lists dimensions innermost first: HF's row-major [out, in] is ne = {in, out}.
    assert tuple(int(d) for d in t.shape) == tuple(reversed(w.shape)), name
    np.testing.assert_array_equal(np.asarray(t.data).reshape(w.shape), w)
  # llama.cpp's layouts: q_proj [heads*D, hidden], the embedding [vocab, hidden].
  cfg = target.config
  q = got["blk.0.attn_q.weight"]
  assert tuple(int(d) for d in q.shape) == (cfg.hidden_size, cfg.num_heads * cfg.head_dim)
  emb = got["token_embd.weight"]
  np.testing.assert_array_equal(np.asarray(emb.data), np.asarray(target.params["embed"]))


def test_metadata_for_the_qwen3_loader(tiny_gguf):
  target, path = tiny_gguf
  reader = gguf.GGUFReader(path)
  for key in REQUIRED_KEYS:
    assert key in reader.fields, key
  cfg = target.config
  assert _field(reader, "general.architecture") == "qwen3"
  assert _field(reader, "tokenizer.ggml.model") == "none"
  assert _field(reader, "qwen3.block_count") == cfg.num_layers
  assert _field(reader, "qwen3.attention.head_count_kv") == cfg.num_kv_heads
  assert _field(reader, "qwen3.vocab_size") == cfg.vocab_size
  assert _field(reader, "qwen3.rope.freq_base") == pytest.approx(cfg.rope_theta)


def test_bytes_per_token_matches_the_roofline(tiny_gguf):
  target, path = tiny_gguf
  assert gguf_export.bytes_per_token(path) == roofline.weight_bytes_read(
    target.config, target.params
  )


def test_f16_halves_matrices_and_keeps_norms(tmp_path):
  target = _tiny()
  tensors = gguf_export.gguf_tensors(target.config, target.params, "f16")
  assert tensors["blk.0.ffn_up.weight"].dtype == np.float16
  assert tensors["blk.0.attn_norm.weight"].dtype == np.float32


def test_refuses_what_llama_cpp_qwen3_cannot_run():
  target = _tiny()
  quantized = jaxspec.quantize(target, (("mlp", "fp8"),))
  with pytest.raises(jaxspec.ConfigError, match="quantized"):
    gguf_export.gguf_tensors(quantized.config, quantized.params)
  with pytest.raises(jaxspec.ConfigError, match="qk|q/k"):
    gguf_export.check_exportable(target.config.replace(qk_norm=False))
  with pytest.raises(jaxspec.ConfigError, match="file type"):
    gguf_export.gguf_tensors(target.config, target.params, "q4_0")


@pytest.mark.slow
def test_llama_cpp_decodes_jaxspec_tokens(tiny_gguf):
  llama_cpp = pytest.importorskip("llama_cpp")
  target, path = tiny_gguf
  prompt = [5, 17, 42, 99, 3, 250, 7, 64]
  n = 8
  engine = jaxspec.SpecEngine(target, None, jaxspec.EngineConfig(max_len=64, use_eos=False))
  want = engine.generate([prompt], max_new_tokens=n, temperature=0.0).tokens[0]
  llm = llama_cpp.Llama(
    model_path=path, n_ctx=64, n_threads=1, n_threads_batch=1, type_k=0, type_v=0, verbose=False
  )
  got = []
  for tok in llm.generate(prompt, temp=0.0, top_k=1, repeat_penalty=1.0, reset=True):
    got.append(int(tok))
    if len(got) == n:
      break
  assert got == list(want)
