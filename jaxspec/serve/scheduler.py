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

Results reach callers through a `RequestHandle` (serve/handles.py): iterate it (`async for` on
the event loop that submitted it, or plain `for` from a thread without one) to get Deltas until
one carries a `finish_reason`; `cancel()` from any thread frees the slot at the next tick. Each
tick is a `Tick` (serve/ticks.py), which followers replay in a multi-host run; which requests
the K/V memory can hold, and which give way, is the admission policy's (serve/admission.py).
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import secrets
import threading
import time
import traceback
from typing import Any, Optional, Sequence

import numpy as np

from jaxspec.errors import InputError
from jaxspec.serve import admission
from jaxspec.serve.handles import (
  Delta,
  QueueFull,
  RequestHandle,
  SamplingOptions,
  SchedulerClosed,
  Slot,
  choice_seed,
)
from jaxspec.serve.speculation import SpeculationPolicy
from jaxspec.serve.ticks import Tick, admit_tick, apply_tick, run_tick
from jaxspec.speculative.engine import SpecEngine
from jaxspec.speculative.step import SpecState


class Scheduler:
  """Owns a SpecEngine; admits, steps, streams and frees requests in one thread.

  Args:
    engine: its `config.batch_size` rows are the slots; its `max_len` bounds prompt +
      max_tokens (+ the drafter's lookahead).
    channel: in a multi-host run, where each tick is published before it runs (a
      `multihost.TickChannel`: followers replay it, so every process makes the same engine
      calls and collectives); None for one process. A channel's `watch(scheduler)`, if it has
      one, is called once the thread runs (TickChannel's watches the other processes'
      heartbeats), and its `lost(reason)` on a failed tick: either ends every request
      (`abort`) and the process, as the processes cannot go on together.
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
    self._active: list[Optional[Slot]] = [None] * self.slots
    self._lock = threading.Lock()
    self._wake = threading.Condition(self._lock)
    self._state: Optional[SpecState] = None
    self._thread: Optional[threading.Thread] = None
    self._closing = False
    self._drain = True
    self._aborted = False  # `abort`: every request ended, no stop tick for the followers
    self.failure: Optional[str] = None  # set if the scheduler thread died of a bug, or `abort`
    self._counters = collections.Counter()
    self._step_seconds = 0.0
    # Paged K/V: rows hold pages, not max_len slots; admission and growth go by free pages
    # (serve/admission.py; contiguous K/V: a free row is all a request needs).
    self._admission = admission.make(engine, self.steps_per_tick, admission_reserve)
    self._admissions = itertools.count()
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
    watch = getattr(self._channel, "watch", None)
    if watch is not None:  # multi-host: a lost process fails every request and ends this one
      watch(self)

  def shutdown(self, drain: bool = True, timeout: Optional[float] = None) -> None:
    """Stops admitting new requests; with `drain` finishes the running and queued ones, else
    cancels them. Returns when the thread has stopped (or after `timeout` seconds)."""
    with self._lock:
      self._closing = True
      self._drain = drain
      self._wake.notify_all()
    if self._thread is not None:
      self._thread.join(timeout)

  def abort(self, reason: str) -> list[RequestHandle]:
    """Ends every queued and running request now, from any thread, with finish_reason
    "cancelled" and `reason` as its error (a client still waiting gets 503, a stream an error
    event), and refuses new ones (SchedulerClosed). Waits for nothing: a multi-host leader
    whose group is lost calls it while its scheduler thread may sit in a collective that never
    returns (serve/multihost.py); it then ends the process. Returns the requests it ended."""
    with self._lock:
      self.failure = reason
      self._aborted = True
      self._closing, self._drain = True, False
      victims = self._take_all()
      self._counters["requests_cancelled_total"] += len(victims)
    for h in victims:
      h._deliver(Delta([], None, "cancelled", reason))  # pylint: disable=protected-access
    return victims

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
    self._admission.check_group(handles)
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

  def metrics(self) -> dict[str, float]:
    """Counters and gauges for /metrics."""
    with self._lock:
      running = sum(s is not None for s in self._active)
      c = dict(self._counters)
      waiting = len(self._waiting)
    passes = c.get("target_passes_total", 0)
    pool = self._admission.metrics()
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
      "admission_reserve": pool["admission_reserve"],
      "prompt_tokens_prefilled_total": c.get("prompt_tokens_prefilled_total", 0),
      "kv_pages": pool["kv_pages"],
      "kv_pages_used": pool["kv_pages_used"],
      "prefix_cache_hit_tokens_total": c.get("prefix_cache_hit_tokens_total", 0),
      "prefix_cache_pages": pool["prefix_cache_pages"],
      "prefix_cache_evictions_total": pool["prefix_cache_evictions_total"],
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
      self.failure = self.failure or f"scheduler stopped: {type(e).__name__}: {e}"
      lost = getattr(self._channel, "lost", None)
      if lost is not None:
        # Multi-host: the processes' engine calls no longer match (a peer died mid-collective,
        # or a bug): the channel ends every request (`abort`) and the process.
        traceback.print_exc()
        lost(self.failure)
        return
      with self._lock:
        victims = self._take_all()
      for h in victims:
        h._deliver(Delta([], None, "error", self.failure))  # pylint: disable=protected-access
      self._stop_followers()
      raise

  def _take_all(self) -> list[RequestHandle]:
    """Every queued (each choice of a queued group) and running request, taken out of the
    queue and the rows. Call it holding the lock."""
    victims = [m for h in self._waiting for m in (h.group or [h])]
    victims += [s.handle for s in self._active if s is not None]
    self._waiting.clear()
    self._active = [None] * self.slots
    return victims

  def _stop_followers(self) -> None:
    if self._channel is not None and not self._aborted:
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
    preempted = self._admission.grow(self._active, cancelled)
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
    pages = self._admission.page_table()
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
          self._admission.release(slot)
        continue
      prompt = members[0].row_prompt()
      arguments = [h.row_arguments().to_json() for h in members]
      if len(members) == 1:
        rows.append([slots[0], prompt, arguments[0], hits])
      else:  # one prefill for every choice (a cancelled one is evicted next tick)
        rows.append([slots, prompt, arguments, hits])
      order = next(self._admissions)
      cached = self._admission.seated(slots[0], prompt, hits)  # prompt tokens from the cache
      with self._lock:
        self._counters["prompt_tokens_prefilled_total"] += len(prompt) - cached
        self._counters["prefix_cache_hit_tokens_total"] += cached
        for slot, handle in zip(slots, members):
          self._active[slot] = Slot(handle, 0, len(prompt), len(prompt) + 1, order)
    return rows

  def _admit(self, leaving: set[int]) -> list[tuple[list[int], list[RequestHandle], list[int]]]:
    """Waiting requests into free rows, first come first served: while a row is free and the
    admission policy has room for it (paged K/V: the pool has the pages its prompt and first
    tick reach, beside the reserve kept for the running rows, not those `leaving` this tick,
    and for the ones admitted before it). Returns (slots, requests, the cached pages their
    prompt starts with) per admitted group."""
    admitted = []
    reserve = self._admission.reserve(self._active, leaving)
    with self._lock:
      free = [i for i, s in enumerate(self._active) if s is None]
      while free and self._waiting:
        members = self._waiting[0].group or [self._waiting[0]]
        if len(members) > len(free):
          break
        slots = free[: len(members)]
        busy = bool(admitted) or any(
          s is not None and i not in leaving for i, s in enumerate(self._active)
        )
        taken = self._admission.take(slots, members, reserve, busy)
        if taken is None:
          break
        hits, later = taken
        reserve += later
        del free[: len(members)]
        self._waiting.popleft()
        admitted.append((slots, members, hits))
        for h in members:
          h.group = None  # from here on, a request of its own
    return admitted

  def _requeue(self, preempted: list[int]) -> None:
    """Preempted requests back at the head of the queue (the newest last), rows freed."""
    if preempted:
      self._admission.preempted()
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
    self._admission.finished(slot, s.handle, last.finish_reason)
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
      held = self._admission.held(i)
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
