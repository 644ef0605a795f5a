"""A GGUF file's tokenizer (`tokenizer.ggml.*` metadata) as a `tokenizers` tokenizer.

llama.cpp stores a byte-level BPE vocabulary (`tokenizer.ggml.model = "gpt2"`) as its token
strings (in GPT-2's byte-to-character spelling), its merges, each token's type (control tokens
such as `<|im_start|>` are 3, user-defined ones 4), the bos/eos/unk/pad ids and the name of
the pre-tokenizer (`tokenizer.ggml.pre`): the regular expressions that split text into words
before BPE runs, which llama.cpp keeps in its source, not in the file. The pre-tokenizers
known here are rebuilt from that name; another name is refused rather than tokenized with the
wrong split. Control tokens become special added tokens, user-defined ones plain added tokens
(matched whole in text, as llama.cpp does). `tokenizer.chat_template` and the special token
strings ride along on the `Tokenizer` for chat serving.

SentencePiece vocabularies (`tokenizer.ggml.model = "llama"`, Gemma's files) are not built
yet: such a file loads without a tokenizer, with a warning (token ids still work).
"""

from __future__ import annotations

import warnings
from typing import Any

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors

from jaxspec.errors import ConfigError
from jaxspec.io.tokenizer import Tokenizer

CONTROL, USER_DEFINED = 3, 4

# llama.cpp's pre-tokenizer regular expressions (llama-vocab.cpp), by `tokenizer.ggml.pre`.
_LLAMA3_SPLIT = (
  r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
  r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
  r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
  r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# GPT-2's split (tokenizers' ByteLevel regex); "digits" first splits every digit off alone.
PRE_TOKENIZERS = {
  **dict.fromkeys(("default", "gpt2", "gpt-2", "mpt", "olmo", "jais"), "gpt2"),
  **dict.fromkeys(("smollm", "starcoder", "refact", "command-r", "codeshell"), "digits"),
  **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "smaug-bpe", "dbrx", "falcon3"), "llama3"),
  **dict.fromkeys(("qwen2", "deepseek-r1-qwen"), "qwen2"),
}


def byte_alphabet() -> dict[int, str]:
  """GPT-2's byte → character map: printable Latin-1 bytes stand for themselves, the other
  68 bytes for the characters from U+0100 on, in byte order."""
  printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
  table = {b: chr(b) for b in printable}
  others = [b for b in range(256) if b not in table]
  table.update({b: chr(256 + n) for n, b in enumerate(others)})
  return table


def _pre_tokenizer(pre: str, path: str) -> Any:
  kind = PRE_TOKENIZERS.get(pre)
  if kind is None:
    raise ConfigError(
      f"{path}: tokenizer.ggml.pre {pre!r} is not a pre-tokenizer jaxspec knows "
      f"({', '.join(sorted(PRE_TOKENIZERS))})"
    )
  if kind == "gpt2":
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
  if kind == "digits":
    return pre_tokenizers.Sequence(
      [
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
      ]
    )
  split = _LLAMA3_SPLIT if kind == "llama3" else _QWEN2_SPLIT
  return pre_tokenizers.Sequence(
    [
      pre_tokenizers.Split(Regex(split), behavior="isolated"),
      pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ]
  )


def _list(meta: Any, key: str) -> list:
  value = meta.get(key)
  if value is None:
    return []
  if not isinstance(value, list):
    raise ConfigError(f"{meta.path}: GGUF metadata {key} is not an array")
  return value


def from_metadata(meta: Any, path: str) -> Tokenizer | None:
  """The tokenizer `meta` (a `jaxspec.io.gguf.Metadata`) describes, or None when the file
  carries none (or a SentencePiece one, with a warning)."""
  kind = meta.get("tokenizer.ggml.model")
  if kind in (None, "none"):
    return None
  if kind != "gpt2":
    warnings.warn(
      f"{path}: tokenizer.ggml.model {kind!r} (not byte-level BPE) is not built by jaxspec "
      "yet; the model loads without a tokenizer (pass token ids)",
      stacklevel=3,
    )
    return None
  tokens = _list(meta, "tokenizer.ggml.tokens")
  types = _list(meta, "tokenizer.ggml.token_type") or [1] * len(tokens)
  merges = _list(meta, "tokenizer.ggml.merges")
  if not tokens or len(types) != len(tokens):
    raise ConfigError(
      f"{path}: tokenizer.ggml.tokens ({len(tokens)}) and tokenizer.ggml.token_type "
      f"({len(types)}) must be non-empty and of one length"
    )
  spelling = byte_alphabet()
  alphabet = set(spelling.values())
  vocab = {}
  for i, tok in enumerate(tokens):  # a token outside the byte alphabet: spelled byte by byte
    vocab[tok if set(tok) <= alphabet else "".join(spelling[b] for b in tok.encode())] = i
  pairs = []
  for m in merges:
    left, sep, right = m.partition(" ")
    if not sep:
      raise ConfigError(f"{path}: tokenizer.ggml.merges entry {m!r} is not 'left right'")
    pairs.append((left, right))
  backend = tokenizers.Tokenizer(
    models.BPE(
      vocab=vocab, merges=pairs, continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False
    )
  )
  backend.pre_tokenizer = _pre_tokenizer(meta.get("tokenizer.ggml.pre", "default"), path)
  backend.decoder = decoders.ByteLevel()
  # Control tokens spelled outside the byte alphabet are llama.cpp mislabels: left alone.
  backend.add_special_tokens(
    [
      AddedToken(tok, special=True, normalized=False)
      for tok, t in zip(tokens, types, strict=True)
      if t == CONTROL and set(tok) <= alphabet
    ]
  )
  backend.add_tokens(
    [
      AddedToken(tok, special=False, normalized=False)
      for tok, t in zip(tokens, types, strict=True)
      if t == USER_DEFINED and tok in vocab
    ]
  )
  special = {}
  for name, key in (("bos", "bos"), ("eos", "eos"), ("unk", "unknown"), ("pad", "padding")):
    idx = meta.get(f"tokenizer.ggml.{key}_token_id")
    if idx is not None:
      if not 0 <= int(idx) < len(tokens):
        raise ConfigError(f"{path}: tokenizer.ggml.{key}_token_id {idx} is not a token id")
      special[f"{name}_token"] = tokens[int(idx)]
  if meta.get("tokenizer.ggml.add_bos_token") and "bos_token" in special:
    bos = special["bos_token"]
    backend.post_processor = processors.TemplateProcessing(
      single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, vocab[bos])]
    )
  template = meta.get("tokenizer.chat_template")
  return Tokenizer(
    backend,
    source=path,
    chat_template=template if isinstance(template, str) else None,
    special_tokens=special,
  )
