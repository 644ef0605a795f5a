"""A float jaxspec target as a GGUF file that llama.cpp's `qwen3` loader reads.

Used to race jaxspec against llama.cpp on the same weights (`launch/bench.py llamacpp`). Only
dense Qwen3 targets with float weights are written (F32 or F16); llama.cpp's own quantizer
(`llama_cpp.llama_model_quantize`) makes Q8_0 / Q4_0 files from the F32 one.

GGUF lists a tensor's dimensions innermost first, so a row-major numpy array of HF's shape
([out, in] for a linear layer, [vocab, hidden] for the embedding) is what llama.cpp expects:
the tensors are `jaxspec.io.hf.export_tensors` under llama.cpp's names (the table the reader,
`jaxspec.io.gguf`, maps back). The file carries no
tokenizer (`tokenizer.ggml.model = "none"`, `qwen3.vocab_size` dummy tokens): the race feeds
token ids, and no end-of-sequence token can cut a run short.

Needs the `gguf` package (`pip install -e .[peers]`), imported only when a file is written.
"""

from __future__ import annotations

import re
from typing import Any

import jax
import numpy as np

from jaxspec.config import ModelConfig
from jaxspec.errors import ConfigError
from jaxspec.io import gguf as gguf_io
from jaxspec.io import hf as hf_io
from jaxspec.quant.formats import QTensor

ARCH = "qwen3"
# Weight types written directly; llama.cpp's quantizer makes the others.
FILE_TYPES = ("f32", "f16")

_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")


def gguf_name(hf_name: str) -> str:
  """llama.cpp's name of the HF tensor `hf_name` (the reader's table, `jaxspec.io.gguf`)."""
  if hf_name in gguf_io.GLOBAL_NAMES:
    return gguf_io.GLOBAL_NAMES[hf_name]
  m = _LAYER.fullmatch(hf_name)
  if m is None or m.group(2) not in gguf_io.LAYER_NAMES:
    raise ConfigError(f"{hf_name}: no llama.cpp qwen3 tensor holds it")
  return f"blk.{m.group(1)}.{gguf_io.LAYER_NAMES[m.group(2)]}"


def check_exportable(config: ModelConfig) -> None:
  """Raises ConfigError unless llama.cpp's qwen3 graph computes what `config` describes."""
  problems = []
  if not config.family.gguf_exportable:
    problems.append(f"architecture {config.architecture} (not of the qwen3 graph's family)")
  if config.is_moe or config.is_hybrid or config.is_mla:
    problems.append("MoE, hybrid or MLA layers")
  if not config.qk_norm:
    problems.append("no q/k norms")
  if config.attention_bias or config.attention_out_bias:
    problems.append("attention biases")
  if config.rope_scaling:
    problems.append("RoPE scaling")
  if config.sliding_window:
    problems.append("sliding windows")
  if config.rotary_dim != config.head_dim:
    problems.append("partial RoPE")
  if config.num_mtp_layers:
    problems.append("MTP layers")
  if problems:
    raise ConfigError("cannot write GGUF for llama.cpp's qwen3: " + ", ".join(problems))


def _is_q(x: Any) -> bool:
  return isinstance(x, QTensor)


def gguf_tensors(config: ModelConfig, params: Any, file_type: str = "f32") -> dict[str, np.ndarray]:
  """llama.cpp-named tensors of a float target: matrices in `file_type`, norms in float32."""
  if file_type not in FILE_TYPES:
    raise ConfigError(f"GGUF file type {file_type!r}: expected one of {FILE_TYPES}")
  check_exportable(config)
  if any(isinstance(x, QTensor) for x in jax.tree_util.tree_leaves(params, is_leaf=_is_q)):
    raise ConfigError("quantized weights cannot be written as GGUF: write the float target")
  out = {}
  for name, w in hf_io.export_tensors(config, params).items():
    w = np.asarray(w, np.float32)
    if file_type == "f16" and w.ndim == 2:
      w = w.astype(np.float16)
    out[gguf_name(name)] = np.ascontiguousarray(w)
  return out


def write_gguf(
  config: ModelConfig, params: Any, path: str, file_type: str = "f32", name: str = "jaxspec"
) -> dict[str, int]:
  """Writes the target as a GGUF file llama.cpp loads; returns each tensor's bytes."""
  import gguf  # pylint: disable=import-outside-toplevel

  tensors = gguf_tensors(config, params, file_type)
  writer = gguf.GGUFWriter(path, ARCH)
  writer.add_name(name)
  writer.add_file_type(
    gguf.LlamaFileType.ALL_F32 if file_type == "f32" else gguf.LlamaFileType.MOSTLY_F16
  )
  writer.add_context_length(config.max_position_embeddings)
  writer.add_embedding_length(config.hidden_size)
  writer.add_block_count(config.num_layers)
  writer.add_feed_forward_length(config.intermediate_size)
  writer.add_head_count(config.num_heads)
  writer.add_head_count_kv(config.num_kv_heads)
  writer.add_key_length(config.head_dim)
  writer.add_value_length(config.head_dim)
  writer.add_layer_norm_rms_eps(config.rms_norm_eps)
  writer.add_rope_freq_base(config.rope_theta)
  writer.add_vocab_size(config.vocab_size)
  writer.add_tokenizer_model("none")  # token ids in, token ids out
  for tname, w in tensors.items():
    writer.add_tensor(tname, w)
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()
  return {tname: int(w.nbytes) for tname, w in tensors.items()}


def tensor_bytes(path: str) -> dict[str, int]:
  """Each tensor's stored bytes in the GGUF file at `path` (any weight type)."""
  import gguf  # pylint: disable=import-outside-toplevel

  return {t.name: int(t.n_bytes) for t in gguf.GGUFReader(path).tensors}


def bytes_per_token(path: str) -> int:
  """Bytes a one-token forward reads from the GGUF at `path`: every tensor once, except the
  token embedding, of which one row is read."""
  import gguf  # pylint: disable=import-outside-toplevel

  total = 0
  for t in gguf.GGUFReader(path).tensors:
    if t.name == "token_embd.weight":
      rows = int(t.shape[-1])  # GGUF shape: innermost first
      total += int(t.n_bytes) // max(rows, 1)
    else:
      total += int(t.n_bytes)
  return total
