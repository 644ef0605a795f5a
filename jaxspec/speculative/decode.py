"""Deprecated: the prefill functions live in jaxspec/speculative/step.py.

`decode.prefill` is `step.prefill_prompts`; `prefill_chunk` and `chunk_tokens` are
`step.prefill_chunk` and `step.chunk_tokens`. Importing this module warns.
"""

from __future__ import annotations

import warnings

from jaxspec.speculative.step import chunk_tokens, prefill_chunk
from jaxspec.speculative.step import prefill_prompts as prefill

warnings.warn(
  "jaxspec.speculative.decode is deprecated: use jaxspec.speculative.step (prefill_prompts, "
  "prefill_chunk, chunk_tokens)",
  DeprecationWarning,
  stacklevel=2,
)

__all__ = ["chunk_tokens", "prefill", "prefill_chunk"]
