"""Tests for jaxspec.io.tokenizer and the bundled byte-level BPE tokenizer."""

from __future__ import annotations

import importlib.util
import json
import os

import numpy as np
import pytest
import tokenizers
from tokenizers import models as tk_models

from jaxspec.errors import CheckpointError
from jaxspec.io import tokenizer as tok_lib
from jaxspec.io.tokenizer import EOS_TOKEN, MASK_TOKEN, PAD_TOKEN, Tokenizer
from jaxspec.serve import text as text_lib
from jaxspec.train import data

TRICKY = [
  "",
  " ",
  "\n",
  "    ",
  "\t\tindented\twith tabs\n",
  "def f(x):\n    return x  \n\n\n",
  "trailing spaces   \n   leading",
  "windows\r\nline\r\nends\r\n",
  "mixed \r old mac \r",
  "héllo wörld, naïve café, Ångström",
  "日本語のテキスト 中文 한국어",
  "emoji 🎉🐍👩‍💻 flags 🇫🇷",
  "combining e\u0301 vs \u00e9, zero\u200bwidth, bom \ufeff",
  "rtl: שלום مرحبا",
  "control \x00 \x01 \x7f \x1b[31m",
  "byte-level alphabet chars: Ġ Ċ ĉ Ā",
  "specials inline: <|endoftext|> <|pad|><|mask|> <|unknown|>",
  "<|endoftext|>",
  "s = '''\n  doc\n'''  # comment with ''' and \"\"\"\n",
  "x" * 5000,
  " " * 1000 + "\n" * 100,
  "\u2028line sep\u2029para sep\x0b\x0c",
  "math: ∀x∈ℝ, x² ≥ 0; ≠ ≤ ∞",
]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
  return Tokenizer.bundled()


def test_bundled_asset_small_and_sized(tok):
  path = tok_lib.bundled_tokenizer_path()
  assert os.path.isfile(path)
  assert os.path.getsize(path) < 1_000_000
  assert tok.vocab_size == 8192


def test_special_ids_exist_and_distinct(tok):
  ids = [tok.eos_id, tok.pad_id, tok.mask_id]
  assert all(isinstance(i, int) and 0 <= i < tok.vocab_size for i in ids)
  assert len(set(ids)) == 3
  assert tok.special_ids == {EOS_TOKEN: tok.eos_id, PAD_TOKEN: tok.pad_id, MASK_TOKEN: tok.mask_id}
  for s, i in tok.special_ids.items():
    assert tok.decode([i]) == s
    assert tok.decode([i], skip_special_tokens=True) == ""
    assert tok.encode(s) == [i]


@pytest.mark.parametrize("text", TRICKY, ids=range(len(TRICKY)))
def test_round_trip_tricky(tok, text):
  assert tok.decode(tok.encode(text)) == text
  assert tok.decode(tok.encode(text, split_special_tokens=True)) == text


def test_split_special_tokens(tok):
  text = "a<|endoftext|>b<|mask|>"
  assert tok.eos_id in tok.encode(text)
  split = tok.encode(text, split_special_tokens=True)
  assert not set(split) & set(tok.special_ids.values())
  assert tok.encode(text) == tok.encode(text)  # The flag is restored afterwards.


def test_round_trip_validation_files(tok):
  files = data.corpus_files("validation")[:6]
  docs = data.read_documents(files)
  assert sum(map(len, docs)) > 10_000
  for doc, ids in zip(docs, tok.encode_batch(docs), strict=True):
    assert tok.decode(ids) == doc
    assert len(ids) < len(doc)  # It compresses.


def test_encode_batch_matches_encode(tok):
  texts = TRICKY[:8]
  assert tok.encode_batch(texts) == [tok.encode(t) for t in texts]
  assert tok.decode_batch(tok.encode_batch(texts)) == texts


def test_eos_separates_documents(tok):
  stream = data.tokenize_documents(tok, ["first doc\n", "second doc\n"]).tolist()
  eos = tok.eos_id
  cut = stream.index(eos)
  assert tok.decode(stream[:cut]) == "first doc\n"
  assert tok.decode(stream[cut + 1 : -1]) == "second doc\n"
  assert stream[-1] == eos
  assert tok.decode(stream, skip_special_tokens=True) == "first doc\nsecond doc\n"


