"""A thin wrapper around `tokenizers.Tokenizer` that knows jaxspec's special tokens.

jaxspec's own models use a byte-level BPE tokenizer (launch/train_tokenizer.py), so
`decode(encode(text)) == text` exactly for any string. Three special tokens matter to
the library: `<|endoftext|>` (end of a document; the EOS id), `<|pad|>` (batch padding)
and `<|mask|>` (the placeholder DFlash drafters fill in). Their ids are looked up by
string, so any Hugging Face `tokenizer.json` loads; a token it lacks reads as `None`.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

import tokenizers

EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
MASK_TOKEN = "<|mask|>"
SPECIAL_TOKENS = (EOS_TOKEN, PAD_TOKEN, MASK_TOKEN)

TOKENIZER_FILE = "tokenizer.json"
_ASSETS_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "assets")

_T = TypeVar("_T")


def bundled_tokenizer_path() -> str:
  """Returns the path of the tokenizer.json shipped with jaxspec (stdlib-trained)."""
  return os.path.join(_ASSETS_DIR, TOKENIZER_FILE)


class Tokenizer:
  """Encodes text to token ids and back; exposes the EOS, pad and mask ids.

  Attributes:
    backend: the wrapped `tokenizers.Tokenizer`.
    source: where it was loaded from (used in messages), or None.
    chat_template: the model's chat template (Jinja) when it came with the tokenizer (a GGUF
      file's `tokenizer.chat_template`), else None (a HF directory keeps it in its own files).
    special_tokens: the template's special token strings (`bos_token`, `eos_token`, ...).
  """

  def __init__(
    self,
    backend: tokenizers.Tokenizer,
    source: str | None = None,
    chat_template: str | None = None,
    special_tokens: dict[str, str] | None = None,
  ):
    if not isinstance(backend, tokenizers.Tokenizer):
      raise TypeError(f"expected a tokenizers.Tokenizer, got {type(backend).__name__}")
    self.backend = backend
    self.source = source
    self.chat_template = chat_template
    self.special_tokens = dict(special_tokens or {})
    self._fingerprint: str | None = None

  # ---- construction ---------------------------------------------------------

  @classmethod
  def from_file(cls, path: str | os.PathLike[str]) -> Tokenizer:
    """Loads a `tokenizer.json` file (or a directory containing one, or a GGUF file's)."""
    path = os.fspath(path)
    if os.path.isdir(path):
      return cls.from_dir(path)
    if path.lower().endswith(".gguf") and os.path.isfile(path):
      from jaxspec.io import gguf  # pylint: disable=import-outside-toplevel

      tokenizer = gguf.GGUFCheckpoint(path).tokenizer()
      if tokenizer is None:
        raise ValueError(f"GGUF file {path!r} carries no tokenizer jaxspec can build")
      return tokenizer
    if not os.path.isfile(path):
      raise FileNotFoundError(f"tokenizer file not found: {path!r}")
    try:
      backend = tokenizers.Tokenizer.from_file(path)
    except Exception as e:  # tokenizers raises a bare Exception on bad JSON.
      raise ValueError(f"could not parse tokenizer file {path!r}: {e}") from e
    return cls(backend, source=path)

  @classmethod
  def from_dir(cls, model_dir: str | os.PathLike[str]) -> Tokenizer:
    """Loads `tokenizer.json` from a model directory (Hugging Face layout)."""
    model_dir = os.fspath(model_dir)
    if not os.path.isdir(model_dir):
      raise FileNotFoundError(f"model directory not found: {model_dir!r}")
    path = os.path.join(model_dir, TOKENIZER_FILE)
    if not os.path.isfile(path):
      found = sorted(os.listdir(model_dir))[:20]
      raise FileNotFoundError(
        f"no {TOKENIZER_FILE} in model directory {model_dir!r} (found: {found})"
      )
    return cls.from_file(path)

  @classmethod
  def from_str(cls, json_str: str) -> Tokenizer:
    """Builds a tokenizer from the JSON text of a `tokenizer.json`."""
    return cls(tokenizers.Tokenizer.from_str(json_str), source="<string>")

  @classmethod
  def bundled(cls) -> Tokenizer:
    """Loads the tokenizer shipped with jaxspec (byte-level BPE, 8192 ids)."""
    path = bundled_tokenizer_path()
    if not os.path.isfile(path):
      raise FileNotFoundError(
        f"bundled tokenizer missing at {path!r}; "
        "run `python -m launch.train_tokenizer` to create it"
      )
    return cls.from_file(path)

  # ---- encoding and decoding ------------------------------------------------------

  def encode(self, text: str, *, split_special_tokens: bool = False) -> list[int]:
    """Encodes one string to token ids; adds no BOS/EOS.

    Args:
      text: the text.
      split_special_tokens: if True, special-token strings inside `text` (say a
        literal "<|endoftext|>" in a source file) are encoded as ordinary text,
        so that only the caller inserts special ids. Round-trips either way.
    """
    if not isinstance(text, str):
      raise TypeError(f"encode expects a str, got {type(text).__name__}")
    return self._with_split(
      split_special_tokens, lambda: self.backend.encode(text, add_special_tokens=False).ids
    )

  def encode_batch(
    self, texts: Sequence[str], *, split_special_tokens: bool = False
  ) -> list[list[int]]:
    """Encodes many strings (in parallel, in Rust); see `encode`."""
    texts = list(texts)
    for t in texts:
      if not isinstance(t, str):
        raise TypeError(f"encode_batch expects str items, got {type(t).__name__}")

    def run() -> list[list[int]]:
      encs = self.backend.encode_batch(texts, add_special_tokens=False)
      return [e.ids for e in encs]

    return self._with_split(split_special_tokens, run)

  def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
    """Decodes token ids to text; every id must be in [0, vocab_size)."""
    ids = [int(i) for i in ids]
    n = self.vocab_size
    bad = [i for i in ids if not 0 <= i < n]
    if bad:
      raise ValueError(f"token ids outside the vocabulary [0, {n}): {bad[:10]}")
    return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

  def decode_batch(
    self, batch: Iterable[Iterable[int]], skip_special_tokens: bool = False
  ) -> list[str]:
    """Decodes several id sequences; see `decode`."""
    return [self.decode(ids, skip_special_tokens=skip_special_tokens) for ids in batch]

  def _with_split(self, split: bool, fn: Callable[[], _T]) -> _T:
    """Runs `fn` with the backend's `encode_special_tokens` set to `split`."""
    old = self.backend.encode_special_tokens
    if old == split:
      return fn()
    self.backend.encode_special_tokens = split
    try:
      return fn()
    finally:
      self.backend.encode_special_tokens = old

  # ---- vocabulary ----------------------------------------------------------------

  @property
  def vocab_size(self) -> int:
    """Number of ids, special tokens included (embedding rows a model needs)."""
    return self.backend.get_vocab_size(with_added_tokens=True)

  def token_to_id(self, token: str) -> int | None:
    """The id of a token string, or None if it is not in the vocabulary."""
    return self.backend.token_to_id(token)

  def id_to_token(self, idx: int) -> str | None:
    """The token string of an id, or None."""
    return self.backend.id_to_token(int(idx))

  @property
  def eos_id(self) -> int | None:
    """Id of `<|endoftext|>` (document end; generation stops on it), or None."""
    return self.token_to_id(EOS_TOKEN)

  @property
  def pad_id(self) -> int | None:
    """Id of `<|pad|>`, or None."""
    return self.token_to_id(PAD_TOKEN)

  @property
  def mask_id(self) -> int | None:
    """Id of `<|mask|>` (the DFlash block placeholder), or None."""
    return self.token_to_id(MASK_TOKEN)

  @property
  def special_ids(self) -> dict[str, int]:
    """The jaxspec special tokens this tokenizer has, string -> id."""
    out = {}
    for tok in SPECIAL_TOKENS:
      idx = self.token_to_id(tok)
      if idx is not None:
        out[tok] = idx
    return out

  @property
  def fingerprint(self) -> str:
    """sha256 of the serialized tokenizer; equal fingerprints tokenize alike.

    Used to key caches of tokenized corpora.
    """
    if self._fingerprint is None:
      blob = self.backend.to_str().encode("utf-8")
      self._fingerprint = hashlib.sha256(blob).hexdigest()
    return self._fingerprint

  # ---- saving and Hugging Face interop ----------------------------------------------

  def save(self, path: str | os.PathLike[str]) -> str:
    """Writes `tokenizer.json` to `path` (a file, or a directory to put it in)."""
    path = os.fspath(path)
    if os.path.isdir(path):
      path = os.path.join(path, TOKENIZER_FILE)
    self.backend.save(path, pretty=False)
    return path

  def hf_tokenizer_config(self) -> dict[str, Any]:
    """`tokenizer_config.json` contents telling transformers the special tokens."""
    cfg: dict[str, Any] = {
      "tokenizer_class": "PreTrainedTokenizerFast",
      "clean_up_tokenization_spaces": False,
    }
    # As GPT-2: <|endoftext|> doubles as BOS and UNK (byte-level BPE has no UNK).
    for key, tok in (
      ("bos_token", EOS_TOKEN),
      ("eos_token", EOS_TOKEN),
      ("unk_token", EOS_TOKEN),
      ("pad_token", PAD_TOKEN),
      ("mask_token", MASK_TOKEN),
    ):
      if self.token_to_id(tok) is not None:
        cfg[key] = tok
    cfg.update(self.special_tokens)  # the model's own, when it states them (a GGUF file)
    if self.chat_template is not None:
      cfg["chat_template"] = self.chat_template
    return cfg

  def save_hf(self, model_dir: str | os.PathLike[str]) -> None:
    """Writes tokenizer.json, tokenizer_config.json and special_tokens_map.json."""
    model_dir = os.fspath(model_dir)
    os.makedirs(model_dir, exist_ok=True)
    self.save(os.path.join(model_dir, TOKENIZER_FILE))
    cfg = self.hf_tokenizer_config()
    smap = {k: v for k, v in cfg.items() if k.endswith("_token")}
    for name, obj in (("tokenizer_config.json", cfg), ("special_tokens_map.json", smap)):
      with open(os.path.join(model_dir, name), "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2)
        f.write("\n")

  def to_hf(self) -> Any:
    """Returns a `transformers.PreTrainedTokenizerFast` with special tokens set."""
    from transformers import PreTrainedTokenizerFast  # pylint: disable=g-import-not-at-top

    kwargs = {k: v for k, v in self.hf_tokenizer_config().items() if k != "tokenizer_class"}
    backend = tokenizers.Tokenizer.from_str(self.backend.to_str())  # A private copy.
    return PreTrainedTokenizerFast(tokenizer_object=backend, **kwargs)

  def __repr__(self) -> str:
    return (
      f"Tokenizer(vocab_size={self.vocab_size}, eos_id={self.eos_id}, "
      f"pad_id={self.pad_id}, mask_id={self.mask_id}, source={self.source!r})"
    )
