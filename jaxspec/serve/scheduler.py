"""Continuous batching over the compiled speculative step: one thread owns one engine.

The engine's state has `batch_size` rows ("slots"). Requests wait in a FIFO queue; each tick the
scheduler thread

1. admits waiting requests into free slots (`SpecEngine.prefill_row` + `insert`),
2. frees the slots of cancelled requests (`evict`),
3. runs the compiled loop for `steps_per_tick` steps over every slot at once (`run`),
4. reads back only what the tick produced (`read_back`: each row's last 1 + k·(γ+1) tokens and
   log-probs, its length and its done and stop flags, decided on device; not the whole
   buffers), hands each live request its new tokens (a `Delta`), and frees the slots of the
   requests that finished (a stop token, or max_tokens).

Everything runs in programs compiled at `start` (`warm_up_slots`, then one tick of no request
for the read-back), so nothing compiles while serving. A request's output does not depend on
its slot or its neighbours: its row has its own PRNG key (from its seed), stop ids and
sampling parameters (jaxspec/speculative/engine.py).

Results reach callers through a `RequestHandle`: iterate it (`async for` on the event loop that
submitted it, or plain `for` from a thread without one) to get Deltas until one carries a
`finish_reason`; `cancel()` from any thread frees the slot at the next tick.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import hashlib
import itertools
import json
import queue
import secrets
import threading
import time
from typing import Any, AsyncIterator, Iterator, Optional, Sequence

import numpy as np

from jaxspec import distributed
from jaxspec.errors import ConfigError, InputError, JaxspecError
from jaxspec.serve.pages import PageAllocator
from jaxspec.serve.speculation import SpeculationPolicy
from jaxspec.speculative.engine import SpecEngine
from jaxspec.speculative.request import SamplingArgs
from jaxspec.speculative.step import SpecState

FINISH_REASONS = ("stop", "length", "cancelled", "error")


def derived_seed(seed: int, *labels: Any) -> int:
  """A seed in [0, 2**63) determined by `seed` and `labels` (a hash: streams derived with
  different labels do not overlap)."""
  text = ":".join(map(str, (seed, *labels))).encode()
  return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little") >> 1


def parse_admission_reserve(text: str) -> Optional[float]:
  """A flag's admission reserve (`Scheduler(admission_reserve=)`): None for 'measured', else
  the share it names, in [0, 1]."""
  if text == "measured":
    return None
  try:
    share = float(text)
  except ValueError:
    share = -1.0
  if not 0.0 <= share <= 1.0:
    raise ConfigError(f"admission reserve {text!r}: expected 'measured' or a share in [0, 1]")
  return share


def choice_seed(seed: int, index: int) -> int:
  """The seed of choice `index` of a request with `n` > 1 and seed `seed`: choice 0 keeps it,
  so it samples what the request with n = 1 samples; choice i samples what a single request
  with this seed samples."""
  return seed if index == 0 else derived_seed(seed, "choice", index)


class QueueFull(JaxspecError):
  """The waiting queue is full (HTTP 429): try again later."""


class SchedulerClosed(JaxspecError):
  """The scheduler is shutting down or stopped (HTTP 503)."""


@dataclasses.dataclass(frozen=True)
class SamplingOptions:
  """What one request asks for (validated by `Scheduler.check`)."""

  max_tokens: int
  temperature: float = 1.0
  top_p: float = 1.0
  top_k: int = 0
  seed: Optional[int] = None  # None: a fresh random seed
  stop_token_ids: tuple[int, ...] = ()  # beside the engine's (eos) stop ids
  logprobs: bool = False  # attach the target's log-prob (raw distribution) of each token
  presence_penalty: float = 0.0  # the adjustments of jaxspec/penalties.py (the engine must be
  frequency_penalty: float = 0.0  # built with EngineConfig(penalties=True) for other values)
  repetition_penalty: float = 1.0
  logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) pairs
  top_logprobs: int = 0  # alternatives per token (at most the engine's EngineConfig.top_logprobs)

  def sampling_args(self, seed: int) -> SamplingArgs:
    """The engine's sampling arguments for this request, with `seed` (the handle's: drawn at
    random when `self.seed` is None)."""
    return SamplingArgs(
      max_new_tokens=self.max_tokens,
      temperature=self.temperature,
      top_k=self.top_k,
      top_p=self.top_p,
      seed=seed,
      stop_token_ids=list(self.stop_token_ids),
      presence_penalty=self.presence_penalty,
      frequency_penalty=self.frequency_penalty,
      repetition_penalty=self.repetition_penalty,
      logit_bias={str(t): v for t, v in self.logit_bias} or None,
    )


@dataclasses.dataclass
class Delta:
  """Tokens a request's row committed since the last Delta (a stop token is not included)."""

  token_ids: list[int]
  logprobs: Optional[list[float]]
  finish_reason: Optional[str] = None  # None while running, then one of FINISH_REASONS
  error: Optional[str] = None
  # Per token, its top_logprobs most likely alternatives as (token id, log-prob) pairs.
  top_logprobs: Optional[list[list[tuple[int, float]]]] = None


