"""Tests for jaxspec.train.data: corpus listing, the split, packed batches, prompts."""

from __future__ import annotations

import os
import random
import re

import numpy as np
import pytest

from jaxspec.io.tokenizer import EOS_TOKEN, Tokenizer
from jaxspec.train import data

EXCLUDED = ("test", "tests", "idlelib", "site-packages")


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
  return Tokenizer.bundled()


@pytest.fixture(scope="module")
def stdlib_files() -> list[str]:
  return data.corpus_files("all")


def _write(root, rel: str, text: str) -> None:
  path = os.path.join(root, rel)
  os.makedirs(os.path.dirname(path), exist_ok=True)
  with open(path, "w", encoding="utf-8") as f:
    f.write(text)


@pytest.fixture()
def tiny_corpus(tmp_path):
  """60 small files with a unique marker each, plus excluded folders and non-.py files."""
  root = tmp_path / "corpus"
  markers = {}
  for i in range(60):
    rel = f"pkg{i % 4}/mod_{i:02d}.py"
    marker = f"MARKER_{i:02d}_Z"
    markers[rel] = marker
    body = "".join(f"    x{j} = {i * j}  # line {j}\n" for j in range(12))
    _write(root, rel, f'def f_{i}(a, b):\n    """{marker} doc."""\n{body}')
  for rel in (
    "test/t.py",
    "pkg0/tests/t.py",
    "idlelib/i.py",
    "site-packages/s.py",
    "pkg1/notes.txt",
  ):
    _write(root, rel, "EXCLUDED_TEXT = 1\n")
  return str(root), markers


# ---- files and the split ---------------------------------------------------------------


def test_list_text_files_sorted_relative_and_filtered(tiny_corpus):
  root, markers = tiny_corpus
  files = data.list_text_files(root)
  assert files == sorted(markers)
  assert all(not os.path.isabs(f) and "\\" not in f for f in files)
  assert "pkg1/notes.txt" in data.list_text_files(root, suffixes=(".txt",))
  everything = data.list_text_files(root, suffixes=(), exclude_dirs=())
  assert "test/t.py" in everything and "site-packages/s.py" in everything


def test_list_text_files_missing_root(tmp_path):
  with pytest.raises(FileNotFoundError, match="not a directory"):
    data.list_text_files(tmp_path / "nope")


def test_stdlib_corpus_excludes_tests_and_idle(stdlib_files):
  assert len(stdlib_files) > 300
  assert "os.py" in stdlib_files
  for f in stdlib_files:
    assert f.endswith(".py")
    parts = f.split("/")[:-1]
    assert not set(parts) & set(EXCLUDED), f


def test_split_deterministic_and_order_independent(stdlib_files):
  first = {f: data.split_of(f) for f in stdlib_files}
  shuffled = list(stdlib_files)
  random.Random(0).shuffle(shuffled)
  second = {f: data.split_of(f) for f in shuffled}
  assert first == second
  assert data.corpus_files("validation") == data.corpus_files("validation")
  # Golden values: the split must never change silently (held-out sets depend on it).
  assert data.split_of("traceback.py") == "validation"
  assert data.split_of("os.py") == "train"
  assert data.split_of("asyncio/tasks.py") == "validation"
  # Path spelling does not matter.
  assert data.split_of(os.path.join("asyncio", "tasks.py")) == "validation"


def test_split_disjoint_covering_and_about_five_percent(stdlib_files):
  train = data.corpus_files("train")
  val = data.corpus_files("validation")
  assert not set(train) & set(val)
  assert sorted(train + val) == stdlib_files
  frac = len(val) / len(stdlib_files)
  assert 0.02 <= frac <= 0.10, frac


def test_split_fraction_extremes():
  assert data.split_of("a.py", val_fraction=0.0) == "train"
  assert data.split_of("a.py", val_fraction=1.0) == "validation"
  with pytest.raises(ValueError):
    data.split_of("a.py", val_fraction=1.5)
  with pytest.raises(ValueError, match="unknown split"):
    data.corpus_files("dev")


# ---- the token stream ------------------------------------------------------------------


