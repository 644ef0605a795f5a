"""What an engine is built for: `EngineConfig` (its static shapes and method choices, checked
when made) and what `SpecEngine.generate` returns (`GenerateOutput`, `GenerationStats`).

One compilation per distinct config: every field here is a static shape or a choice compiled
into the engine's programs; what varies per request (sampling, budgets) is an array.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple, Optional

import numpy as np

from jaxspec.errors import ConfigError
from jaxspec.speculative import tree_verify
from jaxspec.speculative.verifiers import TreeOptions
from jaxspec.state import KV_FORMATS, Paging

MAX_STOP_IDS = 8  # EngineConfig.max_stop_ids' default
_NO_STEP_LIMIT = 2**31 - 1


@dataclasses.dataclass(frozen=True)
class EngineConfig:
  """Static shape and method choices of an engine (one compilation per distinct config).

  method: a label for reports ("plain", "draft_model", "ngram", ...); the drafter decides.
  verify: "chain" (γ drafts checked in order) or "tree" (DDTree: a best-first draft tree of
    `tree_budget` nodes built from the drafter's per-position distributions, verified in one
    pass under an ancestor mask; see docs/tree.md).
  max_len: tokens per sequence in the buffers and KV caches (prompt + generated + lookahead,
    where the lookahead is γ + 1 for chains and max(γ, tree_budget) + 1 for trees).
  batch_size: sequences per call; shorter calls are padded.
  min_prompt_bucket: smallest prompt padding bucket (buckets are powers of two above it).
  prefill_chunk: prompts longer than this are prefilled this many positions at a time, so
    prefill activations (and the features handed to the drafter) are bounded by the chunk.
  stop_ids: extra stop token ids (the model's eos ids are added unless use_eos is False).
  max_stop_ids: stop ids each sequence can hold: the engine's (stop_ids and eos) plus those of
    its request (`stop_token_ids`); a static shape, so a larger capacity is one compilation.
  stream_every: steps per host round trip in `stream`.
  kv_format: how the target's KV cache is stored: "float" (the activation dtype) or "fp8"
    (E4M3 with a float32 scale per token and KV head; see jaxspec/state/kv.py).
  tree_budget: draft nodes per tree, the root excluded (the target verifies budget + 1 tokens).
  tree_topk: tokens kept per draft position when building the tree; 0 = min(budget, 8).
  tree_chain_seed: insert the drafter's full top-1 chain before best-first expansion.
  tree_rule: how a tree is verified, all lossless (docs/tree.md): "recursive" (default; at
    T > 0 the children are drawn from the drafter's q without replacement and accepted by
    recursive rejection sampling; greedy rows as "ddtree"), "ddtree" (top-k children; sample
    the target at each node, follow the match) or "eagle2" (top-k children, accepted by the
    deterministic-top-k residual rule).
  tree_draft_temperature: "recursive" only: the children are drawn from the drafter's q at
    T × this (1 = the drafter's q; exact for any positive value; < 1 and > 1 measured worse
    on the bundled pair, docs/benchmarks.md).
  page_size: 0 (default): every row reserves max_len slots of every full-attention K/V layer.
    Else those layers keep their K/V (MLA: their latents, and DSA's indexer keys) in pages of
    this many slots from one pool (state/paged.py), each row holding a page table; it must
    divide max_len. Sliding-window rings and Gated DeltaNet states stay per row.
  kv_pages: the pool's pages (0: batch_size × max_len / page_size, what contiguous rows would
    hold). A smaller pool serves more rows than it could hold at max_len through the server's
    page allocator (serve/pages.py); `generate` needs the full pool.
  penalties: whether requests may ask for presence / frequency / repetition penalties and a
    logit bias (jaxspec/penalties.py): each row then counts its tokens ([B, V] state) and every
    verify position's logits are adjusted for its own prefix. Off: such requests are refused.
  top_logprobs: K > 0 keeps, for every generated token, the K most likely tokens of the raw
    distribution it was drawn at and their log-probs (`GenerateOutput.top_logprobs`; OpenAI's
    `top_logprobs`); [B, max_len, K] buffers. 0: none.
  prefix_cache: paged K/V only: a prompt whose first pages a server has cached (serve/pages.py)
    prefills only the rest (`prefill_cached`); the state keeps, per pool position, the target
    features the drafter's prefill reads (speculative/prefix.py). Refused for targets whose
    state is not all in pages (sliding windows, Gated DeltaNet).
  speculation: "fixed" (every step drafts the full γ / tree budget) or "auto": `run` takes a
    per-call budget from `speculation_budgets`, each compiled once on the same state (fewer
    chain drafts, fewer tree nodes, or 0: no proposal that step), which a server picks per
    tick from measured step costs and acceptance (serve/speculation.py).
  speculation_budgets: "auto" only: the budgets offered (each ≤ the full one; () = 0 where the
    drafter allows it, half, and the full budget).
  row_buckets: row counts below batch_size that `run` may compact the live rows into, so a
    step costs what those rows cost (one program per bucket and budget; () = none).
  warm_choices: the most choices of one prompt (OpenAI's n, best_of) that `warm_up_slots`
    compiles group prefills for. n choices prefill as a group of the next power of two rows
    (at most batch_size; the extra rows are dropped), so a server compiles log2(n) groups per
    prompt bucket up front; a larger n compiles its group the first time (1: none).
  """

  method: str = "auto"
  verify: str = "chain"
  max_len: int = 512
  batch_size: int = 1
  min_prompt_bucket: int = 16
  prefill_chunk: int = 2048
  stop_ids: tuple[int, ...] = ()
  use_eos: bool = True
  max_stop_ids: int = MAX_STOP_IDS
  stream_every: int = 4
  kv_format: str = "float"
  # Measured fastest on the bundled target + DFlash drafter on CPU (sweep 4..64 in
  # docs/benchmarks.md); accelerators, where a wider verify costs about as much as a narrow
  # one, favour larger budgets (DDTree uses 22 and more).
  tree_budget: int = 8
  tree_topk: int = 0
  tree_chain_seed: bool = False
  tree_rule: str = "recursive"
  tree_draft_temperature: float = 1.0
  page_size: int = 0
  kv_pages: int = 0
  penalties: bool = False
  top_logprobs: int = 0
  prefix_cache: bool = False
  speculation: str = "fixed"
  speculation_budgets: tuple[int, ...] = ()
  row_buckets: tuple[int, ...] = ()
  warm_choices: int = 1

  def __post_init__(self):
    def need(ok: bool, msg: str) -> None:
      if not ok:
        raise ConfigError(f"EngineConfig: {msg}")

    def whole(name: str, low: int) -> None:
      value = getattr(self, name)
      ok = isinstance(value, (int, np.integer)) and not isinstance(value, bool)
      need(ok and value >= low, f"{name} must be an integer ≥ {low}, got {value!r}")

    need(self.verify in ("chain", "tree"), f"verify={self.verify!r} (use 'chain' or 'tree')")
    whole("max_len", 2)
    need(self.max_len < 2**31, f"max_len must be < 2**31 (int32 positions), got {self.max_len}")
    whole("batch_size", 1)
    # A bucket of 0 would never grow; a stream of 0 steps per round trip would never advance.
    whole("min_prompt_bucket", 1)
    whole("prefill_chunk", 1)
    whole("stream_every", 1)
    whole("max_stop_ids", 1)
    need(
      isinstance(self.stop_ids, tuple)
      and all(
        isinstance(t, (int, np.integer)) and not isinstance(t, bool) and 0 <= t < 2**31
        for t in self.stop_ids
      ),
      f"stop_ids must be a tuple of token ids (integers in [0, 2**31)), got {self.stop_ids!r}",
    )
    need(isinstance(self.use_eos, bool), f"use_eos must be a bool, got {self.use_eos!r}")
    need(isinstance(self.penalties, bool), f"penalties must be a bool, got {self.penalties!r}")
    need(
      isinstance(self.prefix_cache, bool), f"prefix_cache must be a bool, got {self.prefix_cache!r}"
    )
    need(
      self.speculation in ("fixed", "auto"),
      f"speculation must be 'fixed' or 'auto', got {self.speculation!r}",
    )
    for name in ("speculation_budgets", "row_buckets"):
      values = getattr(self, name)
      need(
        isinstance(values, tuple)
        and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values),
        f"{name} must be a tuple of integers ≥ 0, got {values!r}",
      )
    need(
      self.speculation == "auto" or not self.speculation_budgets,
      "speculation_budgets needs speculation='auto'",
    )
    need(
      all(1 <= r <= self.batch_size for r in self.row_buckets),
      f"row_buckets must be in [1, batch_size={self.batch_size}], got {self.row_buckets!r}",
    )
    whole("warm_choices", 1)
    need(
      self.warm_choices <= self.batch_size,
      f"warm_choices={self.warm_choices} must be at most batch_size={self.batch_size}",
    )
    need(
      self.kv_format in KV_FORMATS,
      f"kv_format={self.kv_format!r}; expected one of {tuple(KV_FORMATS)}",
    )
    whole("top_logprobs", 0)
    need(self.top_logprobs <= 20, f"top_logprobs must be at most 20, got {self.top_logprobs}")
    whole("page_size", 0)
    whole("kv_pages", 0)
    if self.page_size:
      need(
        self.max_len % self.page_size == 0,
        f"page_size={self.page_size} must divide max_len={self.max_len}",
      )
      need(
        self.kv_pages == 0 or self.kv_pages >= self.pages_per_row,
        f"kv_pages={self.kv_pages} cannot hold one row of max_len={self.max_len} "
        f"({self.pages_per_row} pages of {self.page_size})",
      )
    else:
      need(self.kv_pages == 0, "kv_pages needs page_size > 0")
      need(not self.prefix_cache, "prefix_cache needs paged K/V (page_size > 0)")
    if self.verify == "tree":
      whole("tree_budget", 1)
      whole("tree_topk", 0)
      need(
        self.tree_rule in tree_verify.RULES,
        f"tree_rule={self.tree_rule!r}; expected one of {tree_verify.RULES}",
      )
      t = self.tree_draft_temperature
      need(
        isinstance(t, (int, float)) and not isinstance(t, bool) and 0 < t < float("inf"),
        f"tree_draft_temperature must be a positive number, got {t!r}",
      )

  @property
  def pages_per_row(self) -> int:
    """Pages of a row's page table (0 without paging)."""
    return self.max_len // self.page_size if self.page_size else 0

  @property
  def num_pages(self) -> int:
    """The pool's pages (0 without paging)."""
    return self.kv_pages or self.batch_size * self.pages_per_row

  def paging(self, batch: int) -> Optional[Paging]:
    """The paging of a `batch`-row state: the engine's pool for batch_size rows, a pool of
    exactly its rows' pages for others (a one-row `prefill_row` state); None: contiguous."""
    if not self.page_size:
      return None
    pages = self.num_pages if batch == self.batch_size else batch * self.pages_per_row
    return Paging(self.page_size, pages)

  def prompt_bucket(self, n: int) -> int:
    """The padded length of an n-token prompt: the smallest power-of-two multiple of
    min_prompt_bucket that holds it, at most max_len (one prefill compilation per bucket)."""
    bucket = self.min_prompt_bucket
    while bucket < n:
      bucket *= 2
    return min(bucket, self.max_len)

  def prefill_width(self, n: int) -> int:
    """The positions one prefill chunk of n prompt positions spans: short prompts, their
    bucket (one chunk); long ones, prefill_chunk (one program for every longer length)."""
    return min(self.prompt_bucket(n), self.prefill_chunk)

  @property
  def tree_options(self) -> Optional["TreeOptions"]:
    if self.verify != "tree":
      return None
    return TreeOptions(
      self.tree_budget,
      self.tree_topk,
      self.tree_chain_seed,
      self.tree_rule,
      float(self.tree_draft_temperature),
    )


class GenerateOutput(NamedTuple):
  """What `SpecEngine.generate` returns, one entry per prompt."""

  texts: Optional[list[str]]
  tokens: list[list[int]]
  stats: Any
  # Per prompt, the target's log-probability of each generated token (raw distribution).
  logprobs: Optional[list[list[float]]] = None
  # Per prompt and generated token, its EngineConfig.top_logprobs most likely alternatives as
  # (token id, log-prob) pairs, most likely first (None when top_logprobs is 0).
  top_logprobs: Optional[list[list[list[tuple[int, float]]]]] = None


@dataclasses.dataclass
class GenerationStats:
  """Host-side summary of one generate call (see speculative.metrics.summarize for the fields)."""

  acceptance_length: float
  acceptance_rate_per_position: list[float]
  target_passes: int
  tokens_generated: int
  tokens_per_second: float
  time_to_first_token_s: float
  decode_time_s: float
  summary: dict
