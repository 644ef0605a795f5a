"""A stand-in for jaxspec.serve.scheduler.Scheduler with deterministic outputs (HTTP tests).

Greedy requests emit a text chosen by the prompt; sampled ones, one chosen by the seed. Tokens
come a few per tick from the event loop, so streams interleave as they do with the real one.
"""

from __future__ import annotations

import asyncio
import hashlib
import random
import types

from jaxspec.errors import InputError
from jaxspec.io.tokenizer import Tokenizer
from jaxspec.serve.scheduler import Delta, QueueFull, SamplingOptions

WORDS = ("alpha", "beta", "gamma", "delta", "état", "€uro", "x = 1\n", "def f():", "STOP")


class FakeHandle:
  def __init__(self, sched: FakeScheduler, rid: str, ids: list[int], options: SamplingOptions):
    self.id, self.prompt_tokens, self._s, self._opt = rid, len(ids), sched, options
    key = str(ids) if options.temperature == 0 else f"seed{options.seed}"
    rng = random.Random(hashlib.sha256(key.encode()).hexdigest())
    words = " ".join(rng.choice(WORDS) for _ in range(options.max_tokens + 8))
    self._tokens = sched.engine.target.tokenizer.encode(words)
    self._cancelled = False

  def cancel(self) -> None:
    self._cancelled = True

  def __aiter__(self):
    return self._run()

  async def _run(self):
    s, opt = self._s, self._opt
    s.waiting += 1
    while s.running >= s.slots and not self._cancelled:
      await asyncio.sleep(s.tick)
    s.waiting -= 1
    s.running += 1
    s.requests_total += 1
    try:
      n = 0
      while True:
        await asyncio.sleep(s.tick)
        if self._cancelled:
          yield Delta([], [] if opt.logprobs else None, "cancelled")
          return
        out, finish = [], None
        for tok in self._tokens[n : n + 3]:
          if tok in opt.stop_token_ids:
            finish = "stop"
            break
          out.append(tok)
          if n + len(out) == opt.max_tokens:
            finish = "length"
            break
        n += len(out)
        s.tokens_generated_total += len(out)
        yield Delta(out, [-0.5] * len(out) if opt.logprobs else None, finish)
        if finish:
          return
    finally:
      s.running -= 1


class FakeScheduler:
  """The scheduler interface the HTTP layer uses, without an engine."""

  def __init__(self, slots: int = 4, max_len: int = 256, max_queue: int = 64, tick: float = 0.002):
    tokenizer = Tokenizer.bundled()
    self.engine = types.SimpleNamespace(
      target=types.SimpleNamespace(tokenizer=tokenizer),
      config=types.SimpleNamespace(max_len=max_len, batch_size=slots),
    )
    self.slots, self.max_queue, self.tick = slots, max_queue, tick
    self.running = self.waiting = self.requests_total = self.tokens_generated_total = 0
    self._next = 0

  def check(self, prompt_ids: list[int], options: SamplingOptions) -> None:
    vocab = self.engine.target.tokenizer.vocab_size
    if any(not 0 <= i < vocab for i in prompt_ids):
      raise InputError(f"prompt token ids outside the vocabulary [0, {vocab})")
    if len(prompt_ids) + options.max_tokens > self.engine.config.max_len:
      raise InputError(
        f"prompt ({len(prompt_ids)} tokens) + max_tokens ({options.max_tokens}) is over the "
        f"engine's capacity ({self.engine.config.max_len})"
      )

  def submit(self, prompt_ids: list[int], options: SamplingOptions) -> FakeHandle:
    self.check(prompt_ids, options)
    if self.waiting >= self.max_queue:
      raise QueueFull(f"{self.waiting} requests waiting")
    self._next += 1
    return FakeHandle(self, f"req-{self._next}", prompt_ids, options)

  def metrics(self) -> dict[str, float]:
    return {
      "requests_total": self.requests_total,
      "requests_running": self.running,
      "requests_waiting": self.waiting,
      "tokens_generated_total": self.tokens_generated_total,
      "batch_occupancy": self.running / self.slots,
      "slots": self.slots,
    }
