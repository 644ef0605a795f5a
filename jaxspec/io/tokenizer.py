"""A thin wrapper around `tokenizers.Tokenizer` that knows jaxspec's special tokens.

jaxspec's own models use a byte-level BPE tokenizer (launch/train_tokenizer.py), so
`decode(encode(text)) == text` exactly for any string. Three special tokens matter to
the library: `<|endoftext|>` (end of a document; the EOS id), `<|pad|>` (batch padding)
and `<|mask|>` (the placeholder DFlash drafters fill in). Their ids are looked up by
string, so any Hugging Face `tokenizer.json` loads; a token it lacks reads as `None`.

A model directory's chat template travels with its tokenizer (`read_chat_template`): in
`chat_template.jinja` (what transformers >= 4.47 saves) or, in older layouts, under
`tokenizer_config.json`'s `chat_template`; the file wins, as in transformers. `save_hf` writes
it back to `chat_template.jinja`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

import tokenizers

from jaxspec.errors import CheckpointError
from jaxspec.io import tiktoken_files

EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
MASK_TOKEN = "<|mask|>"
SPECIAL_TOKENS = (EOS_TOKEN, PAD_TOKEN, MASK_TOKEN)

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
# tokenizer_config.json's token strings a chat template reads (`{{ bos_token }}`, ...).
TEMPLATE_TOKEN_KEYS = ("bos_token", "eos_token", "pad_token", "unk_token")
_ASSETS_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "assets")

_T = TypeVar("_T")


def has_tokenizer(model_dir: str | os.PathLike[str]) -> bool:
  """Whether a model directory holds a tokenizer `Tokenizer.from_dir` reads."""
  names = (TOKENIZER_FILE, tiktoken_files.TIKTOKEN_FILE)
  return any(os.path.isfile(os.path.join(model_dir, n)) for n in names)


def bundled_tokenizer_path() -> str:
  """Returns the path of the tokenizer.json shipped with jaxspec (stdlib-trained)."""
  return os.path.join(_ASSETS_DIR, TOKENIZER_FILE)


@dataclasses.dataclass(frozen=True)
class ChatTemplateSource:
  """A model directory's chat template as published.

  Attributes:
    template: the Jinja source, or None when the directory has none.
    tokens: tokenizer_config.json's bos/eos/pad/unk token strings (templates read them).
    path: the file the template came from, or None.
  """

  template: str | None = None
  tokens: dict[str, str] = dataclasses.field(default_factory=dict)
  path: str | None = None


def _read_json_object(path: str) -> dict:
  try:
    with open(path, encoding="utf-8") as f:
      obj = json.load(f)
  except (OSError, json.JSONDecodeError) as e:
    raise CheckpointError(f"{path}: cannot read it as JSON: {e}") from None
  if not isinstance(obj, dict):
    raise CheckpointError(f"{path}: must hold a JSON object, got {type(obj).__name__}")
  return obj


def read_chat_template(model_dir: str | os.PathLike[str] | None) -> ChatTemplateSource:
  """The chat template of a model directory, with transformers' precedence.

  `chat_template.jinja` (transformers >= 4.47 saves the template there, beside
  tokenizer_config.json) wins over tokenizer_config.json's `chat_template`, which is either a
  string or, for named templates, a list of {"name", "template"} whose "default" is used. The
  token strings come from tokenizer_config.json either way (a plain string or the AddedToken
  form {"content": ...}).
  """
  if model_dir is None:
    return ChatTemplateSource()
  model_dir = os.fspath(model_dir)
  config_path = os.path.join(model_dir, TOKENIZER_CONFIG_FILE)
  config = _read_json_object(config_path) if os.path.isfile(config_path) else {}
  tokens = {}
  for key in TEMPLATE_TOKEN_KEYS:
    value = config.get(key)
    if isinstance(value, dict):
      value = value.get("content")
    if isinstance(value, str):
      tokens[key] = value
  jinja_path = os.path.join(model_dir, CHAT_TEMPLATE_FILE)
  if os.path.isfile(jinja_path):
    try:
      with open(jinja_path, encoding="utf-8") as f:
        return ChatTemplateSource(f.read(), tokens, jinja_path)
    except (OSError, UnicodeDecodeError) as e:
      raise CheckpointError(f"{jinja_path}: cannot read it as UTF-8 text: {e}") from None
  template = config.get("chat_template")
  if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}]
    named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
    template = named.get("default")
  if template is None:
    return ChatTemplateSource(None, tokens)
  if not isinstance(template, str):
    raise CheckpointError(
      f"{config_path}: chat_template must be a string, got {type(template).__name__}"
    )
  return ChatTemplateSource(template, tokens, config_path)


class Tokenizer:
  """Encodes text to token ids and back; exposes the EOS, pad and mask ids.

  Attributes:
    backend: the wrapped `tokenizers.Tokenizer`.
    source: where it was loaded from (used in messages), or None.
    chat_template: the model's chat template (Jinja source): its directory's
      (`read_chat_template`) or a GGUF file's `tokenizer.chat_template`; written back by
      `save_hf`.
    special_tokens: the template's token strings (`bos_token`, `eos_token`, ...) when the
      tokenizer states them itself (a GGUF file's); a directory's are read with its template.
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
    """Loads `tokenizer.json` (else Kimi's `tiktoken.model`: `tiktoken_files`) and the chat
    template (`read_chat_template`) from a model directory (Hugging Face layout)."""
    model_dir = os.fspath(model_dir)
    if not os.path.isdir(model_dir):
      raise FileNotFoundError(f"model directory not found: {model_dir!r}")
    path = os.path.join(model_dir, TOKENIZER_FILE)
    tiktoken_path = os.path.join(model_dir, tiktoken_files.TIKTOKEN_FILE)
    if not os.path.isfile(path) and os.path.isfile(tiktoken_path):  # Kimi's layout
      backend = tiktoken_files.load_tiktoken_dir(model_dir)
      return cls(backend, tiktoken_path, read_chat_template(model_dir).template)
    if not os.path.isfile(path):
      found = sorted(os.listdir(model_dir))[:20]
      raise FileNotFoundError(
        f"no {TOKENIZER_FILE} in model directory {model_dir!r} (found: {found})"
      )
    tok = cls.from_file(path)
    tok.chat_template = read_chat_template(model_dir).template
    return tok

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
    return cfg

  def save_hf(self, model_dir: str | os.PathLike[str]) -> None:
    """Writes tokenizer.json, tokenizer_config.json, special_tokens_map.json and, when the
    tokenizer has one, the chat template to chat_template.jinja (as transformers saves it)."""
    model_dir = os.fspath(model_dir)
    os.makedirs(model_dir, exist_ok=True)
    self.save(os.path.join(model_dir, TOKENIZER_FILE))
    cfg = self.hf_tokenizer_config()
    smap = {k: v for k, v in cfg.items() if k.endswith("_token")}
    for name, obj in (("tokenizer_config.json", cfg), ("special_tokens_map.json", smap)):
      with open(os.path.join(model_dir, name), "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2)
        f.write("\n")
    jinja_path = os.path.join(model_dir, CHAT_TEMPLATE_FILE)
    if self.chat_template is not None:
      with open(jinja_path, "w", encoding="utf-8") as f:
        f.write(self.chat_template)
    elif os.path.exists(jinja_path):  # a stale template would win over this tokenizer's none
      os.remove(jinja_path)

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