class RequestHandle:
  """One submitted request: iterate it for its Deltas; `cancel()` from any thread."""

  _ids = itertools.count()

  def __init__(self, scheduler: "Scheduler", prompt_ids: list[int], options: SamplingOptions):
    self.id = f"req-{next(self._ids)}-{secrets.token_hex(4)}"
    self.prompt_ids = prompt_ids
    self.prompt_tokens = len(prompt_ids)
    self.options = options
    self.seed = options.seed if options.seed is not None else secrets.randbits(63)
    self.finish_reason: Optional[str] = None
    self.submitted = time.perf_counter()
    self.generated: list[int] = []  # tokens delivered so far (a preempted request resumes)
    self.preemptions = 0
    self.group: Optional[list["RequestHandle"]] = None  # n > 1: every choice, until admitted
    self._scheduler = scheduler
    self._cancelled = threading.Event()
    try:
      self._loop: Optional[asyncio.AbstractEventLoop] = asyncio.get_running_loop()
      self._queue: Any = asyncio.Queue()
    except RuntimeError:  # no event loop in this thread: a thread-safe queue
      self._loop = None
      self._queue = queue.Queue()

  def row_prompt(self) -> list[int]:
    """What a row prefills for this request: its prompt, then what it generated before it was
    preempted (the server recomputes that text's K/V; serve/pages.py)."""
    return self.prompt_ids + self.generated

  def row_arguments(self) -> SamplingArgs:
    """The engine's sampling arguments for the row: the tokens still owed, and after a
    preemption a seed of its own (a resumed sampled request draws afresh from there on)."""
    owed = self.options.max_tokens - len(self.generated)
    options = dataclasses.replace(self.options, max_tokens=owed)
    seed = self.seed
    if self.preemptions:
      seed = derived_seed(seed, "preempted", self.preemptions)
    return options.sampling_args(seed)

  @property
  def cancelled(self) -> bool:
    return self._cancelled.is_set()

  def cancel(self) -> None:
    """Stops the request (thread-safe): its slot is freed at the next tick and its stream
    ends with finish_reason "cancelled" (unless it had finished already)."""
    if not self._cancelled.is_set():
      self._cancelled.set()
      self._scheduler._wake_up()  # pylint: disable=protected-access

  def _deliver(self, delta: Delta) -> None:
    """Called by the scheduler thread."""
    if delta.finish_reason is not None:
      self.finish_reason = delta.finish_reason
    if self._loop is None:
      self._queue.put(delta)
      return
    try:
      self._loop.call_soon_threadsafe(self._queue.put_nowait, delta)
    except RuntimeError:  # the caller's event loop is closed: nobody is listening
      pass

  async def __aiter__(self) -> AsyncIterator[Delta]:
    if self._loop is None:
      raise RuntimeError("this request was submitted outside an event loop: iterate it with for")
    while True:
      delta = await self._queue.get()
      yield delta
      if delta.finish_reason is not None:
        return

  def __iter__(self) -> Iterator[Delta]:
    if self._loop is not None:
      raise RuntimeError("this request was submitted on an event loop: iterate it with async for")
    while True:
      delta = self._queue.get()
      yield delta
      if delta.finish_reason is not None:
        return

  def result(self) -> tuple[list[int], Optional[list[float]], str]:
    """Blocks until the request finishes (threads without an event loop): (tokens, logprobs,
    finish_reason)."""
    tokens: list[int] = []
    logprobs: Optional[list[float]] = [] if self.options.logprobs else None
    reason = "error"
    for delta in self:
      if delta.error:
        raise RuntimeError(delta.error)
      tokens += delta.token_ids
      if logprobs is not None and delta.logprobs:
        logprobs += delta.logprobs
      reason = delta.finish_reason or reason
    return tokens, logprobs, reason


@dataclasses.dataclass(frozen=True)
class Tick:
  """One scheduler round's engine calls, all a follower process needs to replay it: set the
  page tables (paged K/V), prefill and insert each admitted request, evict slots, run `steps`
  steps (0: none) and read back."""

  # [slot, prompt token ids, SamplingArgs.to_json(), cached pages] per admitted request; n > 1:
  # [slots, prompt token ids, one SamplingArgs.to_json() per choice, cached pages] (prefilled
  # once). Cached pages (optional): the pool pages holding the prompt's first pages.
  admit: list
  evict: list[int]  # slots to free
  steps: int
  stop: bool = False  # the leader's last tick: followers return
  pages: Optional[list] = None  # paged K/V: every row's page table, set first (None: unchanged)
  budget: Optional[int] = None  # the steps' speculation budget (None: the engine's full one)
  live: Optional[list] = None  # the rows the steps run (None: all; SpecEngine.run's rows)

  def to_json(self) -> str:
    return json.dumps(dataclasses.asdict(self))

  @classmethod
  def from_json(cls, text: str) -> "Tick":
    return cls(**json.loads(text))


