"""The speculative engine's host side: `EngineConfig` and the `SpecEngine` API.

`SpecEngine` validates requests (jaxspec/speculative/request.py), pads them to static shapes
and runs the compiled program of jaxspec/speculative/step.py: `prefill`, then a
`lax.while_loop` of the draft → verify → accept → commit `step` until every sequence has hit
its `max_new_tokens` or a stop token, with no host round trip. Shapes are static per engine
(batch and max_len are fixed at construction, prompts are padded to power-of-two buckets),
sampling parameters and budgets are arrays: twenty calls with different prompts, lengths and
temperatures compile each function once.

How a step verifies is one verifier object (jaxspec/speculative/verifiers.py), chosen here from
the config: plain decoding with `drafter=None` (the baseline every speedup is measured
against), a chain of γ drafts, or with `EngineConfig(verify="tree")` a DDTree (a best-first
draft tree from the drafter's per-position distributions, verified in one target pass under an
ancestor mask; see docs/tree.md).

Slots: every batch row is an independent sequence with its own PRNG key, stop ids and sampling
parameters, so rows can come and go between calls of the loop (continuous batching,
jaxspec/serve/): `prefill_row` prefills one request as a one-row state, `insert` puts it into a
free row of the engine's state, `evict` frees a row, and `run` advances every live row by up to
k steps. None of them recompiles after warm-up (`warm_up_slots`); a request's output does not
depend on the row it runs in or on its neighbours (up to float rounding of batched kernels).

On a device mesh (`SpecEngine(..., mesh=sharding.make_mesh(...), rules=...)`) the target's and
the drafter's parameters are placed by their logical axes (jaxspec/speculative/placement.py),
every SpecState leaf has logical axes (`SpecEngine.state_axes`: the `AXES` tables of the state
structs, jaxspec/state.py) by which it is created and kept (batch on `data`, KV heads on
`tensor` under the default rules), and the jitted functions are traced inside
`sharding.use_mesh`, so the model code's activation constraints apply too. Same program, same
compilations, one layout across the loop.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any, Iterator, NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec import distributed, sampling, sharding
from jaxspec.drafters.base import Drafter
from jaxspec.errors import ConfigError
from jaxspec.models.target import InputError, TargetModel
from jaxspec.speculative import memory, metrics, placement, tree_verify, verifiers
from jaxspec.speculative import prefix as prefix_lib
from jaxspec.speculative import step as step_lib
from jaxspec.speculative import request as request_lib
from jaxspec.speculative.request import Request, SamplingArgs, takes_sampling_args
from jaxspec.speculative.step import SpecState
from jaxspec.speculative.verifiers import TreeOptions
from jaxspec.state import KV_FORMATS, Paging, logical_axes

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
    (E4M3 with a float32 scale per token and KV head; see jaxspec/state.py).
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


def _bucket(n: int, minimum: int, cap: int) -> int:
  b = minimum
  while b < n:
    b *= 2
  return min(b, cap)


class SpecEngine:
  """Speculative (or, with drafter=None, plain) generation for one target and drafter.

  mesh: a device mesh (`sharding.make_mesh`) to run on, or None for one device. With a mesh the
    parameters are placed by their logical axes (`place_on_mesh`; `self.target` and
    `self.drafter` then hold the placed arrays) and the state is laid out by `state_axes`.
  rules: the logical-to-mesh rules (`sharding.rules_from`: None = the defaults).
  """

  def __init__(
    self,
    target: TargetModel,
    drafter: Optional[Drafter] = None,
    config: EngineConfig = EngineConfig(),
    *,
    mesh: Optional[jax.sharding.Mesh] = None,
    rules: Any = None,
  ):
    # Decoding never runs on the scanned (training) layout: it would copy every layer's
    # weights out of the stack each step (TargetModel.for_decoding).
    self.target = target = target.for_decoding()
    self.config = config
    self.tree = config.tree_options
    if self.tree is not None and drafter is not None:
      drafter = drafter.for_tree(self.tree.rule in tree_verify.SAMPLED_CANDIDATE_RULES)
    # How a step verifies (plain, chain or tree): chosen once, compiled into the step.
    self.verifier = verifiers.make(drafter, self.tree)
    # The speculation budgets `run` takes (speculation="auto"): each a verifier on one state.
    full = verifiers.budget_of(self.verifier)
    self.budgets: tuple[int, ...] = (full,)
    if config.speculation == "auto":
      if drafter is None:
        raise ConfigError("speculation='auto' needs a drafter (plain decoding has one budget)")
      offered = config.speculation_budgets or (
        (0,) * drafter.can_skip_proposals + ((full // 2,) if full > 1 else ())
      )
      self.budgets = tuple(sorted(set(offered) | {full}))
    self._variants = {b: verifiers.with_budget(self.verifier, b, drafter) for b in self.budgets}
    self.row_buckets = tuple(sorted(set(config.row_buckets) | {config.batch_size}))
    if drafter is not None and drafter.vocab_size not in (None, target.config.vocab_size):
      raise InputError(
        f"drafter vocabulary ({drafter.vocab_size}) differs from the target's "
        f"({target.config.vocab_size})"
      )
    if rules is not None and mesh is None:
      raise ConfigError("sharding rules without a mesh: pass mesh=sharding.make_mesh(...) too")
    self.mesh = mesh
    self.rules = None if mesh is None else sharding.rules_from(rules)
    if mesh is not None:
      self.target, drafter = placement.place_on_mesh(target, drafter, mesh, self.rules)
    self.drafter = drafter
    self.stop_ids = self._engine_stop_ids()  # every row's; a request may add its own
    self.gamma = drafter.gamma if drafter is not None else 0
    # Slots a step may write past the root: γ drafts, or the tree's budget nodes.
    self.lookahead = self.verifier.lookahead
    if any(target.config.is_linear(i) for i in range(target.config.num_layers)):
      # A verify block keeps per-position (chain) or per-node (tree) linear-attention states
      # when it is at most `linear_snapshots` tokens wide: widen the threshold to this
      # engine's block (γ + 1, or the tree's budget + 1). The snapshots are sized by the block
      # itself, so only the threshold changes.
      if self.verifier.width > target.config.options.linear_snapshots:
        self.target = self.target.with_options(linear_snapshots=self.verifier.width)
        target = self.target
    # Sliding-window layers keep rings of window + the widest block a step verifies (a block
    # rejected in part must not displace a key still inside a window: state/sliding.py).
    self.slack = self.verifier.width
    # Prefix caching: the target's state must be all pages; the drafter's prefill inputs are
    # kept per pool position (speculative/prefix.py).
    self._prefix_width = 0
    if config.prefix_cache:
      cfg = target.config
      why = prefix_lib.why_uncacheable(cfg, config.max_len, config.kv_format, config.page_size)
      if why:
        raise ConfigError(f"prefix_cache: {why}")
      self._prefix_width = prefix_lib.feature_width(drafter, cfg.hidden_size)
    # Refuse shapes whose state cannot fit now, with the numbers, not RESOURCE_EXHAUSTED later.
    self.memory = memory.engine_plan(
      self.target,
      drafter,
      config.batch_size,
      config.max_len,
      config.kv_format,
      self.slack,
      config.paging(config.batch_size),
      self._prefix_width,
    )
    memory.check_fits(self.memory, config.batch_size, config.max_len, config.kv_format)
    cfg, dr = target.config, drafter
    self._abstract: dict[int, SpecState] = {}  # batch → the state's shapes (_abstract_state)
    # On a mesh: the state's logical axes (traced once) lay out every state the jits return.
    axes = self._state_axes = None if mesh is None else self.state_axes()
    self._prefill = self._on_mesh(
      jax.jit(
        functools.partial(
          step_lib.prefill,
          cfg,
          dr,
          state_axes=axes,
          slack=self.slack,
          tree_ranks=self.verifier.rank_shape,
          top_k=config.top_logprobs,
          prefix_width=self._prefix_width,
        ),
        static_argnames=("chunk", "kv_format", "paging", "copies"),
        donate_argnames=("tokens",),
      )
    )
    self._loops = {
      b: self._on_mesh(
        jax.jit(
          functools.partial(step_lib.run_loop, cfg, dr, verifier=v, state_axes=axes),
          donate_argnums=(2,),
        )
      )
      for b, v in self._variants.items()
    }
    self._loop = self._loops[full]
    self._row_loops: dict[int, Any] = {}  # budget → run_rows, built on first use (batch axes)
    self._insert = None  # built on first use: finding the batch axes traces a prefill
    self._take_row = None
    self._evict = self._on_mesh(
      jax.jit(functools.partial(step_lib.evict_rows, state_axes=axes), donate_argnums=(0,))
    )
    self._recent = self._on_mesh(jax.jit(step_lib.recent, static_argnums=(1,)))
    self._set_pages = self._on_mesh(
      jax.jit(functools.partial(step_lib.set_page_table, state_axes=axes), donate_argnums=(0,))
    )

  def _engine_stop_ids(self) -> tuple[int, ...]:
    """The config's stop ids and (use_eos) the target's eos ids, checked."""
    config, vocab = self.config, self.target.config.vocab_size
    stops = list(config.stop_ids)
    if config.use_eos:
      stops += list(self.target.config.eos_token_ids)
    stops = list(dict.fromkeys(int(t) for t in stops))
    outside = [t for t in stops if t >= vocab]
    if outside:
      raise ConfigError(f"stop ids {outside} are outside the vocabulary (size {vocab})")
    if len(stops) > config.max_stop_ids:
      raise ConfigError(
        f"at most {config.max_stop_ids} stop ids, got {stops} (raise EngineConfig.max_stop_ids)"
      )
    return tuple(stops)

  def _on_mesh(self, fn: Any) -> Any:
    """`fn`, called inside the engine's mesh and rules when it has a mesh."""
    return placement.on_mesh(self.mesh, self.rules, fn)

  @property
  def drafter_params(self) -> Any:
    return self.drafter.params if self.drafter is not None else None

  # -- input handling --------------------------------------------------------------------------

  def _request(
    self, prompts: Any, args: SamplingArgs, max_prompts: Optional[int] = None
  ) -> Request:
    """Validates a call's arguments once (jaxspec/speculative/request.py)."""
    return Request.build(prompts, args, max_prompts=max_prompts or self.config.batch_size)

  def _row_stop_ids(self, request: Request, batch: int) -> np.ndarray:
    """int32 [batch, max_stop_ids]: the engine's stop ids plus each prompt's own, -1 padded."""
    out = np.full((batch, self.config.max_stop_ids), -1, np.int32)
    vocab = self.target.config.vocab_size
    for i in range(batch):
      extra = request.stop_token_ids[i] if i < len(request) else ()
      bad = [t for t in extra if t >= vocab]
      if bad:
        raise InputError(f"prompt {i}: stop_token_ids {bad} are outside the vocabulary ({vocab})")
      ids = list(dict.fromkeys(self.stop_ids + tuple(extra)))
      if len(ids) > self.config.max_stop_ids:
        raise InputError(
          f"prompt {i}: {len(ids)} stop ids (the engine's {len(self.stop_ids)} and its own), "
          f"more than EngineConfig.max_stop_ids={self.config.max_stop_ids}"
        )
      out[i, : len(ids)] = ids
    return out

  def _encode(self, request: Request) -> list[list[int]]:
    out = []
    tok = self.target.tokenizer
    for i, p in enumerate(request.prompts):
      if isinstance(p, str):
        if tok is None:
          raise InputError("text prompts need a model with a tokenizer; pass token ids instead")
        # User text is plain text: a typed "<|mask|>" is characters, not the control token,
        # unless the caller asks for special tokens to be parsed.
        ids = tok.encode(p, split_special_tokens=not request.parse_special)
        if not ids:
          raise InputError(f"prompt {i} encodes to no tokens")
      else:
        ids = list(p)
      self.target.check_tokens(np.asarray([ids]))
      out.append(ids)
    return out

  @takes_sampling_args
  def init_state(self, prompts: Any, *args: Any, **kwargs: Any) -> SpecState:
    """Validates and pads the inputs and runs the prefill (jitted once per prompt bucket).

    Arguments as for `generate`.
    """
    return self._start(self._request(prompts, SamplingArgs.of(args, kwargs, "init_state")))

  def _checked(self, request: Request, batch: int) -> tuple[list[list[int]], np.ndarray]:
    """The request's token ids and [batch, max_stop_ids] stop ids, or the InputError that
    prefilling it would hit (ids outside the vocabulary, too long for max_len, stop ids)."""
    ids = self._encode(request)
    cfg = self.config
    stop_ids = self._row_stop_ids(request, batch)
    if request.adjusts_logits and not cfg.penalties:
      raise InputError(
        "penalties and logit_bias need an engine built with EngineConfig(penalties=True)"
      )
    vocab = self.target.config.vocab_size
    for i, pairs in enumerate(request.logit_bias):
      outside = [t for t, _ in pairs if t >= vocab]
      if outside:
        raise InputError(f"prompt {i}: logit_bias ids {outside[:4]} are outside the vocabulary")
    for i, (p, m) in enumerate(zip(ids, request.max_new_tokens)):
      need = len(p) + m + self.lookahead + 1
      if m > self.max_new_tokens_for(len(p)):
        raise InputError(
          f"prompt {i} has {len(p)} tokens; with max_new_tokens={m} and "
          f"{self.verifier.describe()} per step "
          f"it needs {need} slots, more than max_len={cfg.max_len}"
        )
    return ids, stop_ids

  def max_new_tokens_for(self, prompt_len: int) -> int:
    """The most tokens a prompt of `prompt_len` tokens may generate: its sequence, the
    drafter's lookahead past the last token and the root must fit in max_len (≤ 0: none)."""
    return self.config.max_len - prompt_len - self.lookahead - 1

  def _start(
    self,
    request: Request,
    batch: Optional[int] = None,
    free: bool = False,
    copies: int = 1,
    prefix: Optional[prefix_lib.CachedPrefix] = None,
  ) -> SpecState:
    """Validates, pads to `batch` rows (default batch_size) and prefills (`free`: rows about to
    be evicted, which need no pages; `copies` > 1: the rows are samples of one prompt, which
    the target prefills once; `prefix`: the prompt's first pages are cached in the pool)."""
    b, cfg = batch or self.config.batch_size, self.config
    whole_batch = b == cfg.batch_size and copies == 1  # else a standalone state of its own pool
    if whole_batch and not free and cfg.num_pages < b * cfg.pages_per_row:
      raise ConfigError(
        f"kv_pages={cfg.kv_pages} holds fewer than batch_size × max_len positions: such a pool "
        "serves rows through a page allocator (launch/serve.py, jaxspec.serve), not generate"
      )
    ids, stop_ids = self._checked(request, b)
    longest = max(len(p) for p in ids)
    skip = 0 if prefix is None else int(prefix.count) * cfg.page_size  # cached positions
    if skip > longest - 1:
      raise InputError(
        f"prefill_cached: {skip // cfg.page_size} cached pages of {cfg.page_size} for a prompt "
        f"of {longest} tokens (its last position must be prefilled)"
      )
    # Short prompts: one chunk of the prompt's bucket (one compilation per bucket); long ones:
    # chunks of prefill_chunk (one compilation for every length).
    rest = longest - skip
    chunk = min(_bucket(rest, cfg.min_prompt_bucket, cfg.max_len), cfg.prefill_chunk)
    tokens = np.zeros((b, cfg.max_len), np.int32)
    lens = np.ones((b,), np.int32)
    for i, p in enumerate(ids):
      tokens[i, : len(p)] = p
      lens[i] = len(p)
    rows = request.padded(b)
    active = np.arange(b) < len(ids)
    params = sampling.make_sampling_params(b, rows["temperature"], rows["top_k"], rows["top_p"])
    seeds, index = request.seeds_and_rows
    pad = b - len(ids)
    keys = sampling.row_keys(seeds + [0] * pad, index + list(range(len(ids), b)))
    row, vec = (sharding.BATCH, None), (sharding.BATCH,)
    inputs = self._to_device(
      (tokens, lens, rows["max_new_tokens"], active, params, keys, stop_ids),
      ((sharding.BATCH, sharding.LENGTH), vec, vec, vec, jax.tree.map(lambda _: vec, params))
      + (row, row),
    )
    penalty_rows = None
    if cfg.penalties:
      bias = request.logit_bias_rows(b, self.target.config.vocab_size)
      penalty_rows = self._to_device(
        tuple(rows[name] for name in request_lib.PENALTIES) + bias, (vec, vec, vec, row, row)
      )
    return self._prefill(
      self.target.params,
      self.drafter_params,
      *inputs,
      jnp.int32(-(-rest // chunk)),
      penalty_rows,
      chunk=chunk,
      kv_format=cfg.kv_format,
      paging=cfg.paging(1 if copies > 1 else b),
      copies=copies,
      prefix=prefix,
    )

  def _to_device(self, host: Any, logical_axes: Any) -> Any:
    """Host inputs (numpy, the same on every process) as arrays for the jitted functions.

    When the target's params live on a mesh that spans several processes, each becomes a
    global array on that mesh, its batch axis sharded by the logical rules (a numpy input
    cannot enter a multi-process program with sharded inputs); otherwise jit places them.
    """
    mesh = self.mesh or distributed.mesh_of(self.target.params)
    if mesh is None or not mesh.is_multi_process:
      return jax.tree.map(jnp.asarray, host)
    return distributed.put(host, mesh, logical_axes, self.rules)

  def _outputs(self, state: SpecState, n: int, values: str = "tokens") -> list[list]:
    """Each of the first n rows' generated tokens (or their log-probs, values="logprobs");
    gathered from every process when the state spans several."""
    arr, seq, prompt = distributed.gather((getattr(state, values), state.seq_len, state.prompt_len))
    return [arr[i, prompt[i] : seq[i]].tolist() for i in range(n)]

  def _texts(self, token_lists: list[list[int]]) -> Optional[list[str]]:
    tok = self.target.tokenizer
    return None if tok is None else [tok.decode(t, skip_special_tokens=True) for t in token_lists]

  # -- generation --------------------------------------------------------------------------------

  @takes_sampling_args
  def generate(self, prompts: Any, *args: Any, **kwargs: Any) -> GenerateOutput:
    """Generates for up to batch_size prompts; returns texts, tokens and stats.

    Args:
      prompts: one str, or a sequence of prompts, each a str or a 1-D sequence of token ids.
      *args, **kwargs: the sampling arguments (`SamplingArgs`: one, or its fields):
        max_new_tokens: an integer ≥ 1, or one per prompt.
        temperature: ≥ 0 (0 = greedy), or one per prompt.
        top_k: ≥ 0 (0 = off), or one per prompt.
        top_p: in (0, 1] (1 = off), or one per prompt.
        seed: the sampling seed, or one per prompt (see jaxspec/speculative/request.py: a
          request's random stream depends on its seed only, not on its batch row).
        parse_special (keyword): parse special-token strings typed in text prompts (say
          "<|endoftext|>") as the control tokens; by default text is plain text.
        stop_token_ids (keyword): extra stop tokens, for every prompt or one list per prompt.

    Raises:
      InputError: for anything else (jaxspec/speculative/request.py lists the accepted forms).
    """
    t0 = time.perf_counter()
    request = self._request(prompts, SamplingArgs.of(args, kwargs, "generate"))
    state = self._start(request)
    jax.block_until_ready(state.tokens)
    t1 = time.perf_counter()
    state = self.run(state)
    jax.block_until_ready(state.tokens)
    t2 = time.perf_counter()
    n = len(request)
    tokens = self._outputs(state, n)
    stats = self._stats(state, t1 - t0, t2 - t1, n)
    top = None
    if self.config.top_logprobs:
      ids, lps = self._outputs(state, n, "top_ids"), self._outputs(state, n, "top_logprobs")
      top = [
        [list(zip(i, lp)) for i, lp in zip(row_ids, row_lps)] for row_ids, row_lps in zip(ids, lps)
      ]
    logprobs = self._outputs(state, n, "logprobs")
    return GenerateOutput(self._texts(tokens), tokens, stats, logprobs, top)

  @takes_sampling_args
  def stream(self, prompts: Any, *args: Any, **kwargs: Any) -> Iterator[list[list[int]]]:
    """Yields each sequence's newly committed tokens every `stream_every` steps.

    Arguments as for `generate`; they are checked when this is called, not when iterated.
    """
    request = self._request(prompts, SamplingArgs.of(args, kwargs, "stream"))
    return self._stream(self._start(request), len(request))

  def _stream(self, state: SpecState, n: int) -> Iterator[list[list[int]]]:
    sent = [0] * n
    while True:
      toks = self._outputs(state, n)
      yield [t[s:] for t, s in zip(toks, sent)]
      sent = [len(t) for t in toks]
      if bool(np.all(distributed.gather(state.done))):
        return
      state = self.run(state, self.config.stream_every)

  # -- slots: rows that come and go (continuous batching) ----------------------------------------

  def window(self, steps: int) -> int:
    """The most tokens a row can have that `recent` has not shown after a chunk of `steps`
    steps: its first token (sampled at prefill) and up to `max_commit` tokens a step."""
    return 1 + steps * self.verifier.max_commit

  def recent(self, state: SpecState, window: int) -> dict[str, jax.Array]:
    """Each row's last `window` tokens and log-probs, lengths, done and stop flags and
    counters (`step.recent`): what a server reads back after a loop chunk, O(B·window), not
    the O(B·max_len) buffers. One compilation per window."""
    return self._recent(state, window)

  def run(
    self,
    state: SpecState,
    max_steps: Optional[int] = None,
    budget: Optional[int] = None,
    rows: Optional[Sequence[int]] = None,
  ) -> SpecState:
    """Advances every live row by up to `max_steps` steps (None: until every row is done) in
    one compiled on-device loop, the same program for every `max_steps`. Donates `state`.

    budget: the speculation budget of these steps, one of `budgets` (None: the full one;
      EngineConfig(speculation="auto") offers smaller ones on the same state).
    rows: the live rows (None: all). Fewer than batch_size run compacted into the smallest
      `row_buckets` entry that holds them, so a step costs what that many rows cost; other
      rows do not advance.
    """
    limit = jnp.int32(_NO_STEP_LIMIT if max_steps is None else max_steps)
    budget = self.budgets[-1] if budget is None else int(budget)
    if budget not in self._loops:
      raise InputError(f"budget={budget}: this engine runs budgets {self.budgets}")
    params = (self.target.params, self.drafter_params)
    batch = self.config.batch_size
    if rows is not None:
      rows = sorted({int(r) for r in rows})
      if rows and not 0 <= rows[0] <= rows[-1] < batch:
        raise InputError(f"rows {rows} are outside the batch [0, {batch})")
      bucket = next((b for b in self.row_buckets if b >= len(rows)), batch)
      if bucket < batch:
        pad = bucket - len(rows)
        idx = np.asarray(rows + [rows[0] if rows else 0] * pad, np.int32)
        valid = np.arange(bucket) < len(rows)
        idx, valid = self._to_device((idx, valid), ((None,), (None,)))
        return self._row_loop(budget)(*params, state, limit, idx, valid)
    return self._loops[budget](*params, state, limit)

  def _row_loop(self, budget: int) -> Any:
    if budget not in self._row_loops:
      fn = functools.partial(
        step_lib.run_rows,
        self.target.config,
        self.drafter,
        self._batch_axes(),
        verifier=self._variants[budget],
        state_axes=self._state_axes,
      )
      self._row_loops[budget] = self._on_mesh(jax.jit(fn, donate_argnums=(2,)))
    return self._row_loops[budget]

  def measure_step_costs(
    self, state: SpecState, steps: Optional[int] = None
  ) -> tuple[SpecState, dict[tuple[int, int], float]]:
    """Seconds per step of every (budget, row bucket) program on this machine, every slot
    busy with a dummy request (what `speculation="auto"` starts from; a server refines them
    as it runs). Returns the state with every row free again (paged: every page unmapped)
    and {(budget, bucket): seconds}. Donates `state`."""
    cfg = self.config
    steps = steps or cfg.stream_every
    if cfg.page_size:  # every row the same pages: only the time matters here
      table = np.tile(np.arange(cfg.pages_per_row) % cfg.num_pages, (cfg.batch_size, 1))
      state = self.set_page_table(state, table.astype(np.int32))
    room = min(2 * steps * self.verifier.max_commit + 1, self.max_new_tokens_for(1))
    prompt = [0]
    costs: dict[tuple[int, int], float] = {}
    for budget in self.budgets:
      for bucket in self.row_buckets:
        best = float("inf")
        for _ in range(2):
          row = self._warm_row(state, prompt, room)
          for slot in range(cfg.batch_size):
            state = self.insert(state, slot, row)
          before = int(distributed.gather(state.stats.target_passes)[0])
          jax.block_until_ready(state)
          t0 = time.perf_counter()
          state = self.run(state, steps, budget, rows=range(bucket))
          jax.block_until_ready(state)
          elapsed = time.perf_counter() - t0
          ran = int(distributed.gather(state.stats.target_passes)[0]) - before
          best = min(best, elapsed / max(ran, 1))
        costs[(budget, bucket)] = best
    state = self.evict(state, jnp.arange(cfg.batch_size))
    if cfg.page_size:
      unmapped = np.full((cfg.batch_size, cfg.pages_per_row), cfg.num_pages, np.int32)
      state = self.set_page_table(state, unmapped)
    return state, costs

  def _warm_row(
    self, state: SpecState, prompt: list[int], max_new: int, rows: int = 1
  ) -> SpecState:
    """A greedy state of `prompt`, one row or a group of `rows` choices, through the program a
    server runs (prefix-cache engines: `prefill_cached`, with nothing cached)."""
    args = SamplingArgs(max_new_tokens=max_new, temperature=0.0)
    group = [args] * rows if rows > 1 else None
    if self.config.prefix_cache:
      return self.prefill_cached(state, prompt, group or args)
    return self.prefill_rows(prompt, group) if group else self.prefill_row(prompt, args)

  def empty_state(self) -> SpecState:
    """A batch_size-row state with every row free (done): the start of a slot-served engine."""
    request = self._request([[0]] * self.config.batch_size, SamplingArgs(max_new_tokens=1))
    state = self._start(request, free=True)
    return self.evict(state, jnp.arange(self.config.batch_size))

  @takes_sampling_args
  def prefill_row(self, prompt: Any, *args: Any, **kwargs: Any) -> SpecState:
    """One request (a str or 1-D token ids) prefilled as a one-row state, for `insert`.

    Sampling arguments as for `generate` (one value each). Validated as `generate` validates;
    its key is fold_in(PRNGKey(seed), 0), as for a single-prompt `generate`, so the request
    samples what it samples alone.
    """
    request = self._request([prompt], SamplingArgs.of(args, kwargs, "prefill_row"), 1)
    return self._start(request, batch=1)

  def prefill_rows(self, prompt: Any, arguments: Sequence[SamplingArgs]) -> SpecState:
    """One request sampled n = len(arguments) times (OpenAI's `n`): the prompt prefilled once
    for a state of `choice_group(n)` rows (`insert_rows` takes the first n), row i with
    `arguments[i]` (one value each; its own seed).

    The target runs the prompt once; each row draws its first token from those logits with
    its own key and sampling arguments, and its drafter absorbs the same features, so row i
    samples exactly what `prefill_row(prompt, arguments[i])` samples. One compilation per
    group size (and prompt bucket)."""
    request, n = self._group_request(prompt, arguments)
    return self._start(request, batch=n, copies=n if n > 1 else 1)

  def prefill_cached(
    self,
    state: SpecState,
    prompt: Any,
    arguments: SamplingArgs | Sequence[SamplingArgs],
    pages: Sequence[int] = (),
  ) -> SpecState:
    """`prefill_row` (one SamplingArgs) or `prefill_rows` (a list) of a prompt whose first
    len(pages) pages of positions are cached in `state`'s pool, at those pool pages
    (EngineConfig.prefix_cache; the server's page allocator knows which): the target reads
    their K/V and the drafter their kept features, and only the rest is prefilled. The rows
    sample what a full prefill samples. At least the prompt's last position must be left to
    prefill. One compilation per prompt bucket (and n) whatever `pages` holds; `state` is
    read, not donated."""
    cfg = self.config
    if not cfg.prefix_cache:
      raise ConfigError("prefill_cached: this engine has no prefix cache (EngineConfig)")
    group = not isinstance(arguments, SamplingArgs)
    request, n = self._group_request(prompt, arguments if group else [arguments])
    pages = [int(p) for p in pages]
    if not all(0 <= p < cfg.num_pages for p in pages):
      raise InputError(f"prefill_cached: page ids must be in [0, {cfg.num_pages}), got {pages}")
    table = np.full((cfg.pages_per_row,), cfg.num_pages, np.int32)
    table[: len(pages)] = pages
    prefix = prefix_lib.CachedPrefix(
      state.target_state,
      state.prefix_features,
      *self._to_device((table, np.int32(len(pages))), ((None,), ())),
    )
    return self._start(request, batch=n, copies=n if n > 1 else 1, prefix=prefix)

  def _group_request(
    self, prompt: Any, arguments: Sequence[SamplingArgs]
  ) -> tuple[Request, int]:
    """The Request of one prompt sampled once per SamplingArgs (one value each), padded with
    copies of the last to `choice_group` rows (dropped at `insert_rows`), and its rows."""
    arguments = list(arguments)
    if not arguments or not all(isinstance(a, SamplingArgs) for a in arguments):
      raise InputError("prefill_rows: give one SamplingArgs per row (at least one)")
    if len({bool(a.parse_special) for a in arguments}) > 1:
      raise InputError("prefill_rows: parse_special must be the same for every row")
    if len(arguments) == 1:
      return self._request([prompt], arguments[0], 1), 1
    arguments += arguments[-1:] * (self.choice_group(len(arguments)) - len(arguments))
    per_row = {
      f.name: [getattr(a, f.name) for a in arguments]
      for f in dataclasses.fields(SamplingArgs)
      if f.name != "parse_special"
    }
    per_row["stop_token_ids"] = [list(s or ()) for s in per_row["stop_token_ids"]]
    per_row["logit_bias"] = [b or {} for b in per_row["logit_bias"]]
    merged = SamplingArgs(parse_special=arguments[0].parse_special, **per_row)
    n = len(arguments)
    return self._request([prompt] * n, merged, n), n

  def choice_group(self, n: int) -> int:
    """The rows a group prefill of n choices runs: n rounded up to a power of two, at most
    batch_size (one compilation per group size and prompt bucket, not per n)."""
    return min(1 << max(n - 1, 0).bit_length(), max(self.config.batch_size, n))

  def insert_rows(self, state: SpecState, slots: Sequence[int], rows: SpecState) -> SpecState:
    """`insert` of row i of a group state (`prefill_rows`) at `slots[i]`, for the first
    len(slots) rows (the group's padding rows are dropped); paged K/V: the rows' shared prompt
    pages are copied to each slot's pages (the scheduler maps the full ones to the same pool
    pages, serve/pages.py). Donates `state`."""
    slots = [int(s) for s in slots]
    if self._take_row is None:
      axes = self._batch_axes()

      def take(rows_state, i):
        pick = lambda ax, x: x if ax is None else jax.lax.dynamic_slice_in_dim(x, i, 1, axis=ax)
        return jax.tree_util.tree_map(pick, axes, rows_state, is_leaf=lambda x: x is None)

      self._take_row = self._on_mesh(jax.jit(take))
    if not 1 <= len(slots) <= int(rows.seq_len.shape[0]):
      raise InputError(f"insert_rows: {len(slots)} slots for {rows.seq_len.shape[0]} rows")
    for i, slot in enumerate(slots):
      state = self.insert(state, slot, self._take_row(rows, jnp.int32(i)))
    return state

  @takes_sampling_args
  def check_row(self, prompt: Any, *args: Any, **kwargs: Any) -> None:
    """Raises the InputError that `prefill_row` would raise for these arguments, on the host
    only (no device work): what a server checks before it queues a request."""
    self._checked(self._request([prompt], SamplingArgs.of(args, kwargs, "check_row"), 1), 1)

  def insert(self, state: SpecState, slot: Any, row: SpecState) -> SpecState:
    """`state` with batch row `slot` replaced by the one-row state `row` (from `prefill_row`):
    tokens, the target's and the drafter's decoding state, key, stop ids, sampling, stats.
    One compilation for every slot; donates `state`."""
    if not 0 <= int(slot) < self.config.batch_size:
      raise InputError(f"slot {slot} is outside the batch [0, {self.config.batch_size})")
    if self._insert is None:
      self._insert = self._on_mesh(
        jax.jit(
          functools.partial(
            step_lib.insert_row, self._batch_axes(), state_axes=self._state_axes
          ),
          donate_argnums=(0,),
        )
      )
    return self._insert(state, jnp.int32(slot), row)

  def set_page_table(self, state: SpecState, table: Any) -> SpecState:
    """`state` with the page tables [batch_size, max_len / page_size] (int; pool page ids,
    `num_pages` = none): which pool pages hold each row's positions (EngineConfig.page_size;
    the server's page allocator, serve/pages.py, owns them). One compilation; donates `state`."""
    cfg = self.config
    table = np.asarray(table)
    if not cfg.page_size:
      raise ConfigError("set_page_table: this engine has no paged KV (EngineConfig.page_size)")
    if table.shape != (cfg.batch_size, cfg.pages_per_row) or table.dtype.kind not in "iu":
      raise InputError(
        f"set_page_table: expected integer page ids of shape {(cfg.batch_size, cfg.pages_per_row)}"
        f", got {table.dtype} {table.shape}"
      )
    if table.size and not 0 <= int(table.min()) <= int(table.max()) <= cfg.num_pages:
      raise InputError(f"set_page_table: page ids must be in [0, {cfg.num_pages}]")
    table = self._to_device(table.astype(np.int32), (sharding.BATCH, None))
    return self._set_pages(state, table)

  def evict(self, state: SpecState, slot: Any) -> SpecState:
    """`state` with row(s) `slot` (an index or a sequence of them) marked done: they commit
    nothing more and their slots may be reused by `insert`. One compilation; donates `state`."""
    rows = np.zeros((self.config.batch_size,), bool)
    rows[np.asarray(slot, np.int64)] = True
    return self._evict(state, self._to_device(rows, (sharding.BATCH,)))

  def warm_up_slots(self) -> SpecState:
    """Compiles everything a slot-served engine runs (the one-row prefill of every prompt
    bucket, and the group prefills of up to `warm_choices` choices, insert, evict, the
    stepping loop) and returns a free state, so that serving never compiles. Prompts longer
    than prefill_chunk share the last bucket's chunked program."""
    state = self.empty_state()
    cfg = self.config
    if cfg.page_size:  # every page unmapped: the allocator maps them as rows arrive
      state = self.set_page_table(
        state, np.full((cfg.batch_size, cfg.pages_per_row), cfg.num_pages, np.int32)
      )
    longest = cfg.max_len - self.lookahead - 2  # the longest prompt a request may have
    top = min(_bucket(longest, cfg.min_prompt_bucket, cfg.max_len), cfg.prefill_chunk)
    size = cfg.min_prompt_bucket
    groups = sorted({self.choice_group(n) for n in range(2, cfg.warm_choices + 1)})
    while longest >= 1:
      n = min(size, longest)  # the longest prompt of this bucket that fits
      state = self.insert(state, 0, self._warm_row(state, [0] * n, 1))
      for rows in groups:  # n > 1 choices of one prompt: one prefill per group size
        state = self.insert_rows(state, range(rows), self._warm_row(state, [0] * n, 1, rows))
      if min(_bucket(n, cfg.min_prompt_bucket, cfg.max_len), cfg.prefill_chunk) >= top:
        break
      size *= 2
    for budget in self.budgets:  # every budget's program on every row bucket
      for bucket in self.row_buckets:
        state = self.run(state, cfg.stream_every, budget, rows=range(bucket))
    return self.evict(state, jnp.arange(cfg.batch_size))

  def _stats(self, state: SpecState, ttft: float, decode: float, n: int) -> GenerationStats:
    stats, seq, prompt = distributed.gather((state.stats, state.seq_len, state.prompt_len))
    summary = metrics.summarize(jax.tree_util.tree_map(lambda x: x[:n], stats), decode, ttft)
    generated = int(np.sum((seq - prompt)[:n]))
    return GenerationStats(
      acceptance_length=summary["acceptance_length"],
      acceptance_rate_per_position=summary["acceptance_rate_per_position"],
      target_passes=summary["target_passes"],
      tokens_generated=generated,
      tokens_per_second=generated / max(decode + ttft, 1e-9),
      time_to_first_token_s=ttft,
      decode_time_s=decode,
      summary=summary,
    )

  @property
  def prefix_feature_bytes(self) -> int:
    """Bytes of the target features kept per pool position for cached prefixes
    (`SpecState.prefix_features`; 0 without a prefix cache or a drafter that reads them)."""
    cfg = self.config
    paging, width = cfg.paging(cfg.batch_size), self._prefix_width
    target = self.target.config
    return memory.prefix_feature_bytes(target, cfg.batch_size, cfg.max_len, paging, width)

  def compile_counts(self) -> dict[str, int]:
    """How many programs each jitted function holds (one per shape bucket; "loop" counts
    every speculation budget's, "row_loop" every budget's on row buckets, when there are)."""
    counts = {
      "prefill": self._prefill._cache_size(),
      "loop": sum(f._cache_size() for f in self._loops.values()),
      "insert": 0 if self._insert is None else self._insert._cache_size(),
      "insert_rows": 0 if self._take_row is None else self._take_row._cache_size(),
      "evict": self._evict._cache_size(),
      "set_page_table": self._set_pages._cache_size(),
    }
    if len(self.row_buckets) > 1:
      counts["row_loop"] = sum(f._cache_size() for f in self._row_loops.values())
    return counts

  def _abstract_state(self, batch: int) -> SpecState:
    """The SpecState a prefill of `batch` rows returns, as shapes (nothing runs; traced once
    per batch size)."""
    if batch not in self._abstract:
      self._abstract[batch] = self._trace_state(batch)
    return self._abstract[batch]

  def _trace_state(self, batch: int) -> SpecState:
    cfg = self.config
    i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)
    params = sampling.make_sampling_params(batch, 0.0, 0, 1.0)
    keys = jax.ShapeDtypeStruct((batch, 2), jnp.uint32)
    chunk = min(cfg.min_prompt_bucket, cfg.max_len)
    run = functools.partial(
      step_lib.prefill,
      self.target.config,
      self.drafter,
      chunk=chunk,
      kv_format=cfg.kv_format,
      slack=self.slack,
      tree_ranks=self.verifier.rank_shape,
      top_k=cfg.top_logprobs,
      prefix_width=self._prefix_width,
      # A pool that does not grow with the rows, so that comparing 1- and 2-row states finds
      # the rows' axes (the pool's size is not one; `state_axes`, `_batch_axes`).
      paging=Paging(cfg.page_size, cfg.pages_per_row) if cfg.page_size else None,
    )
    penalty_rows = None
    if cfg.penalties:
      f32 = jax.ShapeDtypeStruct((batch,), jnp.float32)
      bias = (batch, request_lib.MAX_LOGIT_BIAS)
      penalty_rows = (f32, f32, f32, i32(*bias), jax.ShapeDtypeStruct(bias, jnp.float32))
    return jax.eval_shape(
      run,
      self.target.params,
      self.drafter_params,
      i32(batch, cfg.max_len),
      i32(batch),
      i32(batch),
      jax.ShapeDtypeStruct((batch,), jnp.bool_),
      params,
      keys,
      i32(batch, cfg.max_stop_ids),
      i32(),
      penalty_rows,
    )

  def state_axes(self) -> SpecState:
    """The logical axes of every SpecState leaf (a SpecState of logical PartitionSpecs, e.g.
    ("layers", "batch", "length", "kv_heads", "head_dim") for the target's K/V): the `AXES`
    tables of the state structs, checked against the batch axes that 1- and 2-row states show
    (jaxspec.state.logical_axes). On a mesh the state is laid out by them."""
    return logical_axes(self._abstract_state(1), self._abstract_state(2))

  def state_shardings(self, batch: Optional[int] = None) -> SpecState:
    """The NamedSharding of every SpecState leaf for `batch` rows (default batch_size) on the
    engine's mesh: what `state_axes` gives under its rules (an axis that does not divide its
    mesh axes is replicated, e.g. the batch of a one-row `prefill_row` state)."""
    if self.mesh is None:
      raise ConfigError("state_shardings: this engine has no mesh (SpecEngine(..., mesh=...))")
    shapes = self._abstract_state(batch or self.config.batch_size)
    return sharding.shardings_for(shapes, self.state_axes(), self.mesh, self.rules)

  def _batch_axes(self) -> Any:
    """Per SpecState leaf, its batch axis (the one whose size follows the batch), or None for
    a leaf shared by every row: found by comparing the shapes of 1- and 2-row states."""
    return placement.batch_axes(self._abstract_state(1), self._abstract_state(2))