def test_validation_never_in_training_stream(tiny_corpus, tok, tmp_path):
  root, markers = tiny_corpus
  val = data.corpus_files("validation", root, val_fraction=0.2)
  train = data.corpus_files("train", root, val_fraction=0.2)
  assert val and train and not set(val) & set(train)
  stream = data.token_stream(tok, "train", root, cache_dir=tmp_path / "cache", val_fraction=0.2)
  text = tok.decode(stream)
  for rel in val:
    assert markers[rel] not in text
  for rel in train:
    assert markers[rel] in text
  assert "EXCLUDED_TEXT" not in text
  # Documents are the train files in sorted order, each followed by <|endoftext|>.
  docs = text.split(EOS_TOKEN)
  assert docs[-1] == ""
  assert docs[:-1] == data.read_documents(train, root)
  assert int(np.sum(np.asarray(stream) == tok.eos_id)) == len(train)
  # Nor in any packed batch of a whole epoch.
  ds = data.PackedDataset(stream, seq_len=32, batch_size=4, seed=3)
  seen = set()
  for batch in ds.iterate(0, len(ds)):
    for row in batch:
      seen.update(re.findall(r"MARKER_\d\d_Z", tok.decode(row)))
  assert seen and seen <= {markers[r] for r in train}


def test_token_stream_cache(tiny_corpus, tok, tmp_path):
  root, _ = tiny_corpus
  cache = tmp_path / "cache"
  a = data.token_stream(tok, "validation", root, cache_dir=cache, val_fraction=0.2)
  files = sorted(os.listdir(cache))
  assert [f for f in files if f.endswith(".npy")] and all(
    f.startswith("validation-") for f in files
  )
  assert a.dtype == np.uint16
  b = data.token_stream(tok, "validation", root, cache_dir=cache, val_fraction=0.2)
  np.testing.assert_array_equal(a, b)
  assert sorted(os.listdir(cache)) == files  # Served from the cache.
  data.token_stream(tok, "train", root, cache_dir=cache, val_fraction=0.2)
  assert len(os.listdir(cache)) == 2 * len(files)  # A different key per split.


def test_tokenize_documents_separates_with_eos(tok):
  out = data.tokenize_documents(tok, ["a = 1\n", "", "b <|endoftext|> c"])
  eos = tok.eos_id
  expected = (
    tok.encode("a = 1\n")
    + [eos]
    + tok.encode("b <|endoftext|> c", split_special_tokens=True)
    + [eos]
  )
  assert out.tolist() == expected
  assert out.tolist().count(eos) == 2  # A literal "<|endoftext|>" is plain text.


# ---- packed batches --------------------------------------------------------------------


def _stream(n: int = 5000) -> np.ndarray:
  return np.arange(n, dtype=np.uint16)  # Distinct tokens: windows identify themselves.


def test_batch_shape_dtype_and_contiguity():
  ds = data.PackedDataset(_stream(), seq_len=16, batch_size=8, seed=0)
  b = ds.batch_at(0)
  assert b.shape == (8, 17) and b.dtype == np.int32
  np.testing.assert_array_equal(np.diff(b, axis=1), 1)  # Contiguous slices.
  offset, _ = ds.epoch_plan(0)
  assert np.all((b[:, 0] - offset) % 16 == 0)


def test_batch_at_deterministic_and_seeded():
  a = data.PackedDataset(_stream(), seq_len=16, batch_size=8, seed=1)
  b = data.PackedDataset(_stream(), seq_len=16, batch_size=8, seed=1)
  c = data.PackedDataset(_stream(), seq_len=16, batch_size=8, seed=2)
  for step in (0, 5, 37, 1000):
    np.testing.assert_array_equal(a.batch_at(step), b.batch_at(step))
  assert not np.array_equal(a.batch_at(0), c.batch_at(0))
  # Out of order calls give the same answers (pure function of step).
  np.testing.assert_array_equal(a.batch_at(1000), b.batch_at(1000))
  np.testing.assert_array_equal(
    a.batch_at(5), data.PackedDataset(_stream(), seq_len=16, batch_size=8, seed=1).batch_at(5)
  )


