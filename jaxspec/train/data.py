"""Text corpora, the train/validation split and packed token batches for training.

jaxspec trains its small models on real text: by default the Python standard library
source of the running interpreter (`stdlib_root()`), but every function takes a `root`
so any folder of text files works. The pieces:

* `list_text_files` / `corpus_files`: the sorted relative paths of a corpus, and its split.
* `split_of`: train or validation, from a sha256 of the relative path alone, so the split
  is the same on every machine, in every order, and validation files never reach
  training (about 5% go to validation).
* `token_stream`: documents tokenized and joined with `<|endoftext|>`, cached as .npy.
* `PackedDataset`: `[batch, seq_len + 1]` int32 windows of the stream; the order is a
  pure function of (seed, step), so a resumed run sees exactly the same data.
* `function_prompts`: the openings of functions in validation files, for benchmarks.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import sysconfig
import tempfile
import textwrap
from collections.abc import Iterator, Sequence
from typing import Protocol

import numpy as np
from jaxspec.errors import ConfigError

TRAIN = "train"
VALIDATION = "validation"
ALL = "all"
SPLITS = (TRAIN, VALIDATION, ALL)

DEFAULT_SUFFIXES = (".py",)
DEFAULT_EXCLUDE_DIRS = ("test", "tests", "idlelib", "site-packages", "__pycache__")
DEFAULT_VAL_FRACTION = 0.05

# Bump to reshuffle the split (it would invalidate every model's held-out set).
_SPLIT_SALT = "jaxspec-split-v1:"


class TokenizerLike(Protocol):
  """What the data pipeline needs from a tokenizer (jaxspec.io.tokenizer.Tokenizer)."""

  @property
  def vocab_size(self) -> int: ...

  @property
  def eos_id(self) -> int | None: ...

  @property
  def fingerprint(self) -> str: ...

  def encode_batch(
    self, texts: Sequence[str], *, split_special_tokens: bool = False
  ) -> list[list[int]]: ...


# ---- files and the split ---------------------------------------------------------------


def stdlib_root() -> str:
  """The standard library folder of the running interpreter (the default corpus)."""
  return sysconfig.get_paths()["stdlib"]


def list_text_files(
  root: str | os.PathLike[str],
  suffixes: Sequence[str] = DEFAULT_SUFFIXES,
  exclude_dirs: Sequence[str] = DEFAULT_EXCLUDE_DIRS,
) -> list[str]:
  """Lists text files under `root` as sorted, '/'-separated relative paths.

  Args:
    root: the corpus folder.
    suffixes: file name endings to keep (e.g. (".py",)); empty keeps every file.
    exclude_dirs: folder names skipped at any depth (e.g. "test" skips `ctypes/test/`).

  Returns:
    Relative paths, sorted, so the listing is the same whatever the file system order.
  """
  root = os.fspath(root)
  if not os.path.isdir(root):
    raise FileNotFoundError(f"corpus root is not a directory: {root!r}")
  excluded = set(exclude_dirs)
  suffixes = tuple(suffixes)
  out = []
  for dirpath, dirnames, filenames in os.walk(root):
    dirnames[:] = [d for d in dirnames if d not in excluded]
    rel_dir = os.path.relpath(dirpath, root)
    for name in filenames:
      if suffixes and not name.endswith(suffixes):
        continue
      rel = name if rel_dir == "." else os.path.join(rel_dir, name)
      out.append(rel.replace(os.sep, "/"))
  return sorted(out)


def split_of(rel_path: str, val_fraction: float = DEFAULT_VAL_FRACTION) -> str:
  """Returns "train" or "validation" for a file, from a sha256 of its relative path.

  Stable across machines, processes and Python versions (unlike `hash`), and
  independent of which other files exist.
  """
  if not 0.0 <= val_fraction <= 1.0:
    raise ConfigError(f"val_fraction must be in [0, 1], got {val_fraction}")
  rel = rel_path.replace(os.sep, "/").lstrip("/")
  digest = hashlib.sha256((_SPLIT_SALT + rel).encode("utf-8")).digest()
  u = int.from_bytes(digest[:8], "big") / 2.0**64  # Uniform in [0, 1).
  return VALIDATION if u < val_fraction else TRAIN


def corpus_files(
  split: str,
  root: str | os.PathLike[str] | None = None,
  *,
  val_fraction: float = DEFAULT_VAL_FRACTION,
  suffixes: Sequence[str] = DEFAULT_SUFFIXES,
  exclude_dirs: Sequence[str] = DEFAULT_EXCLUDE_DIRS,
) -> list[str]:
  """The sorted relative paths of one split ("train", "validation" or "all").

  Args:
    split: which split.
    root: corpus folder; None means the standard library (`stdlib_root()`).
    val_fraction: share of files held out for validation.
    suffixes: see `list_text_files`.
    exclude_dirs: see `list_text_files`.
  """
  _check_split(split)
  root = stdlib_root() if root is None else root
  files = list_text_files(root, suffixes, exclude_dirs)
  if split == ALL:
    return files
  return [f for f in files if split_of(f, val_fraction) == split]


def read_documents(files: Sequence[str], root: str | os.PathLike[str] | None = None) -> list[str]:
  """Reads files as UTF-8 text (undecodable bytes become U+FFFD, newlines '\\n').

  Args:
    files: paths, relative to `root` (or absolute when `root` is None and they are).
    root: folder the paths are relative to; None means the standard library for
      relative paths.
  """
  docs = []
  for f in files:
    path = (
      f if os.path.isabs(f) else os.path.join(stdlib_root() if root is None else os.fspath(root), f)
    )
    with open(path, encoding="utf-8", errors="replace") as fh:
      docs.append(fh.read())
  return docs


def _check_split(split: str) -> None:
  if split not in SPLITS:
    raise ConfigError(f"unknown split {split!r}; expected one of {SPLITS}")


# ---- the token stream ------------------------------------------------------------------


def default_cache_dir() -> str:
  """Where token streams are cached: $JAXSPEC_CACHE_DIR or ~/.cache/jaxspec/tokens."""
  env = os.environ.get("JAXSPEC_CACHE_DIR")
  if env:
    return env
  return os.path.join(os.path.expanduser("~"), ".cache", "jaxspec", "tokens")


def _token_dtype(vocab_size: int) -> np.dtype:
  return np.dtype(np.uint16 if vocab_size <= 2**16 else np.uint32)


def tokenize_documents(
  tokenizer: TokenizerLike, documents: Sequence[str], chunk: int = 256
) -> np.ndarray:
  """Tokenizes documents into one stream, `<|endoftext|>` after each document.

  Special-token strings inside a document are encoded as plain text, so the only
  EOS ids in the stream are document boundaries. Empty documents are skipped.

  Returns:
    A 1-D uint16 array (uint32 if the vocabulary exceeds 65536).
  """
  eos = tokenizer.eos_id
  if eos is None:
    raise ConfigError("tokenizer has no <|endoftext|> token to separate documents")
  dtype = _token_dtype(tokenizer.vocab_size)
  docs = [d for d in documents if d]
  parts = []
  for i in range(0, len(docs), chunk):
    for ids in tokenizer.encode_batch(docs[i : i + chunk], split_special_tokens=True):
      ids.append(eos)
      parts.append(np.asarray(ids, dtype=dtype))
  if not parts:
    return np.zeros((0,), dtype)
  return np.concatenate(parts)


def _corpus_fingerprint(root: str, files: Sequence[str]) -> str:
  """sha256 over (path, size, mtime) of each file: changes when the corpus does."""
  h = hashlib.sha256()
  h.update(os.path.abspath(root).encode("utf-8"))
  for f in files:
    st = os.stat(os.path.join(root, f))
    h.update(f"\0{f}\0{st.st_size}\0{st.st_mtime_ns}".encode("utf-8"))
  return h.hexdigest()


def token_stream(
  tokenizer: TokenizerLike,
  split: str = TRAIN,
  root: str | os.PathLike[str] | None = None,
  *,
  cache_dir: str | os.PathLike[str] | None = None,
  val_fraction: float = DEFAULT_VAL_FRACTION,
  suffixes: Sequence[str] = DEFAULT_SUFFIXES,
  exclude_dirs: Sequence[str] = DEFAULT_EXCLUDE_DIRS,
) -> np.ndarray:
  """The tokenized split as one array, cached on disk.

  The cache file is `{split}-{tokenizer hash}-{corpus hash}.npy` under `cache_dir`
  (default `default_cache_dir()`); the corpus hash covers the root, the file list and
  each file's size and mtime, so editing the corpus or the tokenizer re-tokenizes.

  Returns:
    A read-only memory-mapped 1-D integer array (uint16 for vocabularies <= 65536).
  """
  _check_split(split)
  root = os.fspath(stdlib_root() if root is None else root)
  files = corpus_files(
    split, root, val_fraction=val_fraction, suffixes=suffixes, exclude_dirs=exclude_dirs
  )
  if not files:
    raise ConfigError(
      f"split {split!r} of {root!r} has no files "
      f"(suffixes={tuple(suffixes)}, val_fraction={val_fraction})"
    )
  cache_dir = os.fspath(default_cache_dir() if cache_dir is None else cache_dir)
  key = f"{split}-{tokenizer.fingerprint[:16]}-{_corpus_fingerprint(root, files)[:16]}"
  path = os.path.join(cache_dir, key + ".npy")
  if not os.path.exists(path):
    tokens = tokenize_documents(tokenizer, read_documents(files, root))
    os.makedirs(cache_dir, exist_ok=True)
    # Write then rename, so concurrent readers never see a partial file.
    fd, tmp = tempfile.mkstemp(dir=cache_dir, suffix=".npy.tmp")
    try:
      with os.fdopen(fd, "wb") as fh:
        np.save(fh, tokens)
      os.chmod(tmp, 0o644)  # mkstemp makes 0600; caches may be shared.
      os.replace(tmp, path)
    except BaseException:
      if os.path.exists(tmp):
        os.remove(tmp)
      raise
    meta = {
      "root": root,
      "split": split,
      "files": len(files),
      "tokens": int(tokens.size),
      "tokenizer": tokenizer.fingerprint,
      "val_fraction": val_fraction,
    }
    with open(os.path.join(cache_dir, key + ".json"), "w", encoding="utf-8") as fh:
      json.dump(meta, fh, indent=2)
  return np.load(path, mmap_mode="r")


# ---- packed batches --------------------------------------------------------------------


class PackedDataset:
  """Deterministic, resumable `[batch, seq_len + 1]` windows of a token stream.

  An epoch cuts the stream into non-overlapping windows of `seq_len + 1` tokens
  (consecutive windows share one token, so inputs `w[:, :-1]` and targets `w[:, 1:]`
  cover every position), starting at a per-epoch random offset in [0, seq_len), and
  visits them in a per-epoch random order. Offset and order come from
  `np.random.default_rng([seed, epoch])`, so `batch_at(step)` is a pure function of
  (stream, seq_len, batch_size, seed, step): resuming at step k reproduces the batches
  a run without interruption would have seen. Documents are packed across window
  boundaries, separated by `<|endoftext|>`, as in GPT-style pretraining.

  With `process_count > 1` every process gets its own rows of the same global batch.
  """

  def __init__(
    self,
    tokens: np.ndarray,
    seq_len: int,
    batch_size: int,
    *,
    seed: int = 0,
    shuffle: bool = True,
    process_index: int = 0,
    process_count: int = 1,
  ):
    """Builds the dataset.

    Args:
      tokens: 1-D integer token stream (e.g. from `token_stream`).
      seq_len: tokens of model input per row; rows hold seq_len + 1 tokens.
      batch_size: global rows per batch.
      seed: the data-order seed.
      shuffle: if False, windows come in stream order from offset 0.
      process_index: this process's index, for multi-host data loading.
      process_count: number of processes sharing each global batch.
    """
    tokens = np.asarray(tokens) if not isinstance(tokens, np.ndarray) else tokens
    if tokens.ndim != 1:
      raise ConfigError(f"tokens must be 1-D, got shape {tokens.shape}")
    if seq_len < 1 or batch_size < 1:
      raise ConfigError(f"seq_len and batch_size must be >= 1, got {seq_len} and {batch_size}")
    if not 0 <= process_index < process_count:
      raise ConfigError(f"process_index {process_index} not in [0, {process_count})")
    if batch_size % process_count:
      raise ConfigError(f"batch_size {batch_size} not divisible by process_count {process_count}")
    self.tokens = tokens
    self.seq_len = int(seq_len)
    self.batch_size = int(batch_size)
    self.seed = int(seed)
    self.shuffle = bool(shuffle)
    self.process_index = int(process_index)
    self.process_count = int(process_count)
    # With any offset in [0, seq_len), this many windows still fit in the stream.
    n = tokens.size
    self.windows_per_epoch = (
      max(0, (n - self.seq_len) // self.seq_len) if shuffle else max(0, (n - 1) // self.seq_len)
    )
    self.batches_per_epoch = self.windows_per_epoch // self.batch_size
    if self.batches_per_epoch == 0:
      raise ConfigError(
        f"stream of {n} tokens is too short for one batch of {batch_size} x "
        f"{seq_len + 1} tokens ({self.windows_per_epoch} windows per epoch)"
      )
    self._epoch_cache: tuple[int, int, np.ndarray] | None = None

  @classmethod
  def from_corpus(
    cls,
    tokenizer: TokenizerLike,
    split: str = TRAIN,
    *,
    seq_len: int,
    batch_size: int,
    seed: int = 0,
    root: str | os.PathLike[str] | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
    val_fraction: float = DEFAULT_VAL_FRACTION,
    suffixes: Sequence[str] = DEFAULT_SUFFIXES,
    exclude_dirs: Sequence[str] = DEFAULT_EXCLUDE_DIRS,
    shuffle: bool = True,
    process_index: int = 0,
    process_count: int = 1,
  ) -> PackedDataset:
    """A dataset over one split of a folder (default: the stdlib); see `token_stream`."""
    tokens = token_stream(
      tokenizer,
      split,
      root,
      cache_dir=cache_dir,
      val_fraction=val_fraction,
      suffixes=suffixes,
      exclude_dirs=exclude_dirs,
    )
    return cls(
      tokens,
      seq_len,
      batch_size,
      seed=seed,
      shuffle=shuffle,
      process_index=process_index,
      process_count=process_count,
    )

  @property
  def num_tokens(self) -> int:
    """Tokens in the stream."""
    return int(self.tokens.size)

  @property
  def local_batch_size(self) -> int:
    """Rows this process gets per batch."""
    return self.batch_size // self.process_count

  def epoch_plan(self, epoch: int) -> tuple[int, np.ndarray]:
    """(offset, window order) of an epoch; window w starts at offset + w * seq_len."""
    if self._epoch_cache is not None and self._epoch_cache[0] == epoch:
      return self._epoch_cache[1], self._epoch_cache[2]
    if self.shuffle:
      rng = np.random.default_rng([self.seed, epoch])
      offset = int(rng.integers(0, self.seq_len))
      order = rng.permutation(self.windows_per_epoch)
    else:
      offset, order = 0, np.arange(self.windows_per_epoch)
    self._epoch_cache = (epoch, offset, order)
    return offset, order

  def batch_at(self, step: int) -> np.ndarray:
    """The batch of training step `step` (>= 0): int32 `[local_batch, seq_len + 1]`.

    Epoch `step // batches_per_epoch`; a pure function of the step.
    """
    step = int(step)
    if step < 0:
      raise ConfigError(f"step must be >= 0, got {step}")
    epoch, i = divmod(step, self.batches_per_epoch)
    offset, order = self.epoch_plan(epoch)
    rows = order[i * self.batch_size : (i + 1) * self.batch_size]
    lb = self.local_batch_size
    rows = rows[self.process_index * lb : (self.process_index + 1) * lb]
    starts = offset + rows.astype(np.int64) * self.seq_len
    idx = starts[:, None] + np.arange(self.seq_len + 1, dtype=np.int64)[None, :]
    return np.asarray(self.tokens[idx], dtype=np.int32)

  def iterate(self, start_step: int = 0, num_steps: int | None = None) -> Iterator[np.ndarray]:
    """Yields `batch_at(start_step)`, `batch_at(start_step + 1)`, ... (forever if None)."""
    step = start_step
    while num_steps is None or step < start_step + num_steps:
      yield self.batch_at(step)
      step += 1

  def __iter__(self) -> Iterator[np.ndarray]:
    return self.iterate(0)

  def __len__(self) -> int:
    """Batches per epoch."""
    return self.batches_per_epoch


# ---- benchmark prompts -----------------------------------------------------------------

_DEF_RE = re.compile(r"^(\s*)(?:async\s+)?def\s+\w+\s*[(\[]")


def _signature_end(lines: list[str], start: int, max_lines: int) -> int | None:
  """Index of the line that ends the `def` signature starting at `start`, or None.

  Tracks bracket depth (ignoring strings and comments only roughly); the signature
  ends at depth 0 on a line ending with ':'. A one-line body (`def f(): pass`) or a
  signature longer than `max_lines` gives None.
  """
  depth = 0
  for j in range(start, min(len(lines), start + max_lines)):
    code = lines[j].split("#", 1)[0].rstrip()
    depth += sum(code.count(c) for c in "([{") - sum(code.count(c) for c in ")]}")
    if depth <= 0:
      return j if code.endswith(":") else None
  return None


def _function_openings(text: str, max_lines: int, body_lines: int) -> list[str]:
  """The openings of every function in one file: signature plus first body lines."""
  lines = text.splitlines()
  out = []
  for i, line in enumerate(lines):
    m = _DEF_RE.match(line)
    if not m:
      continue
    end = _signature_end(lines, i, max_lines)
    if end is None:
      continue
    indent = len(m.group(1).expandtabs())
    chunk = lines[i : end + 1]
    j, taken = end + 1, 0
    while j < len(lines) and taken < body_lines and len(chunk) < max_lines:
      body = lines[j]
      j += 1
      if not body.strip():
        continue
      if len(body) - len(body.lstrip()) <= indent:
        break  # The body ended (or the file is not Python).
      chunk.append(body)
      taken += 1
    if taken == 0:
      continue
    out.append(textwrap.dedent("\n".join(chunk)) + "\n")
  return out


def function_prompts(
  split: str = VALIDATION,
  n: int | None = 64,
  max_lines: int = 4,
  *,
  body_lines: int = 1,
  seed: int = 0,
  root: str | os.PathLike[str] | None = None,
  val_fraction: float = DEFAULT_VAL_FRACTION,
  suffixes: Sequence[str] = DEFAULT_SUFFIXES,
  exclude_dirs: Sequence[str] = DEFAULT_EXCLUDE_DIRS,
) -> list[str]:
  """Prompts made of function openings from one split, for benchmarks.

  Each prompt is a `def` line (or a multi-line signature) plus its first
  `body_lines` non-blank body lines (often the docstring's first line), dedented,
  at most `max_lines` lines, ending with a newline, e.g.
  'def fnmatch(name, pat):\\n    \"\"\"Test whether FILENAME matches PATTERN.\\n'.
  The selection is deterministic: every opening of the split's files in file order,
  duplicates removed, shuffled with `seed`, the first `n` kept (all if None).

  Args:
    split: which split's files to draw from (validation by default: unseen text).
    n: number of prompts; fewer if the split has fewer functions.
    max_lines: most lines per prompt.
    body_lines: body lines to include after the signature.
    seed: selection seed.
    root: corpus folder; None means the standard library.
    val_fraction: see `corpus_files`.
    suffixes: see `list_text_files`.
    exclude_dirs: see `list_text_files`.
  """
  if max_lines < 2:
    raise ConfigError(f"max_lines must be >= 2 (signature and body), got {max_lines}")
  files = corpus_files(
    split, root, val_fraction=val_fraction, suffixes=suffixes, exclude_dirs=exclude_dirs
  )
  seen: set[str] = set()
  prompts = []
  for doc in read_documents(files, stdlib_root() if root is None else root):
    for p in _function_openings(doc, max_lines, body_lines):
      if p not in seen:
        seen.add(p)
        prompts.append(p)
  order = np.random.default_rng(seed).permutation(len(prompts))
  chosen = [prompts[k] for k in order]
  return chosen if n is None else chosen[:n]