def apply_tick(
  engine: SpecEngine, state: SpecState, tick: Tick
) -> tuple[SpecState, dict[str, np.ndarray] | None]:
  """`tick`'s engine calls on `state`, in a fixed order (the leader's scheduler and every
  follower run these, so their collectives match): the new state, and when it ran steps the
  rows' progress read back to the host (gathered from every process)."""
  return run_tick(engine, admit_tick(engine, state, tick), tick.steps, tick.budget, tick.live)


def admit_tick(engine: SpecEngine, state: SpecState, tick: Tick) -> SpecState:
  """`apply_tick`'s first half: page tables, prefill + insert each admitted request, evict."""
  if tick.pages is not None:
    state = engine.set_page_table(state, np.asarray(tick.pages, np.int32))
  for slot, ids, arguments, *cached in tick.admit:
    cached = cached[0] if cached else []
    group = isinstance(slot, list)  # n > 1: one prefill, a row per choice
    args = [SamplingArgs(**a) for a in arguments] if group else SamplingArgs(**arguments)
    if engine.config.prefix_cache:  # reads the cached pages from the pool as it stands
      rows = engine.prefill_cached(state, ids, args, cached)
    else:
      rows = engine.prefill_rows(ids, args) if group else engine.prefill_row(ids, args)
    state = engine.insert_rows(state, slot, rows) if group else engine.insert(state, slot, rows)
  if tick.evict:
    state = engine.evict(state, tick.evict)
  return state


def run_tick(
  engine: SpecEngine,
  state: SpecState,
  steps: int,
  budget: Optional[int] = None,
  live: Optional[list] = None,
) -> tuple[SpecState, dict[str, np.ndarray] | None]:
  """`apply_tick`'s second half: `steps` steps (0: none) of `budget` over the rows `live`
  (None: all) and the read-back."""
  if not steps:
    return state, None
  state = engine.run(state, steps, budget, live)
  return state, read_back(engine, state, engine.window(steps))


def read_back(engine: SpecEngine, state: SpecState, window: int) -> dict[str, np.ndarray]:
  """What a tick produced, on the host: per row the last `window` tokens and log-probs (a
  tick of k steps commits at most window = 1 + k·(γ+1) of them, the first counting the token
  sampled at prefill), the lengths, done and stop flags and counters (`SpecEngine.recent`).
  Its size does not grow with max_len."""
  return distributed.gather(engine.recent(state, window))


@dataclasses.dataclass
class _Slot:
  """A request in a row: the row's prompt (the request's, plus what it generated before a
  preemption), how many tokens this row delivered, its length and counters."""

  handle: RequestHandle
  sent: int
  base: int = 0  # tokens of the row's prompt
  seq_len: int = 0  # the row's length at the last read-back (prefill: base + 1)
  admitted: int = 0  # admission order: the newest row is preempted first
  passes: int = 0
  committed: int = 0
  accepted: Any = 0  # the row's accept_hist at the last read-back (passes accepting k drafts)