def test_fingerprint_stable(tok):
  again = Tokenizer.from_file(tok_lib.bundled_tokenizer_path())
  assert again.fingerprint == tok.fingerprint and len(tok.fingerprint) == 64


def test_errors(tmp_path, tok):
  with pytest.raises(FileNotFoundError, match="not found"):
    Tokenizer.from_file(tmp_path / "missing.json")
  with pytest.raises(FileNotFoundError, match="tokenizer.json"):
    Tokenizer.from_dir(tmp_path)
  with pytest.raises(FileNotFoundError, match="not found"):
    Tokenizer.from_dir(tmp_path / "nodir")
  bad = tmp_path / "bad.json"
  bad.write_text("{not json")
  with pytest.raises(ValueError, match="could not parse"):
    Tokenizer.from_file(bad)
  with pytest.raises(ValueError, match="outside the vocabulary"):
    tok.decode([0, tok.vocab_size])
  with pytest.raises(TypeError):
    tok.encode(b"bytes")  # type: ignore[arg-type]


def test_from_dir_and_save(tmp_path, tok):
  tok.save(tmp_path)
  loaded = Tokenizer.from_dir(tmp_path)
  assert loaded.fingerprint == tok.fingerprint
  assert Tokenizer.from_file(tmp_path).vocab_size == tok.vocab_size


def test_missing_special_tokens_are_none():
  plain = Tokenizer(tokenizers.Tokenizer(tk_models.BPE()))
  assert plain.eos_id is None and plain.pad_id is None and plain.mask_id is None
  assert plain.special_ids == {}


def test_train_tokenizer_small_corpus():
  from launch import train_tokenizer  # pylint: disable=g-import-not-at-top

  docs = ["def f(x):\n    return x + 1\n" * 20, "class A:\n    pass\n" * 20]
  t = Tokenizer(train_tokenizer.build_tokenizer(docs, vocab_size=300))
  assert (t.eos_id, t.pad_id, t.mask_id) == (0, 1, 2)
  assert t.vocab_size <= 300
  for text in TRICKY:
    assert t.decode(t.encode(text)) == text


@pytest.mark.skipif(
  importlib.util.find_spec("transformers") is None, reason="transformers not installed"
)
def test_hugging_face_compat(tmp_path, tok):
  from transformers import AutoTokenizer, PreTrainedTokenizerFast  # pylint: disable=g-import-not-at-top

  text = "def f(x):\n    return 'héllo' 🎉\n"
  hf = tok.to_hf()
  assert hf.encode(text) == tok.encode(text)
  assert (hf.eos_token_id, hf.pad_token_id, hf.mask_token_id) == (
    tok.eos_id,
    tok.pad_id,
    tok.mask_id,
  )
  assert hf.decode(hf.encode(text)) == text
  tok.save_hf(tmp_path)
  auto = AutoTokenizer.from_pretrained(str(tmp_path))
  assert (auto.eos_token_id, auto.pad_token_id, auto.mask_token_id) == (
    tok.eos_id,
    tok.pad_id,
    tok.mask_id,
  )
  assert auto.encode(text) == tok.encode(text)
  direct = PreTrainedTokenizerFast(
    tokenizer_file=tok_lib.bundled_tokenizer_path(),
    **{k: v for k, v in tok.hf_tokenizer_config().items() if k.endswith("_token")},
  )
  assert direct.mask_token_id == tok.mask_id
  ids = direct.encode("a" + EOS_TOKEN + "b")
  assert direct.decode(ids, skip_special_tokens=True) == "ab"


# ---- chat templates as transformers saves them ----------------------------------------------