def test_resume_sees_same_data():
  ds = data.PackedDataset(_stream(), seq_len=16, batch_size=8, seed=0)
  full = list(ds.iterate(0, 3 * len(ds)))
  k = len(ds) + 3  # Resume in the middle of the second epoch.
  resumed = list(
    data.PackedDataset(_stream(), seq_len=16, batch_size=8, seed=0).iterate(k, len(full) - k)
  )
  for x, y in zip(full[k:], resumed, strict=True):
    np.testing.assert_array_equal(x, y)


def test_epoch_visits_distinct_windows_and_epochs_differ():
  ds = data.PackedDataset(_stream(), seq_len=16, batch_size=8, seed=0)
  e0 = np.concatenate([ds.batch_at(s)[:, 0] for s in range(len(ds))])
  e1 = np.concatenate([ds.batch_at(s)[:, 0] for s in range(len(ds), 2 * len(ds))])
  assert len(set(e0.tolist())) == len(e0) == len(ds) * 8
  assert e0.tolist() != e1.tolist()


def test_unshuffled_is_stream_order():
  ds = data.PackedDataset(_stream(100), seq_len=10, batch_size=3, shuffle=False)
  assert ds.windows_per_epoch == 9 and len(ds) == 3
  np.testing.assert_array_equal(ds.batch_at(0)[:, 0], [0, 10, 20])
  np.testing.assert_array_equal(ds.batch_at(2)[:, -1], [70, 80, 90])


def test_process_shards_partition_global_batch():
  full = data.PackedDataset(_stream(), seq_len=16, batch_size=8, seed=4)
  parts = [
    data.PackedDataset(
      _stream(), seq_len=16, batch_size=8, seed=4, process_index=i, process_count=4
    )
    for i in range(4)
  ]
  for step in (0, 9):
    np.testing.assert_array_equal(
      np.concatenate([p.batch_at(step) for p in parts]), full.batch_at(step)
    )
  assert parts[0].local_batch_size == 2


def test_packed_dataset_errors():
  with pytest.raises(ValueError, match="too short"):
    data.PackedDataset(_stream(20), seq_len=16, batch_size=8)
  with pytest.raises(ValueError, match="divisible"):
    data.PackedDataset(_stream(), seq_len=16, batch_size=6, process_count=4)
  ds = data.PackedDataset(_stream(), seq_len=16, batch_size=8)
  with pytest.raises(ValueError, match="step"):
    ds.batch_at(-1)


def test_from_corpus(tiny_corpus, tok, tmp_path):
  root, _ = tiny_corpus
  ds = data.PackedDataset.from_corpus(
    tok, "train", seq_len=32, batch_size=2, root=root, cache_dir=tmp_path / "c", val_fraction=0.2
  )
  assert ds.batch_at(0).shape == (2, 33)
  assert int(ds.batch_at(0).max()) < tok.vocab_size


# ---- benchmark prompts -----------------------------------------------------------------


def test_function_prompts_stdlib_validation():
  prompts = data.function_prompts("validation", n=32, max_lines=4)
  assert len(prompts) == 32
  assert prompts == data.function_prompts("validation", n=32, max_lines=4)
  assert len(set(prompts)) == 32
  val_text = "\n".join(data.read_documents(data.corpus_files("validation")))
  for p in prompts:
    assert re.match(r"(async\s+)?def \w+", p), p
    assert p.endswith("\n") and 2 <= p.count("\n") <= 4
    assert p.splitlines()[0] in val_text
    assert p.splitlines()[-1].startswith((" ", "\t"))  # Ends inside the body.
  assert data.function_prompts("validation", n=32, seed=1) != prompts


def test_function_prompts_custom_root(tiny_corpus):
  root, markers = tiny_corpus
  prompts = data.function_prompts("validation", n=None, root=root, val_fraction=0.2)
  val = data.corpus_files("validation", root, val_fraction=0.2)
  assert len(prompts) == len(val)
  assert {p.splitlines()[1].strip().split()[0].strip('"') for p in prompts} == {
    markers[r] for r in val
  }
  multi = "def g(\n    a,\n    b,\n):\n    return a\n\ndef h(): pass\n"
  assert data._function_openings(multi, max_lines=6, body_lines=1) == [
    "def g(\n    a,\n    b,\n):\n    return a\n"
  ]
