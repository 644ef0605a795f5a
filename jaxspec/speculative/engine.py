"""The speculative engine's host side: `SpecEngine`, its assembly and its batch API.

`SpecEngine` validates requests (jaxspec/speculative/request.py; against the engine:
jaxspec/speculative/request_checks.py), pads them to static shapes and runs the compiled
program of jaxspec/speculative/step.py: `prefill`, then a `lax.while_loop` of the draft →
verify → accept → commit `step` until every sequence has hit its `max_new_tokens` or a stop
token, with no host round trip. Shapes are static per engine
(batch and max_len are fixed at construction, prompts are padded to power-of-two buckets),
sampling parameters and budgets are arrays: twenty calls with different prompts, lengths and
temperatures compile each function once.

How a step verifies is one verifier object (jaxspec/speculative/verifiers.py), chosen here from
the config: plain decoding with `drafter=None` (the baseline every speedup is measured
against), a chain of γ drafts, or with `EngineConfig(verify="tree")` a DDTree (a best-first
draft tree from the drafter's per-position distributions, verified in one target pass under an
ancestor mask; see docs/tree.md).

The engine's static shapes and method choices are an `EngineConfig`
(jaxspec/speculative/engine_config.py). Beside the batch API (`generate`, `stream`), rows can
come and go between calls of `run` (continuous batching, jaxspec/serve/): the slot API
(`prefill_row`, `insert`, `evict`, ...: jaxspec/speculative/slots.py) and its warm-up
(`warm_up_slots`: jaxspec/speculative/warmup.py) are methods of `SpecEngine` too.

On a device mesh (`SpecEngine(..., mesh=sharding.make_mesh(...), rules=...)`) the target's and
the drafter's parameters are placed by their logical axes (jaxspec/speculative/placement.py),
every SpecState leaf has logical axes (`SpecEngine.state_axes`: the `AXES` tables of the state
structs in jaxspec/state/, traced in jaxspec/speculative/state_shapes.py) by which it is created
and kept (batch on `data`, KV heads on `tensor` under the default rules), and the jitted
functions are traced inside `sharding.use_mesh`, so the model code's activation constraints
apply too. Same program, same compilations, one layout across the loop.
"""

from __future__ import annotations

import functools
import time
from typing import Any, Iterator, Optional, Sequence

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
from jaxspec.speculative.engine_config import EngineConfig, GenerateOutput, GenerationStats
from jaxspec.speculative.request import Request, SamplingArgs, takes_sampling_args
from jaxspec.speculative.request_checks import RequestChecks
from jaxspec.speculative.slots import SlotMethods
from jaxspec.speculative.state_shapes import StateShapes
from jaxspec.speculative.step import SpecState
from jaxspec.speculative.warmup import WarmUpMethods

_NO_STEP_LIMIT = 2**31 - 1


class SpecEngine(RequestChecks, SlotMethods, WarmUpMethods):
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
    # The state's shapes per batch size, traced from the prefill (never run).
    self._shapes = StateShapes(
      self.target,
      drafter,
      config,
      slack=self.slack,
      tree_ranks=self.verifier.rank_shape,
      prefix_width=self._prefix_width,
    )
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

  def _on_mesh(self, fn: Any) -> Any:
    """`fn`, called inside the engine's mesh and rules when it has a mesh."""
    return placement.on_mesh(self.mesh, self.rules, fn)

  @property
  def drafter_params(self) -> Any:
    return self.drafter.params if self.drafter is not None else None

  # -- prefill -----------------------------------------------------------------------------------

  @takes_sampling_args
  def init_state(self, prompts: Any, *args: Any, **kwargs: Any) -> SpecState:
    """Validates and pads the inputs and runs the prefill (jitted once per prompt bucket).

    Arguments as for `generate`.
    """
    return self._start(self._request(prompts, SamplingArgs.of(args, kwargs, "init_state")))

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
    chunk = cfg.prefill_width(rest)
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

  # -- the loop (batch and slot API alike) -------------------------------------------------------

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
        self._shapes.batch_axes(),
        verifier=self._variants[budget],
        state_axes=self._state_axes,
      )
      self._row_loops[budget] = self._on_mesh(jax.jit(fn, donate_argnums=(2,)))
    return self._row_loops[budget]

  # -- reports -----------------------------------------------------------------------------------

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

  def state_axes(self) -> SpecState:
    """The logical axes of every SpecState leaf (a SpecState of logical PartitionSpecs, e.g.
    ("layers", "batch", "length", "kv_heads", "head_dim") for the target's K/V): the `AXES`
    tables of the state structs, checked against the batch axes that 1- and 2-row states show
    (jaxspec.state.logical_axes). On a mesh the state is laid out by them."""
    return self._shapes.axes()

  def state_shardings(self, batch: Optional[int] = None) -> SpecState:
    """The NamedSharding of every SpecState leaf for `batch` rows (default batch_size) on the
    engine's mesh: what `state_axes` gives under its rules (an axis that does not divide its
    mesh axes is replicated, e.g. the batch of a one-row `prefill_row` state)."""
    if self.mesh is None:
      raise ConfigError("state_shardings: this engine has no mesh (SpecEngine(..., mesh=...))")
    return self._shapes.shardings(batch or self.config.batch_size, self.mesh, self.rules)