TEMPLATE = (
  "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}"
  "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]


def test_chat_template_jinja_is_read_and_written_as_transformers_does(tmp_path, tok):
  """transformers >= 4.47 saves the template to chat_template.jinja: jaxspec reads the file
  (over tokenizer_config.json's key, as transformers does), writes it back on save_hf, and
  renders what transformers renders."""
  from transformers import PreTrainedTokenizerFast  # pylint: disable=g-import-not-at-top

  hf = tok.to_hf()
  hf.chat_template = TEMPLATE
  hf.bos_token = EOS_TOKEN
  published = tmp_path / "published"
  hf.save_pretrained(str(published))
  assert (published / tok_lib.CHAT_TEMPLATE_FILE).is_file()
  # A stale template left in tokenizer_config.json: the file must win.
  config_path = published / tok_lib.TOKENIZER_CONFIG_FILE
  config = json.loads(config_path.read_text())
  assert "chat_template" not in config
  config_path.write_text(json.dumps({**config, "chat_template": "stale {{ messages }}"}))
  loaded = Tokenizer.from_dir(published)
  assert loaded.chat_template == TEMPLATE
  found = tok_lib.read_chat_template(published)
  assert found.path.endswith(tok_lib.CHAT_TEMPLATE_FILE) and found.tokens["bos_token"] == EOS_TOKEN
  reference = PreTrainedTokenizerFast.from_pretrained(str(published))
  assert reference.chat_template == TEMPLATE
  want = reference.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
  assert text_lib.load_chat_template(str(published)).render(MESSAGES) == want

  exported = tmp_path / "exported"
  loaded.save_hf(exported)
  assert (exported / tok_lib.CHAT_TEMPLATE_FILE).read_text() == TEMPLATE
  assert PreTrainedTokenizerFast.from_pretrained(str(exported)).chat_template == TEMPLATE
  # A tokenizer without a template removes a stale file it would otherwise leave in charge.
  tok.save_hf(exported)
  assert not (exported / tok_lib.CHAT_TEMPLATE_FILE).exists()


def test_chat_template_in_tokenizer_config_is_read_when_there_is_no_file(tmp_path, tok):
  tok.save_hf(tmp_path)
  config_path = tmp_path / tok_lib.TOKENIZER_CONFIG_FILE
  config = json.loads(config_path.read_text())
  named = [{"name": "tool_use", "template": "x"}, {"name": "default", "template": TEMPLATE}]
  config_path.write_text(json.dumps({**config, "chat_template": named}))
  assert Tokenizer.from_dir(tmp_path).chat_template == TEMPLATE
  config_path.write_text(json.dumps({**config, "chat_template": 7}))
  with pytest.raises(CheckpointError, match="chat_template must be a string"):
    Tokenizer.from_dir(tmp_path)
  config_path.write_text(json.dumps(config))
  assert Tokenizer.from_dir(tmp_path).chat_template is None


# ---- Kimi's tiktoken.model -------------------------------------------------------------------

KIMI_TEXT = (
  "Hello World, it's the QUICK brown fox's 12345 jumps; don't stop!\n\n"
  "中文分词测试，这是一个句子。 日本語も少し。 Ünïcödé naïve café Ångström "
  "def f(x):\n    return x * 2  # comment\n"
)


SYLLABLES = ("ta", "te", "an", "na", "nt", "tan", "ant", "re", "er", "in", "ni", "st", "中", "文")


def _syllable_words(n: int, seed: int, longest: int = 4) -> list[str]:
  """Words of overlapping syllables: their merges compete, so the merge order matters."""
  rng = np.random.default_rng(seed)
  return ["".join(rng.choice(SYLLABLES, rng.integers(1, longest + 1))) for _ in range(n)]


@pytest.fixture(scope="module")
def kimi_dir(tmp_path_factory):
  """A tiny Kimi tokenizer directory as Moonshot ships one: tiktoken.model (base64 token and
  rank a line, trained here by tiktoken's own BPE trainer) and tokenizer_config.json naming
  some of the 258 special ids after the ranks."""
  import base64  # pylint: disable=import-outside-toplevel

  import tiktoken._educational  # pylint: disable=import-outside-toplevel

  split = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
  corpus = KIMI_TEXT * 4 + " ".join(_syllable_words(600, 1))
  ranks = tiktoken._educational.bpe_train(corpus, 256 + 160, split, visualise=None)  # pylint: disable=protected-access
  d = tmp_path_factory.mktemp("kimi")
  lines = [
    f"{base64.b64encode(t).decode()} {r}" for t, r in sorted(ranks.items(), key=lambda x: x[1])
  ]
  (d / "tiktoken.model").write_text("\n".join(lines) + "\n")
  n = len(ranks)
  named = {n: "[BOS]", n + 1: "[EOS]", n + 4: "<|im_end|>", n + 5: "<|im_user|>"}
  decoder = {str(i): {"content": s, "special": True} for i, s in named.items()}
  (d / tok_lib.TOKENIZER_CONFIG_FILE).write_text(json.dumps({"added_tokens_decoder": decoder}))
  return d, ranks


def _kimi_reference(d, ranks):
  """tiktoken's own Encoding with Kimi's pattern and special ids: the reference."""
  import tiktoken  # pylint: disable=import-outside-toplevel

  from jaxspec.io import tiktoken_files  # pylint: disable=import-outside-toplevel

  specials = tiktoken_files.special_tokens(str(d), len(ranks))
  return tiktoken.Encoding(
    "kimi",
    pat_str=tiktoken_files.KIMI_PATTERN,
    mergeable_ranks=ranks,
    special_tokens={s: i for i, s in specials.items()},
  )


KIMI_CASES = [
  KIMI_TEXT,
  "The QUICKBrown FOX'S ll 123456789 x",
  "中文English混合123abc",
  "[BOS]hi<|im_user|>q<|im_end|>\n[EOS]",
  "  \n\t x  y\r\n",
  "emoji 🎉 naïve",
  "<|reserved_token_430|>",
  *_syllable_words(6, 2, longest=30),
]


def test_kimi_tiktoken_model_encodes_as_tiktoken_does(kimi_dir, tmp_path):
  from transformers import PreTrainedTokenizerFast  # pylint: disable=g-import-not-at-top

  d, ranks = kimi_dir
  tok = Tokenizer.from_dir(d)
  ref = _kimi_reference(d, ranks)
  assert tok.vocab_size == len(ranks) + 258 == ref.n_vocab
  assert tok.token_to_id("[EOS]") == len(ranks) + 1
  assert tok.token_to_id(f"<|reserved_token_{len(ranks) + 2}|>") == len(ranks) + 2
  for text in KIMI_CASES:
    ids = ref.encode(text, allowed_special="all")
    assert tok.encode(text) == ids, text
    assert tok.decode(ids) == ref.decode(ids) == text
  # Saved as tokenizer.json: transformers reads the same tokenizer.
  tok.save_hf(tmp_path)
  hf = PreTrainedTokenizerFast.from_pretrained(str(tmp_path))
  assert hf.encode(KIMI_CASES[3]) == ref.encode(KIMI_CASES[3], allowed_special="all")


def test_kimi_tokenizer_broken_variants_disagree_with_tiktoken(kimi_dir, monkeypatch):
  """Merges out of rank order, or another pre-tokenizing pattern, change the tokens."""
  from jaxspec.io import tiktoken_files  # pylint: disable=import-outside-toplevel

  d, ranks = kimi_dir
  ref = _kimi_reference(d, ranks)
  want = [ref.encode(t, allowed_special="all") for t in KIMI_CASES]
  merges = tiktoken_files._merges  # pylint: disable=protected-access
  monkeypatch.setattr(tiktoken_files, "_merges", lambda r: merges(r)[::-1])
  assert [Tokenizer.from_dir(d).encode(t) for t in KIMI_CASES] != want
  monkeypatch.undo()
  monkeypatch.setattr(tiktoken_files, "KIMI_PATTERN", r" ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+")
  assert [Tokenizer.from_dir(d).encode(t) for t in KIMI_CASES] != want


def test_bad_tiktoken_files_are_checkpoint_errors(kimi_dir, tmp_path):
  d, _ = kimi_dir
  lines = (d / "tiktoken.model").read_text().splitlines()
  (tmp_path / "tiktoken.model").write_text("\n".join(lines[1:]) + "\n")  # byte 0 missing
  with pytest.raises(CheckpointError, match="ranks|single bytes"):
    Tokenizer.from_dir(tmp_path)
  (tmp_path / "tiktoken.model").write_text("\n".join(lines) + "\n")
  bad = {"added_tokens_decoder": {"3": {"content": "[BOS]"}}}  # an id of an ordinary token
  (tmp_path / tok_lib.TOKENIZER_CONFIG_FILE).write_text(json.dumps(bad))
  with pytest.raises(CheckpointError, match="outside the special ids"):
    Tokenizer.from_dir(tmp_path)
