"""Kimi's `tiktoken.model` tokenizer, rebuilt as a `tokenizers` BPE that encodes as tiktoken.

Kimi-K2 / K2.5 checkpoints ship no tokenizer.json: their tokenizer is a tiktoken BPE
(`tiktoken.model`: one base64 token and its rank a line), Kimi's pre-tokenizing pattern and 258
special ids after the ranks, named by tokenizer_config.json's `added_tokens_decoder` (the ids
it leaves unnamed read `<|reserved_token_{id}|>`). Text containing a special token's string
encodes it as that special id, as Kimi's tokenizer does.

The ranks (tiktoken's file format, `read_ranks`) are rebuilt as a byte-level BPE of the
`tokenizers` library, so that the rest of jaxspec (and `save_hf`, which writes it as
tokenizer.json) sees one tokenizer type. The two agree because tiktoken merges, at each
step, the adjacent pair whose concatenation has the lowest rank: the merge list holds every
split of every token into two tokens, in the order of the merged token's rank, and a piece
that is itself a token is taken whole (`ignore_merges`).
"""

from __future__ import annotations

import base64
import binascii
import json
import os
from typing import Any

import tokenizers
from tokenizers import decoders, models, pre_tokenizers

from jaxspec.errors import CheckpointError

TIKTOKEN_FILE = "tiktoken.model"
# Kimi's special ids: this many reserved ones and two more, right after the ranks.
NUM_SPECIAL_IDS = 256 + 2
# Kimi's pre-tokenizing pattern (tokenization_kimi.py's `pat_str`): Han runs; cased words with
# an optional English contraction (letters that are not Han); 1-3 digits; punctuation runs; line
# breaks; spaces.
KIMI_PATTERN = "|".join(
  [
    r"[\p{Han}]+",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"
    r"[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"
    r"[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"\p{N}{1,3}",
    r" ?[^\s\p{L}\p{N}]+[\r\n]*",
    r"\s*[\r\n]+",
    r"\s+(?!\S)",
    r"\s+",
  ]
)


def _byte_chars() -> list[str]:
  """Byte-level BPE's character for each byte: printable Latin-1 bytes stand for themselves,
  the others for U+0100 on, in byte order (the alphabet of `pre_tokenizers.ByteLevel`)."""
  printable = {*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)}
  chars, extra = [], 0
  for b in range(256):
    if b in printable:
      chars.append(chr(b))
    else:
      chars.append(chr(256 + extra))
      extra += 1
  return chars


_BYTE_CHARS = _byte_chars()


def _text(token: bytes) -> str:
  return "".join(_BYTE_CHARS[b] for b in token)


def _merges(ranks: dict[bytes, int]) -> list[tuple[str, str]]:
  """Every split of a token into two tokens, ordered by the merged token's rank (then by the
  parts' ranks): the pair tiktoken would merge first comes first."""
  found = []
  for token, rank in ranks.items():
    for i in range(1, len(token)):
      left, right = ranks.get(token[:i]), ranks.get(token[i:])
      if left is not None and right is not None:
        found.append((rank, left, right, token[:i], token[i:]))
  found.sort()
  return [(_text(a), _text(b)) for _, _, _, a, b in found]


def special_tokens(model_dir: str, num_ranks: int) -> dict[int, str]:
  """Kimi's special ids → their strings: tokenizer_config.json's `added_tokens_decoder` names
  them, the others read `<|reserved_token_{id}|>` (as Kimi's tokenizer names them)."""
  path = os.path.join(model_dir, "tokenizer_config.json")
  named: dict[int, str] = {}
  if os.path.isfile(path):
    try:
      with open(path, encoding="utf-8") as f:
        config = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
      raise CheckpointError(f"{path}: cannot read it as JSON: {e}") from None
    decoder: Any = config.get("added_tokens_decoder") or {}
    if not isinstance(decoder, dict):
      raise CheckpointError(f"{path}: added_tokens_decoder must be a JSON object")
    for key, entry in decoder.items():
      content = entry.get("content") if isinstance(entry, dict) else None
      if not (key.isdigit() and isinstance(content, str)):
        raise CheckpointError(f"{path}: added_tokens_decoder entry {key!r} is not id → content")
      named[int(key)] = content
  ids = range(num_ranks, num_ranks + NUM_SPECIAL_IDS)
  outside = sorted(set(named) - set(ids))
  if outside:
    raise CheckpointError(
      f"{path}: added_tokens_decoder names ids {outside[:5]} outside the special ids "
      f"[{num_ranks}, {num_ranks + NUM_SPECIAL_IDS})"
    )
  return {i: named.get(i, f"<|reserved_token_{i}|>") for i in ids}


def read_ranks(path: str) -> dict[bytes, int]:
  """A `tiktoken.model` file: one base64 token and its rank a line (the format
  `tiktoken.load.load_tiktoken_bpe` reads). Parsed here rather than by that function, which
  caches every file it reads by path under the temp directory and would hand back a stale copy
  once the file at that path changed."""
  ranks: dict[bytes, int] = {}
  try:
    with open(path, "rb") as f:
      lines = f.read().splitlines()
  except OSError as e:
    raise CheckpointError(f"cannot read {path}: {e}") from None
  for n, line in enumerate(lines, 1):
    if not line.strip():
      continue
    parts = line.split()
    try:
      if len(parts) != 2:
        raise ValueError("expected a base64 token and a rank")
      token, rank = base64.b64decode(parts[0], validate=True), int(parts[1])
    except (ValueError, binascii.Error) as e:
      raise CheckpointError(f"{path}, line {n}: not a tiktoken BPE line ({e})") from None
    if token in ranks:
      raise CheckpointError(f"{path}, line {n}: token {token!r} appears twice")
    ranks[token] = rank
  if sorted(ranks.values()) != list(range(len(ranks))):
    raise CheckpointError(f"{path}: the ranks must be 0 .. {len(ranks) - 1}, each once")
  missing = [b for b in range(256) if bytes([b]) not in ranks]
  if missing:
    raise CheckpointError(f"{path}: lacks the single bytes {missing[:8]} (a byte-level BPE)")
  return ranks


def load_tiktoken_dir(model_dir: str) -> tokenizers.Tokenizer:
  """The tokenizer of a Kimi model directory (`tiktoken.model` + tokenizer_config.json)."""
  ranks = read_ranks(os.path.join(model_dir, TIKTOKEN_FILE))
  vocab = {_text(token): rank for token, rank in ranks.items()}
  bpe = models.BPE(vocab, _merges(ranks), ignore_merges=True)
  tok = tokenizers.Tokenizer(bpe)
  tok.pre_tokenizer = pre_tokenizers.Sequence(
    [
      pre_tokenizers.Split(tokenizers.Regex(KIMI_PATTERN), behavior="isolated"),
      pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ]
  )
  tok.decoder = decoders.ByteLevel()
  specials = special_tokens(model_dir, len(ranks))
  tok.add_special_tokens(
    [tokenizers.AddedToken(specials[i], special=True) for i in sorted(specials)]
  )
  got = [tok.token_to_id(s) for _, s in sorted(specials.items())]
  if got != sorted(specials):
    raise CheckpointError(f"{model_dir}: the special token strings must be distinct tokens")
  return tok
