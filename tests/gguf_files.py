"""GGUF files written as llama.cpp's converter (convert_hf_to_gguf.py) writes them, for tests.

`write_gguf` takes a transformers model's HF-named float tensors and writes them under
llama.cpp's names and layouts with the gguf package's own writer: llama's q/k rows permuted per
head, Gemma's norms stored as 1 + w, Qwen3-MoE's experts stacked, every matrix whose rows fit
the type's block in the quantization type asked for (the others in F32, as llama.cpp falls
back). Types gguf cannot quantize in Python (the K-quants) get random blocks with small
scales: the file, not the float model, is then the reference, and transformers reads the same
file. A tiny byte-level BPE vocabulary can ride along as `tokenizer.ggml.*`.
"""

from __future__ import annotations

import re

import gguf
import numpy as np

from jaxspec.io import gguf as gguf_io
from jaxspec.io import gguf_tokenizer

T = gguf.GGMLQuantizationType
QUANT_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K")
# Byte offsets of each K-quant block's float16 scale fields (ggml-common.h block layouts).
_K_SCALES = {T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,)}
_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
_EXPERT = re.compile(r"mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")


def permute_rows(w: np.ndarray, heads: int) -> np.ndarray:
  """llama.cpp's q/k row order for its RoPE: each head's two halves interleaved."""
  return w.reshape(heads, 2, -1, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _random_k_blocks(qtype, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
  block, nbytes = gguf.GGML_QUANT_SIZES[qtype]
  rows, cols = int(np.prod(shape[:-1])), shape[-1]
  raw = rng.integers(0, 256, size=(rows, cols // block, nbytes), dtype=np.uint8)
  scale = np.frombuffer(np.float16(2e-4 if qtype == T.Q6_K else 1e-3).tobytes(), np.uint8)
  for offset in _K_SCALES[qtype]:
    raw[..., offset : offset + 2] = scale
  return raw.reshape(*shape[:-1], cols // block * nbytes)


def encode(w: np.ndarray, qtype_name: str, rng: np.random.Generator) -> tuple[np.ndarray, object]:
  """(stored array, type) of one tensor: 1-D ones and rows the block does not divide in F32."""
  qtype = T[qtype_name]
  block = gguf.GGML_QUANT_SIZES[qtype][0]
  if w.ndim == 1 or w.shape[-1] % block:
    return np.ascontiguousarray(w, np.float32), T.F32
  if qtype in _K_SCALES:
    return _random_k_blocks(qtype, w.shape, rng), qtype
  if qtype == T.F16:
    return w.astype(np.float16), qtype
  if qtype == T.F32:
    return np.ascontiguousarray(w, np.float32), qtype
  return gguf.quants.quantize(np.ascontiguousarray(w, np.float32), qtype), qtype


def gguf_tensors(hf_tensors: dict, arch: str, config: dict) -> dict[str, np.ndarray]:
  """llama.cpp's float tensors of HF-named ones: its names, permutations and stacking."""
  record = gguf_io.ARCHITECTURES[arch]
  names = gguf_io.SANDWICH_LAYER_NAMES if record.sandwich else gguf_io.LAYER_NAMES
  experts: dict[tuple[str, str], dict[int, np.ndarray]] = {}
  out = {}
  for name, w in hf_tensors.items():
    w = np.asarray(w, np.float32)
    if record.norms_plus_one and name.endswith("norm.weight"):
      w = w + 1.0
    if name in gguf_io.GLOBAL_NAMES:
      out[gguf_io.GLOBAL_NAMES[name]] = w
      continue
    layer, rest = _LAYER.fullmatch(name).groups()
    if rest == "mlp.experts.gate_up_proj":  # transformers' fused experts: [E, 2 * I, H]
      gate, up = np.split(w, 2, axis=1)
      out[f"blk.{layer}.ffn_gate_exps.weight"], out[f"blk.{layer}.ffn_up_exps.weight"] = gate, up
      continue
    if rest == "mlp.experts.down_proj":
      out[f"blk.{layer}.ffn_down_exps.weight"] = w
      continue
    m = _EXPERT.fullmatch(rest)
    if m:
      experts.setdefault((layer, m.group(2)), {})[int(m.group(1))] = w
      continue
    if record.permuted_qk and rest in ("self_attn.q_proj.weight", "self_attn.k_proj.weight"):
      heads = config["num_attention_heads" if "q_proj" in rest else "num_key_value_heads"]
      w = permute_rows(w, heads)
    out[f"blk.{layer}.{names[rest]}"] = w
  by_proj = {v: k for k, v in gguf_io.EXPERT_NAMES.items()}
  for (layer, proj), ws in experts.items():
    out[f"blk.{layer}.{by_proj[proj]}"] = np.stack([ws[e] for e in range(len(ws))])
  return out


def tiny_vocab() -> dict:
  """`write_gguf`'s tokenizer: a byte-level BPE vocabulary (the 256 byte symbols, a few merges,
  three control tokens), llama.cpp's smollm pre-tokenizer and a ChatML template."""
  symbols = [gguf_tokenizer.byte_alphabet()[b] for b in range(256)]
  merges = ["h e", "l l", "he ll", "hell o", "Ġ w", "Ġw o", "r l", "Ġwo rl"]
  tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *symbols]
  tokens += [m.replace(" ", "") for m in merges]
  template = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
  )
  return {
    "tokens": tokens,
    "types": [3, 3, 3] + [1] * (len(tokens) - 3),
    "merges": merges,
    "pre": "smollm",
    "template": template,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "padding_token_id": 2,
  }


def rope_freqs(config: dict) -> np.ndarray | None:
  """llama.cpp converter's `rope_freqs.weight` of a Llama 3 config (llama3 RoPE), else None:
  each frequency's divisor, computed in float32 branch by branch as the converter does."""
  rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
  if rope.get("rope_type") != "llama3":
    return None
  dim, base = config["head_dim"], rope["rope_theta"]
  factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
  old = rope["original_max_position_embeddings"]
  out = []
  for freq in 1.0 / base ** (np.arange(0, dim, 2, dtype=np.float32) / dim):
    wavelen = 2 * np.pi / freq
    if wavelen < old / high:
      out.append(1.0)
    elif wavelen > old / low:
      out.append(factor)
    else:
      smooth = (old / wavelen - low) / (high - low)
      out.append(1 / ((1 - smooth) / factor + smooth))
  return np.asarray(out, np.float32)


def add_tokenizer(writer, tokens, types, merges, pre="default", template=None, **ids) -> None:
  writer.add_tokenizer_model("gpt2")
  writer.add_tokenizer_pre(pre)
  writer.add_token_list(tokens)
  writer.add_token_types(types)
  writer.add_token_merges(merges)
  for key, value in ids.items():
    writer.add_uint32(f"tokenizer.ggml.{key}", value)
  if template is not None:
    writer.add_chat_template(template)


def write_gguf(
  path: str,
  arch: str,
  config: dict,
  hf_tensors: dict,
  qtype: str = "F32",
  seed: int = 0,
  tokenizer: dict | None = None,
) -> None:
  """Writes a GGUF of `arch` (llama.cpp's name) with the HF `config` dict's hyperparameters."""
  rng = np.random.default_rng(seed)
  writer = gguf.GGUFWriter(path, arch)
  writer.add_context_length(config["max_position_embeddings"])
  writer.add_embedding_length(config["hidden_size"])
  writer.add_block_count(config["num_hidden_layers"])
  writer.add_feed_forward_length(config["intermediate_size"])
  writer.add_head_count(config["num_attention_heads"])
  writer.add_head_count_kv(config["num_key_value_heads"])
  writer.add_key_length(config["head_dim"])
  writer.add_value_length(config["head_dim"])
  writer.add_rope_dimension_count(config["head_dim"])
  writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
  rope = config.get("rope_parameters") or {}
  rope = rope.get("full_attention", rope)  # Gemma 3: per layer type (sliding: llama.cpp's 10000)
  writer.add_rope_freq_base(rope.get("rope_theta", config.get("rope_theta", 10000.0)))
  writer.add_vocab_size(config["vocab_size"])
  experts = config.get("num_experts") or config.get("num_local_experts")
  if experts:
    writer.add_expert_count(experts)
    writer.add_expert_used_count(config["num_experts_per_tok"])
    writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
  if config.get("sliding_window"):
    writer.add_sliding_window(config["sliding_window"])
  if tokenizer is not None:
    add_tokenizer(writer, **tokenizer)
  tensors = gguf_tensors(hf_tensors, arch, config)
  if rope_freqs(config) is not None:
    tensors["rope_freqs.weight"] = rope_freqs(config)
  for name, w in tensors.items():
    data, t = encode(w, qtype, rng)
    writer.add_tensor(name, data, raw_dtype=t)
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()
