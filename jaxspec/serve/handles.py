"""What a scheduler hands out and keeps per request: options, handles, deltas, seeds, errors.

A request's `SamplingOptions` are checked by `Scheduler.check`; `Scheduler.submit` returns its
`RequestHandle`, which yields `Delta`s (iterate it with `async for` on the event loop that
submitted it, or plain `for` from a thread without one) until one carries a `finish_reason`;
`cancel()` from any thread frees its row at the next tick. A row that holds a request is a
`Slot`. Seeds: a request's random stream depends on its seed only (`choice_seed` for the n
choices of one prompt, `derived_seed` for the streams derived from one).
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import itertools
import queue
import secrets
import threading
import time
from typing import Any, AsyncIterator, Iterator, Optional

from jaxspec.errors import JaxspecError
from jaxspec.speculative.request import SamplingArgs

FINISH_REASONS = ("stop", "length", "cancelled", "error")


def derived_seed(seed: int, *labels: Any) -> int:
  """A seed in [0, 2**63) determined by `seed` and `labels` (a hash: streams derived with
  different labels do not overlap)."""
  text = ":".join(map(str, (seed, *labels))).encode()
  return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little") >> 1


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
  """One submitted request: iterate it for its Deltas; `cancel()` from any thread.

  scheduler: the `Scheduler` it was submitted to (woken by `cancel`).
  """

  _ids = itertools.count()

  def __init__(self, scheduler: Any, prompt_ids: list[int], options: SamplingOptions):
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


@dataclasses.dataclass
class Slot:
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
