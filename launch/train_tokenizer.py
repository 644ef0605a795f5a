"""Trains jaxspec's byte-level BPE tokenizer on the train split of a text corpus.

Byte-level BPE (GPT-2 style: ByteLevel pre-tokenizer and decoder, no normalizer) maps
every string to ids and back exactly, whitespace, indentation and unicode included.
The vocabulary is 8192 ids by default with three special tokens: `<|endoftext|>`
(between documents), `<|pad|>` and `<|mask|>` (DFlash drafters need a mask token).
Only the train split is read, so validation text stays unseen.

Usage:
  python -m launch.train_tokenizer                      # stdlib -> jaxspec/assets/tokenizer.json
  python -m launch.train_tokenizer --root=/my/corpus --suffixes=.txt,.md --output=/tmp/tok.json
  python -m launch.train_tokenizer --stats_only         # print corpus stats for the bundled one
"""

from __future__ import annotations

import os
import sys
import time

from absl import app
from absl import flags
from absl import logging
import tokenizers
from tokenizers import decoders
from tokenizers import models
from tokenizers import pre_tokenizers
from tokenizers import trainers

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from jaxspec.io import tokenizer as tok_lib  # pylint: disable=wrong-import-position
from jaxspec.train import data  # pylint: disable=wrong-import-position
from launch import cli  # pylint: disable=wrong-import-position

_ROOT = flags.DEFINE_string("root", None, "Corpus folder; default: the Python stdlib.")
_SUFFIXES = flags.DEFINE_list(
  "suffixes", list(data.DEFAULT_SUFFIXES), "File name endings to include."
)
_EXCLUDE = flags.DEFINE_list(
  "exclude_dirs", list(data.DEFAULT_EXCLUDE_DIRS), "Folder names skipped at any depth."
)
_VAL_FRACTION = flags.DEFINE_float(
  "val_fraction", data.DEFAULT_VAL_FRACTION, "Share of files held out (by path hash)."
)
_VOCAB_SIZE = flags.DEFINE_integer("vocab_size", 8192, "Total ids, special tokens included.")
_MIN_FREQUENCY = flags.DEFINE_integer("min_frequency", 2, "Least count of a merged pair.")
_OUTPUT = flags.DEFINE_string(
  "output", tok_lib.bundled_tokenizer_path(), "Where to write tokenizer.json."
)
_HF_DIR = flags.DEFINE_string(
  "hf_dir",
  None,
  "If set, also write tokenizer.json + tokenizer_config.json + "
  "special_tokens_map.json there (loadable by transformers.AutoTokenizer).",
)
_STATS_ONLY = flags.DEFINE_bool(
  "stats_only", False, "Skip training; print corpus stats for --output."
)


def build_tokenizer(
  documents: list[str], vocab_size: int, min_frequency: int = 2
) -> tokenizers.Tokenizer:
  """Trains a byte-level BPE on `documents` with jaxspec's special tokens first."""
  tok = tokenizers.Tokenizer(models.BPE())
  # No normalizer: any normalization (NFC, strip, ...) would break exact round-trips.
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(
    vocab_size=vocab_size,
    min_frequency=min_frequency,
    special_tokens=list(tok_lib.SPECIAL_TOKENS),  # ids 0, 1, 2.
    initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # All 256 bytes.
    show_progress=False,
  )
  tok.train_from_iterator(documents, trainer=trainer, length=len(documents))
  return tok


def corpus_stats(tokenizer: tok_lib.Tokenizer, root: str | None) -> dict[str, dict]:
  """Files, characters and tokens (documents joined by EOS) of each split."""
  out = {}
  for split in (data.TRAIN, data.VALIDATION):
    files = data.corpus_files(
      split,
      root,
      val_fraction=_VAL_FRACTION.value,
      suffixes=_SUFFIXES.value,
      exclude_dirs=_EXCLUDE.value,
    )
    docs = data.read_documents(files, root)
    tokens = data.tokenize_documents(tokenizer, docs)
    chars = sum(len(d) for d in docs)
    out[split] = {
      "files": len(files),
      "chars": chars,
      "bytes": sum(len(d.encode("utf-8")) for d in docs),
      "tokens": int(tokens.size),
      "chars_per_token": chars / max(1, tokens.size),
    }
  return out


def main(argv: list[str]) -> None:
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  root = _ROOT.value or data.stdlib_root()
  output = _OUTPUT.value
  if not _STATS_ONLY.value:
    files = data.corpus_files(
      data.TRAIN,
      root,
      val_fraction=_VAL_FRACTION.value,
      suffixes=_SUFFIXES.value,
      exclude_dirs=_EXCLUDE.value,
    )
    if not files:
      raise app.UsageError(f"no training files under {root!r}")
    docs = data.read_documents(files, root)
    logging.info(
      "training BPE (vocab %d) on %d train files, %d chars from %s",
      _VOCAB_SIZE.value,
      len(files),
      sum(map(len, docs)),
      root,
    )
    t0 = time.time()
    backend = build_tokenizer(docs, _VOCAB_SIZE.value, _MIN_FREQUENCY.value)
    logging.info("trained in %.1f s", time.time() - t0)
    os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
    tok = tok_lib.Tokenizer(backend)
    tok.save(output)
    if _HF_DIR.value:
      tok.save_hf(_HF_DIR.value)
  tok = tok_lib.Tokenizer.from_file(output)
  print(f"{output}: {os.path.getsize(output)} bytes, {tok!r}")
  for split, s in corpus_stats(tok, root).items():
    print(
      f"  {split:10s} files={s['files']:5d} chars={s['chars']:10d} "
      f"bytes={s['bytes']:10d} tokens={s['tokens']:9d} "
      f"chars/token={s['chars_per_token']:.2f}"
    )


if __name__ == "__main__":
  cli.run(main)
