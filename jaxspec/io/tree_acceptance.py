"""A drafter's measured tree acceptance model: `tree_acceptance.json` beside its checkpoint.

Sampled trees (`tree_rule="recursive"`) are shaped by the probability that the walk reaches a
node. Measured per depth d, sibling rank r and bucket b of the rank's sorted draft probability
(`tree_verify.q_buckets`) as a[d][r][b] = P(rank r accepted | depth d reached, ranks < r
rejected, q bucket b) for one drafter and target at a few temperatures (`launch/bench.py
tree-calibrate` writes it), it replaces the drafter's own probabilities as that model
(`verifiers.TreeOptions.acceptance`). `jaxspec.load_drafter` reads it when present.

  {"format": "jaxspec-tree-acceptance/1", "rule": "recursive", "target": "...",
   "tables": [{"temperature": 1.0, "acceptance": [[[a, ...], ...], ...],
               "tried": [[[n, ...], ...], ...]}, ...]}

Unmeasured entries are null (they read as NaN; `verifiers.fit_table` fills them).
"""

from __future__ import annotations

import json
import math
import os
from typing import Any, Optional, Sequence

from jaxspec.errors import ConfigError

FILENAME = "tree_acceptance.json"
FORMAT = "jaxspec-tree-acceptance/1"


def read(model_dir: str) -> Optional[tuple]:
  """((temperature, a[d][r][b] as nested tuples), ...) from model_dir's file, or None."""
  path = os.path.join(model_dir, FILENAME)
  if not os.path.exists(path):
    return None
  with open(path, encoding="utf-8") as f:
    doc = json.load(f)
  if doc.get("format") != FORMAT:
    raise ConfigError(f"{path}: format {doc.get('format')!r}, expected {FORMAT!r}")
  tables = []
  for entry in doc.get("tables", []):
    t, rows = entry.get("temperature"), entry.get("acceptance")
    ok = isinstance(t, (int, float)) and t > 0 and isinstance(rows, list) and rows
    ok = ok and all(isinstance(r, list) and r and all(isinstance(c, list) for c in r) for r in rows)
    if not ok:
      raise ConfigError(
        f"{path}: a table needs a temperature > 0 and acceptance[depth][rank][bucket], got {entry}"
      )
    values = tuple(
      tuple(tuple(math.nan if a is None else float(a) for a in cell) for cell in row)
      for row in rows
    )
    flat = [a for row in values for cell in row for a in cell]
    if any(not (0 <= a <= 1) for a in flat if not math.isnan(a)):
      raise ConfigError(f"{path}: acceptance rates must lie in [0, 1]")
    tables.append((float(t), values))
  if not tables:
    raise ConfigError(f"{path}: no tables")
  return tuple(tables)


def _nested(x: Any, leaf) -> Any:
  """x (nested sequences or an array) as nested lists, `leaf` applied to the numbers."""
  if hasattr(x, "tolist"):
    x = x.tolist()
  return [_nested(v, leaf) for v in x] if isinstance(x, (list, tuple)) else leaf(x)


def write(
  model_dir: str,
  tables: Sequence[tuple[float, Any, Any]],
  target: str,
  rule: str = "recursive",
  **info: Any,
) -> str:
  """Writes (temperature, acceptance [D][K][NB] with NaN where unmeasured, tried counts)
  tables; returns the path."""
  doc = {
    "format": FORMAT,
    "rule": rule,
    "target": target,
    **info,
    "tables": [
      {
        "temperature": float(t),
        "acceptance": _nested(acc, lambda a: None if math.isnan(a) else round(float(a), 4)),
        "tried": _nested(tried, int),
      }
      for t, acc, tried in tables
    ],
  }
  path = os.path.join(model_dir, FILENAME)
  with open(path, "w", encoding="utf-8") as f:
    json.dump(doc, f, separators=(",", ":"))  # ~20 KB: a table per temperature, compact
    f.write("\n")
  return path