class Scheduler:
  """Owns a SpecEngine; admits, steps, streams and frees requests in one thread.

  Args:
    engine: its `config.batch_size` rows are the slots; its `max_len` bounds prompt +
      max_tokens (+ the drafter's lookahead).
    channel: in a multi-host run, where each tick is published before it runs (a
      `multihost.TickChannel`: followers replay it, so every process makes the same engine
      calls and collectives); None for one process.
    max_queue: requests that may wait for a slot; `submit` raises QueueFull past it.
    steps_per_tick: engine steps per host round trip (default: the engine's stream_every);
      fewer means lower streaming latency and admission delay, more means fewer round trips.
    admission_reserve: paged K/V: the share of each running request's way to its end (its
      remaining max_tokens) whose pages admission keeps free for it (0: none, the pool is
      packed and growth preempts; 1: all, so no request is ever preempted). None: measured,
      the mean share of max_tokens finished requests used (from 1, raised halfway to 1 on
      each preemption).
  """

  def __init__(
    self,
    engine: SpecEngine,
    *,
    max_queue: int = 256,
    steps_per_tick: Optional[int] = None,
    channel: Any = None,
    admission_reserve: Optional[float] = None,
  ):
    if max_queue < 0 or (steps_per_tick is not None and steps_per_tick < 1):
      raise InputError(
        f"max_queue must be ≥ 0 and steps_per_tick ≥ 1, got {max_queue} and {steps_per_tick}"
      )
    if admission_reserve is not None and not 0.0 <= admission_reserve <= 1.0:
      raise InputError(f"admission_reserve must be in [0, 1] or None, got {admission_reserve}")
    self.engine = engine
    self._channel = channel
    self.max_queue = max_queue
    self.steps_per_tick = steps_per_tick or engine.config.stream_every
    self.slots = engine.config.batch_size
    self._waiting: collections.deque[RequestHandle] = collections.deque()
    self._active: list[Optional[_Slot]] = [None] * self.slots
    self._lock = threading.Lock()
    self._wake = threading.Condition(self._lock)
    self._state: Optional[SpecState] = None
    self._thread: Optional[threading.Thread] = None
    self._closing = False
    self._drain = True
    self.failure: Optional[str] = None  # set if the scheduler thread died of a bug
    self._counters = collections.Counter()
    self._step_seconds = 0.0
    cfg = engine.config
    # Paged K/V: rows hold pages, not max_len slots; admission and growth go by free pages.
    self._pages = None
    if cfg.page_size:
      self._pages = PageAllocator(
        cfg.num_pages, cfg.page_size, self.slots, cfg.pages_per_row, cfg.prefix_cache
      )
    self._admissions = itertools.count()
    # The share of a request's remaining max_tokens kept in reserve at admission.
    self._measure_reserve = admission_reserve is None
    self.reserve_ratio = 1.0 if admission_reserve is None else float(admission_reserve)
    # Which speculation budget and row bucket each tick runs (serve/speculation.py).
    # Chains: a shorter budget checks the first drafts of the same chain, so acceptance per
    # draft position predicts every budget (trees with fewer nodes: each is measured).
    self._policy = SpeculationPolicy(
      engine.budgets, engine.row_buckets, depth_model=engine.config.verify == "chain"
    )
    self._last_choice = (engine.budgets[-1], engine.row_buckets[-1])

  # -- lifecycle ------------------------------------------------------------------------------

  def start(self) -> None:
    """Compiles every program serving needs (`warm_up_slots`), then starts the thread."""
    if self._thread is not None:
      raise SchedulerClosed("the scheduler was started already")
    self._state = self.engine.warm_up_slots()
    if len(self.engine.budgets) > 1 and self._channel is None:
      # Step costs of every (budget, bucket) program on this machine; a multi-host leader
      # learns them from its ticks instead (followers replay only ticks).
      self._state, costs = self.engine.measure_step_costs(self._state, self.steps_per_tick)
      self._policy.costs.update(costs)
    # One tick of no request compiles the read-back of this tick size (followers replay it).
    warm = Tick([], [], self.steps_per_tick)
    if self._channel is not None:
      self._channel.publish(warm)
    self._state, host = apply_tick(self.engine, self._state, warm)
    self._deliver_tokens(host)
    self._thread = threading.Thread(target=self._run, name="jaxspec-scheduler", daemon=True)
    self._thread.start()

  def shutdown(self, drain: bool = True, timeout: Optional[float] = None) -> None:
    """Stops admitting new requests; with `drain` finishes the running and queued ones, else
    cancels them. Returns when the thread has stopped (or after `timeout` seconds)."""
    with self._lock:
      self._closing = True
      self._drain = drain
      self._wake.notify_all()
    if self._thread is not None:
      self._thread.join(timeout)

  @property
  def running(self) -> bool:
    return self._thread is not None and self._thread.is_alive()

  # -- requests -------------------------------------------------------------------------------

  def check(self, prompt_ids: Any, options: SamplingOptions) -> None:
    """Raises InputError naming what is wrong with a request (bad values, ids outside the
    vocabulary, prompt + max_tokens over the engine's capacity, too many stop ids)."""
    if not isinstance(options, SamplingOptions):
      raise InputError(f"options must be SamplingOptions, got {type(options).__name__}")
    seed = options.seed if options.seed is not None else 0
    self.engine.check_row(list(prompt_ids), options.sampling_args(seed))
    most = self.engine.config.top_logprobs
    if not (isinstance(options.top_logprobs, int) and 0 <= options.top_logprobs <= most):
      raise InputError(
        f"top_logprobs={options.top_logprobs}: this server keeps at most {most} alternatives "
        "per token (EngineConfig.top_logprobs, launch/serve.py --top_logprobs)"
      )

  def submit(self, prompt_ids: Any, options: SamplingOptions) -> RequestHandle:
    """Queues a request (FIFO) after `check`; returns its handle at once. Call it from the
    event loop that will iterate the handle (or from a thread without one)."""
    return self.submit_many([(prompt_ids, options)])[0]

  def submit_many(self, requests: Sequence[tuple[Any, SamplingOptions]]) -> list[RequestHandle]:
    """Queues several (prompt ids, options) requests at once, in order: the scheduler sees
    them all at its next tick (a batch job's requests are admitted together, not as they
    trickle in). All are checked first; none is queued if one is refused."""
    handles = []
    for prompt_ids, options in requests:
      self.check(prompt_ids, options)
      handles.append(RequestHandle(self, [int(t) for t in prompt_ids], options))
    with self._lock:
      if self._closing or self.failure is not None or not self.running:
        raise SchedulerClosed(self.failure or "the scheduler is not running")
      if len(self._waiting) + len(handles) > self.max_queue:
        raise QueueFull(f"{len(self._waiting)} requests are waiting (max_queue={self.max_queue})")
      self._waiting.extend(handles)
      self._counters["requests_total"] += len(handles)
      self._wake.notify_all()
    return handles

  def submit_n(self, prompt_ids: Any, options: SamplingOptions, n: int) -> list[RequestHandle]:
    """Queues one prompt sampled n times (OpenAI's `n`): n handles, choice i with seed
    `choice_seed(seed, i)` (a fresh random seed when options.seed is None). The choices are
    admitted together and the prompt is prefilled once (`SpecEngine.prefill_rows`); with paged
    K/V they share its full pages. Each handle is then a request of its own (streamed,
    cancelled, preempted alone)."""
    if not (isinstance(n, int) and 1 <= n <= self.slots):
      raise InputError(f"n={n}: this server samples 1 to {self.slots} choices (its slots)")
    if n == 1:
      return [self.submit(prompt_ids, options)]
    self.check(prompt_ids, options)
    ids = [int(t) for t in prompt_ids]
    base = options.seed if options.seed is not None else secrets.randbits(63)
    handles = [
      RequestHandle(self, ids, dataclasses.replace(options, seed=choice_seed(base, i)))
      for i in range(n)
    ]
    if self._pages is not None and self._first_pages(handles)[2] > self._pages.num_pages:
      raise InputError(f"n={n}: the choices' first pages do not fit the KV pool")
    for h in handles:
      h.group = handles
    with self._lock:
      if self._closing or self.failure is not None or not self.running:
        raise SchedulerClosed(self.failure or "the scheduler is not running")
      if len(self._waiting) >= self.max_queue:
        raise QueueFull(f"{len(self._waiting)} requests are waiting (max_queue={self.max_queue})")
      self._waiting.append(handles[0])  # the group's place in the queue
      self._counters["requests_total"] += n
      self._wake.notify_all()
    return handles

  def _first_pages(self, handles: list[RequestHandle]) -> tuple[int, int, int, list[int]]:
    """What admitting a group (one request, or n choices of one prompt) takes: (the positions
    each row reaches by its first read-back, the prompt's full pages the other choices share
    with the first, the free pages it takes in all, the cached pages its prompt starts with).
    A cached page no row holds counts as free, so holding it takes one."""
    prompt = handles[0].row_prompt()
    reach = self._reach(len(prompt) + 1, handles[0])
    pages = self._pages.pages_for(reach)
    shared = min(len(prompt) // self._pages.page_size, pages)
    hits = self._pages.lookup(prompt)
    taken = pages - len(hits) + sum(self._pages.idle(p) for p in hits)
    return reach, shared, taken + (len(handles) - 1) * (pages - shared), hits

  def metrics(self) -> dict[str, float]:
    """Counters and gauges for /metrics."""
    with self._lock:
      running = sum(s is not None for s in self._active)
      c = dict(self._counters)
      waiting = len(self._waiting)
    passes = c.get("target_passes_total", 0)
    return {
      "requests_total": c.get("requests_total", 0),
      "requests_finished_total": c.get("requests_finished_total", 0),
      "requests_cancelled_total": c.get("requests_cancelled_total", 0),
      "requests_running": running,
      "requests_waiting": waiting,
      "tokens_generated_total": c.get("tokens_generated_total", 0),
      "target_passes_total": passes,
      "acceptance_length": c.get("tokens_committed_total", 0) / passes if passes else 0.0,
      "steps_total": c.get("steps_total", 0),
      "step_seconds_avg": self._step_seconds / max(c.get("steps_total", 0), 1),
      "batch_occupancy": running / self.slots,
      "slots": self.slots,
      "preemptions_total": c.get("preemptions_total", 0),
      "admission_reserve": self.reserve_ratio if self._pages else 0.0,
      "prompt_tokens_prefilled_total": c.get("prompt_tokens_prefilled_total", 0),
      "kv_pages": self._pages.num_pages if self._pages else 0,
      "kv_pages_used": self._pages.used if self._pages else 0,
      "prefix_cache_hit_tokens_total": c.get("prefix_cache_hit_tokens_total", 0),
      "prefix_cache_pages": self._pages.cached if self._pages else 0,
      "prefix_cache_evictions_total": self._pages.evictions if self._pages else 0,
      "speculation_budget": self._last_choice[0],
      "row_bucket": self._last_choice[1],
    }

  # -- the scheduler thread -------------------------------------------------------------------

  def _wake_up(self) -> None:
    with self._lock:
      self._wake.notify_all()

  def _run(self) -> None:
    try:
      while self._tick():
        pass
      self._stop_followers()
    except Exception as e:  # pylint: disable=broad-except  # a bug: fail every request loudly
      self.failure = f"scheduler stopped: {type(e).__name__}: {e}"
      with self._lock:
        victims = list(self._waiting) + [s.handle for s in self._active if s is not None]
        self._waiting.clear()
        self._active = [None] * self.slots
      for h in victims:
        h._deliver(Delta([], None, "error", self.failure))  # pylint: disable=protected-access
      self._stop_followers()
      raise

  def _stop_followers(self) -> None:
    if self._channel is not None:
      self._channel.publish(Tick([], [], 0, stop=True))

  def _tick(self) -> bool:
    """One round: admit, evict, step, deliver. Returns False when the thread should stop."""
    with self._lock:
      while not self._closing and not self._waiting and all(s is None for s in self._active):
        self._wake.wait()
      if self._closing and not self._drain:
        victims = list(self._waiting)
        self._waiting.clear()
        for s in self._active:
          if s is not None:
            s.handle.cancel()
      else:
        victims = []
    for h in victims:
      self._finish_waiting(h)
    cancelled = [i for i, s in enumerate(self._active) if s is not None and s.handle.cancelled]
    preempted = self._grow(cancelled)
    admitted = self._admit(set(cancelled + preempted))
    live = [
      i
      for i, s in enumerate(self._active)
      if s is not None and i not in cancelled and i not in preempted
    ]
    if not (admitted or live or cancelled or preempted):
      return not self._closing

    rows = self._seat(admitted)
    steps = self.steps_per_tick if (rows or live) else 0
    if not (rows or cancelled or preempted or steps):
      return True  # every admitted request was cancelled while it waited
    pages = None if self._pages is None else self._pages.table().tolist()
    running = list(live)  # the rows this tick steps: the running ones and the admitted ones
    for entry in rows:
      running += entry[0] if isinstance(entry[0], list) else [entry[0]]
    budget, bucket = self._policy.choose(len(running)) if steps else self._last_choice
    partial = bucket < self.slots
    tick = Tick(
      rows,
      cancelled + preempted,
      steps,
      pages=pages,
      budget=budget,
      live=sorted(set(running)) if partial else None,
    )
    if self._channel is not None:  # the followers replay it (jaxspec/serve/multihost.py)
      self._channel.publish(tick)
    self._state = admit_tick(self.engine, self._state, tick)  # as apply_tick, timing the steps
    t0 = time.perf_counter()
    self._state, host = run_tick(self.engine, self._state, tick.steps, tick.budget, tick.live)
    for i in cancelled:
      self._release(i, Delta([], None, "cancelled"))
    self._requeue(preempted)
    if host is not None:
      passes, committed, ran, accepted = self._deliver_tokens(host)
      seconds = time.perf_counter() - t0
      self._policy.observe(budget, bucket, ran, seconds, passes, committed, accepted)
      self._last_choice = (budget, bucket)
      self._step_seconds += seconds
      self._counters["ticks_total"] += 1
      self._counters["steps_total"] += tick.steps
    return True

  def _seat(self, admitted: list[tuple[list[int], list[RequestHandle], list[int]]]) -> list[list]:
    """Admitted groups into their slots (`_admit`'s answer); those cancelled while they waited
    give their pages back. Returns the tick's rows to prefill: [slot, prompt, sampling
    arguments, cached pages], or [slots, prompt, [arguments per choice], cached pages] for n
    choices of one prompt."""
    rows = []
    for slots, members, hits in admitted:
      if all(h.cancelled for h in members):
        for slot, handle in zip(slots, members):
          self._finish_waiting(handle)
          if self._pages is not None:
            self._pages.release(slot)
        continue
      prompt = members[0].row_prompt()
      arguments = [h.row_arguments().to_json() for h in members]
      if len(members) == 1:
        rows.append([slots[0], prompt, arguments[0], hits])
      else:  # one prefill for every choice (a cancelled one is evicted next tick)
        rows.append([slots, prompt, arguments, hits])
      order = next(self._admissions)
      cached = 0
      if self._pages is not None:  # its full prompt pages serve later prompts (prefix_cache)
        self._pages.register(slots[0], prompt)
        cached = len(hits) * self._pages.page_size
      with self._lock:
        self._counters["prompt_tokens_prefilled_total"] += len(prompt) - cached
        self._counters["prefix_cache_hit_tokens_total"] += cached
        for slot, handle in zip(slots, members):
          self._active[slot] = _Slot(handle, 0, len(prompt), len(prompt) + 1, order)
    return rows

  def _reach(self, seq_len: int, handle: RequestHandle) -> int:
    """The positions a row of length `seq_len` may write before the next read-back: a tick's
    commits and one verify block past them, never past the request's own end (its prompt,
    max_tokens and the drafter's lookahead, however often it was preempted)."""
    verifier = self.engine.verifier
    ahead = seq_len + self.steps_per_tick * verifier.max_commit + verifier.width
    return min(ahead, self._end(handle))

  def _end(self, handle: RequestHandle) -> int:
    """The most positions a request's row may write: its prompt, max_tokens and the
    drafter's lookahead (however often it was preempted), within max_len."""
    end = len(handle.prompt_ids) + handle.options.max_tokens + self.engine.lookahead + 1
    return min(end, self.engine.config.max_len)

  def _kept(self, seq_len: int, handle: RequestHandle) -> int:
    """The positions admission keeps pages for, for a row of length `seq_len`:
    `reserve_ratio` of its way to its end."""
    end = self._end(handle)
    return min(end, seq_len + int(np.ceil(self.reserve_ratio * max(end - seq_len, 0))))

  def _grow(self, cancelled: list[int]) -> list[int]:
    """Paged K/V: frees the pages of cancelled rows and gives every other row the pages its
    next tick may reach, oldest row first; where the pool runs out, preempts the newest rows
    (frees their pages; they resume later from what they delivered). Returns the preempted."""
    if self._pages is None:
      return []
    for i in cancelled:
      self._pages.release(i)
    running = sorted(
      (s.admitted, i) for i, s in enumerate(self._active) if s is not None and i not in cancelled
    )
    preempted: list[int] = []
    while running:
      _, slot = running.pop(0)  # the oldest not yet grown
      s = self._active[slot]
      while not self._pages.grow(slot, self._reach(s.seq_len, s.handle)):
        # The newest row gives way; if that is this one, older rows hold the pool (the oldest
        # always fits: a request needs at most a row of pages, and the pool holds one).
        newest = running.pop()[1] if running else slot
        self._pages.release(newest)
        preempted.append(newest)
        if newest == slot:
          break
    return preempted

  def _admit(self, leaving: set[int]) -> list[tuple[list[int], list[RequestHandle], list[int]]]:
    """Waiting requests into free rows, first come first served: while a row is free and (paged
    K/V) the pool has the pages its prompt and first tick reach, beside the reserve kept for
    the running rows (not those `leaving` this tick) and for the ones admitted before it
    (`_kept`). Returns (slots, requests, the cached pages their prompt starts with) per
    admitted group."""
    admitted = []
    # Pages kept free for the running rows (`_kept`), so that admitting does not make them
    # preempt one another later (reserve_ratio 1: never).
    reserve = 0
    if self._pages is not None:
      for i, s in enumerate(self._active):
        if s is not None and i not in leaving:
          reserve += self._pages.shortfall(i, self._kept(s.seq_len, s.handle))
    with self._lock:
      free = [i for i, s in enumerate(self._active) if s is None]
      while free and self._waiting:
        members = self._waiting[0].group or [self._waiting[0]]
        if len(members) > len(free):
          break
        slots = free[: len(members)]
        if self._pages is not None:
          busy = admitted or any(
            s is not None and i not in leaving for i, s in enumerate(self._active)
          )
          first = self._first_pages(members)
          # Pages its rows will want past their first tick, kept from later admissions.
          later = len(members) * max(
            self._pages.pages_for(self._kept(len(members[0].row_prompt()) + 1, members[0]))
            - self._pages.pages_for(first[0]),
            0,
          )
          if first[2] + (reserve + later if busy else 0) > self._pages.free:
            break
          hits = self._take_pages(slots, first)
          reserve += later
        else:
          hits = []
        del free[: len(members)]
        self._waiting.popleft()
        admitted.append((slots, members, hits))
        for h in members:
          h.group = None  # from here on, a request of its own
    return admitted

  def _take_pages(self, slots: list[int], first: tuple[int, int, int, list[int]]) -> list[int]:
    """The first tick's pages of newly admitted rows, which the pool has (`_admit` checked):
    the first row holds the cached pages its prompt starts with, the other choices of a group
    share the first one's full prompt pages (`first`: their `_first_pages`). Returns the cached
    pages."""
    reach, shared, _, hits = first
    self._pages.attach(slots[0], hits)
    for i, slot in enumerate(slots):
      if i:
        self._pages.share(slot, slots[0], shared)
      grown = self._pages.grow(slot, reach)
      assert grown, "the caller checked the pool's free pages"
    return hits

  def _requeue(self, preempted: list[int]) -> None:
    """Preempted requests back at the head of the queue (the newest last), rows freed. A
    measured admission reserve was too small: it goes halfway to 1."""
    if preempted and self._measure_reserve:
      self.reserve_ratio = (1.0 + self.reserve_ratio) / 2
    with self._lock:
      for slot in sorted(preempted, key=lambda i: self._active[i].admitted, reverse=True):
        handle = self._active[slot].handle
        handle.preemptions += 1
        self._active[slot] = None
        self._waiting.appendleft(handle)
        self._counters["preemptions_total"] += 1

  def _finish_waiting(self, handle: RequestHandle) -> None:
    handle._deliver(Delta([], None, "cancelled"))  # pylint: disable=protected-access
    with self._lock:
      self._counters["requests_cancelled_total"] += 1

  def _release(self, slot: int, last: Delta) -> None:
    s = self._active[slot]
    if self._pages is not None:
      self._pages.release(slot)
      if self._measure_reserve and last.finish_reason in ("stop", "length"):
        # The share of its max_tokens it used: a running mean over about 8 requests.
        used = len(s.handle.generated) / max(s.handle.options.max_tokens, 1)
        self.reserve_ratio += (min(used, 1.0) - self.reserve_ratio) / 8
    s.handle._deliver(last)  # pylint: disable=protected-access
    with self._lock:
      self._active[slot] = None
      cancelled = last.finish_reason == "cancelled"
      self._counters["requests_cancelled_total" if cancelled else "requests_finished_total"] += 1

  def _deliver_tokens(self, host: dict[str, np.ndarray]) -> tuple[int, int, int, np.ndarray]:
    """Hands each live request the new tokens of its row in `host` (`read_back`: the last
    `window` slots of every row, which hold every token not delivered yet). Returns the
    rows' target passes and committed tokens since the last read-back, the most passes one
    row ran (the steps the tick ran), and their passes by drafts accepted [γ + 1]."""
    tick_passes = tick_committed = most = 0
    tick_accepted = np.zeros(host["accept_hist"].shape[1], np.int64)
    seq_len, done, stopped = host["seq_len"], host["done"], host["stopped"]
    tokens, logprobs = host["tokens"], host["logprobs"]
    passes, committed = host["target_passes"], host["tokens_committed"]
    window = tokens.shape[1]
    for i, s in enumerate(self._active):
      if s is None:
        continue
      first = int(seq_len[i]) - window  # the slot the window starts at
      start = s.base + s.sent - first
      s.seq_len = int(seq_len[i])
      held = len(self._pages.pages(i)) * self._pages.page_size if self._pages else None
      if held is not None and s.seq_len - 1 > held:
        raise RuntimeError(f"row {i} committed positions its pages do not hold (a page-growth bug)")
      if start < 0:
        raise RuntimeError(f"row {i} committed more than the read-back window ({window})")
      new = tokens[i, start:].tolist()
      lps = logprobs[i, start:].tolist() if s.handle.options.logprobs else None
      top = None
      k = s.handle.options.top_logprobs
      if k:
        ids, values = host["top_ids"][i, start:, :k], host["top_logprobs"][i, start:, :k]
        top = [list(zip(a.tolist(), b.tolist())) for a, b in zip(ids, values)]
      s.sent += len(new)
      s.handle.generated += new
      ran, made = int(passes[i]) - s.passes, int(committed[i]) - s.committed
      tick_passes, tick_committed, most = tick_passes + ran, tick_committed + made, max(most, ran)
      with self._lock:
        self._counters["target_passes_total"] += ran
        self._counters["tokens_committed_total"] += made
      s.passes, s.committed = int(passes[i]), int(committed[i])
      tick_accepted += host["accept_hist"][i] - s.accepted
      s.accepted = host["accept_hist"][i].copy()
      reason = None
      if done[i]:
        # Done on a stop token (the last one committed; it is not handed out) or its budget.
        reason = "stop" if stopped[i] else "length"
        if stopped[i] and new:
          new, lps = new[:-1], (lps[:-1] if lps is not None else None)
          top = top[:-1] if top is not None else None
      with self._lock:
        self._counters["tokens_generated_total"] += len(new)
      if reason is not None:
        self._release(i, Delta(new, lps, reason, top_logprobs=top))
      elif new:
        s.handle._deliver(Delta(new, lps, top_logprobs=top))  # pylint: disable=protected-access
    return tick_passes, tick_committed, most, tick_accepted
