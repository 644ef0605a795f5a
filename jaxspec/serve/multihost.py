"""Serving from several processes (hosts): the leader's scheduler ticks, replayed by followers.

The engine on a mesh that spans processes is SPMD: every process must make the same engine
calls (prefill_row, insert, evict, run and the read-back gathers) in the same order, or the
collectives inside them never meet. So process 0, the leader, serves HTTP and owns the
`Scheduler`; before each tick runs, the scheduler publishes it (`ticks.Tick`: the admitted
requests' slots, token ids and sampling arguments, the evicted slots, the steps to run) on a
`TickChannel`, and every follower `follow`s: it reads the ticks in order and replays them with
the same `ticks.apply_tick` (the first, published by `Scheduler.start`, admits nothing and
compiles the read-back). A stop tick, published when the scheduler thread ends, lets the
followers return.

The channel is the coordinator's key-value store (`distributed.kv_client`), not a broadcast:
a tick is a short JSON string under key `<prefix>/<n>`, so its size varies freely (no padded
shape, nothing to compile) and a follower waiting through an idle spell polls the store from
the host rather than sitting in a device collective with its timeouts. Keys are deleted once
every follower has provably read them: those up to a tick that ran steps, once its read-back
gather (which no follower joins before reading it) has returned on the leader.
"""

from __future__ import annotations

import time
from typing import Any

from jaxspec import distributed
from jaxspec.serve.ticks import Tick, apply_tick
from jaxspec.speculative.engine import SpecEngine

PREFIX = "jaxspec/serve/tick"
POLL_MS = 1000  # a follower's wait per blocking read; it reads again while the leader idles


class TickChannel:
  """The leader's ticks to the followers, in order, through the coordinator's store."""

  def __init__(self, client: Any = None, prefix: str = PREFIX):
    self._client = client if client is not None else distributed.kv_client()
    self._prefix = prefix
    self._next = 0  # the next tick's number (published or read)
    self._kept: list[int] = []  # published ticks whose keys are not deleted yet
    self._gathered = -1  # the last published tick that ran steps, so ends in a gather

  def publish(self, tick: Tick) -> None:
    """Leader: stores `tick` under the next number. Deletes the ticks up to the last one that
    ran steps: the leader publishes only after that tick's read-back gather, which every
    follower joins only once it has read it (and all before it)."""
    read = [n for n in self._kept if n <= self._gathered]
    for n in read:
      self._client.key_value_delete(f"{self._prefix}/{n}")
    self._kept = [n for n in self._kept if n > self._gathered]
    self._client.key_value_set(f"{self._prefix}/{self._next}", tick.to_json())
    self._kept.append(self._next)
    if tick.steps:
      self._gathered = self._next
    self._next += 1

  def receive(self, timeout_s: float | None = None) -> Tick:
    """Follower: the next tick, waiting for it (forever, or TimeoutError after `timeout_s`)."""
    key = f"{self._prefix}/{self._next}"
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while True:
      try:
        text = self._client.blocking_key_value_get(key, POLL_MS)
        break
      except Exception as e:  # pylint: disable=broad-except  # XlaRuntimeError
        if "DEADLINE_EXCEEDED" not in str(e) and "timed out" not in str(e).lower():
          raise  # the coordinator is gone (the leader died) or another failure
        if deadline is not None and time.monotonic() > deadline:
          raise TimeoutError(f"no tick {self._next} from the leader in {timeout_s} s") from None
    self._next += 1
    return Tick.from_json(text)


def follow(engine: SpecEngine, channel: TickChannel | None = None) -> int:
  """A follower's serving loop: compiles what the leader's `Scheduler.start` compiles, then
  replays every tick until the leader's stop tick. Returns the number of ticks replayed."""
  channel = channel or TickChannel()
  state = engine.warm_up_slots()  # the leader's Scheduler.start runs the same calls
  replayed = 0
  while True:
    tick = channel.receive()
    if tick.stop:
      return replayed
    state, _ = apply_tick(engine, state, tick)
    replayed += 1


__all__ = ["POLL_MS", "PREFIX", "TickChannel", "follow"]
