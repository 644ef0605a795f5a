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
the host rather than sitting in a device collective with its timeouts. A tick's key is deleted
once every follower's heartbeat (below) reports it read. (A tick's steps and read-back gather
prove nothing: with no live row the steps meet no other process, and arrays every process
holds whole are read back locally, so a leader could run ahead of a follower still compiling.)

A process that dies or hangs breaks the group for good: the others would wait in their next
collective forever. So every process beats a `Heartbeat` in the same store and watches its
peers' (the leader its followers, a follower the leader), and the group ends itself for an
orchestrator to restart: the leader, on a follower silent for `lost_after_s` or on a failed
tick (a collective whose peer died fails at once), ends every request (`Scheduler.abort`:
HTTP 503, or a stream's error event) and exits with `EXIT_LOST`; a follower exits so on a
silent leader, an unreachable store or a failed tick. JAX's own heartbeat
(`distributed.initialize`, `--heartbeat_timeout`, twice `lost_after_s` by default) aborts
whatever this misses.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterable
from typing import Any

from jaxspec import distributed
from jaxspec.serve.ticks import Tick, apply_tick
from jaxspec.speculative.engine import SpecEngine

PREFIX = "jaxspec/serve/tick"
ALIVE_PREFIX = "jaxspec/serve/alive"  # each process's heartbeat: `<ALIVE_PREFIX>/<process>`
POLL_MS = 1000  # a follower's wait per blocking read; it reads again while the leader idles
# The exit status of a process whose group is lost (sysexits' EX_TEMPFAIL: restart and retry).
EXIT_LOST = 75
GRACE_S = 2.0  # the longest a lost leader waits for its requests' 503s to be written
_SETTLE_S = 0.25  # after a reply's last Delta was taken: time for it to be written


def default_lost_after_s() -> float:
  """Half the heartbeat timeout this process joined with (`distributed.joined`), so that a
  lost peer is noticed here, where requests can still be answered, before JAX aborts."""
  config = distributed.joined()
  timeout = config.heartbeat_timeout_s if config is not None else distributed.HEARTBEAT_TIMEOUT_S
  return timeout / 2


def exit_process(code: int) -> None:
  """Ends the process now with `code`, after flushing its output: no atexit handler (JAX's
  shutdown would wait for the lost peers), whatever other threads are doing."""
  for stream in (sys.stdout, sys.stderr):
    try:
      stream.flush()
    except Exception:  # pylint: disable=broad-except  # closed: nothing left to flush
      pass
  os._exit(code)


class Heartbeat:
  """This process's heartbeat in the coordinator's store, and a watch on its peers'.

  One thread writes `<prefix>/<process>` = "<beat> <progress>" every `interval_s` (progress:
  the ticks a follower has read, or the leader has published) and reads every process's entry
  (`peers_progress`: the ticks every peer has read); another calls `on_lost(reason)` (once)
  when a watched peer whose beat it has seen has not beaten for `timeout_s` (it died, hung, or
  its host is cut off), or when the store has been unreachable that long (process 0, which
  hosts it, is gone or cut off). The watch reads only what the first thread stored, so a store
  call that hangs does not hang it. A peer that has not beaten yet is not counted silent (it
  may still be compiling); one lost before it beats fails the collectives it never joins, and
  JAX's heartbeat ends the run.

  `beat` and `check` are the two threads' rounds, callable by hand (tests).
  """

  def __init__(
    self,
    client: Any,
    process: int,
    peers: Iterable[int],
    timeout_s: float,
    on_lost: Callable[[str], None],
    *,
    interval_s: float | None = None,
    prefix: str = ALIVE_PREFIX,
    clock: Callable[[], float] = time.monotonic,
  ):
    self._client = client
    self.process = process
    self.peers = [p for p in peers if p != process]
    self.timeout_s = timeout_s
    self.interval_s = interval_s if interval_s is not None else min(1.0, timeout_s / 5)
    self._on_lost = on_lost
    self._prefix = prefix
    self._clock = clock
    self.progress = 0  # reported with each beat (the ticks read, or published)
    self.watching = True  # False: beats on, silence ignored (the group is ending normally)
    self._beats = 0
    self._lock = threading.Lock()
    self._seen: dict[int, tuple[str, float]] = {}  # peer → (its last entry, when it changed)
    self._progress: dict[int, int] = {}  # peer → the progress its last entry reported
    self._reached = clock()  # when the store last answered
    self._error = ""  # the store's last error
    self._stopped = threading.Event()
    self._threads: list[threading.Thread] = []

  def start(self) -> Heartbeat:
    """Starts beating and watching (daemon threads)."""
    for name, target in (("beat", self._beat_loop), ("watch", self._watch_loop)):
      thread = threading.Thread(target=target, name=f"jaxspec-heartbeat-{name}", daemon=True)
      thread.start()
      self._threads.append(thread)
    return self

  def stop(self) -> None:
    """Stops both threads (the last beat stays in the store)."""
    self._stopped.set()

  def beat(self) -> None:
    """One round of the beating thread: writes this process's entry, reads everyone's."""
    try:
      self._client.key_value_set(
        f"{self._prefix}/{self.process}", f"{self._beats} {self.progress}", allow_overwrite=True
      )
      entries = dict(self._client.key_value_dir_get(f"{self._prefix}/"))
    except Exception as e:  # pylint: disable=broad-except  # XlaRuntimeError: the store is gone
      with self._lock:
        self._error = _first_line(e)
      return
    self._beats += 1
    now = self._clock()
    with self._lock:
      self._reached = now
      for peer in self.peers:
        entry = entries.get(f"{self._prefix}/{peer}")
        if entry is not None and (peer not in self._seen or self._seen[peer][0] != entry):
          self._seen[peer] = (entry, now)
          fields = entry.split()
          if len(fields) == 2 and fields[1].isdigit():
            self._progress[peer] = int(fields[1])

  def peers_progress(self) -> int:
    """The least progress every peer has reported (0 until each has beaten once)."""
    with self._lock:
      return min((self._progress.get(p, 0) for p in self.peers), default=0)

  def check(self) -> str | None:
    """One round of the watch: why the group is lost, or None while every peer beats."""
    now = self._clock()
    with self._lock:
      if now - self._reached > self.timeout_s:
        return (
          f"the coordinator's store (process 0) has not answered process {self.process} for "
          f"{now - self._reached:.1f} s ({self._error or 'no reply'})"
        )
      for peer, (entry, changed) in sorted(self._seen.items()):
        if now - changed > self.timeout_s:
          beats, progress = (entry.split() + ["?", "?"])[:2]
          return (
            f"process {peer} has sent no heartbeat for {now - changed:.1f} s (it died, hung or "
            f"was cut off; its last beat, #{beats}, was at tick {progress})"
          )
    return None

  def _beat_loop(self) -> None:
    while not self._stopped.is_set():
      self.beat()
      self._stopped.wait(self.interval_s)

  def _watch_loop(self) -> None:
    while not self._stopped.wait(self.interval_s):
      reason = self.check()
      if reason is not None and self.watching and not self._stopped.is_set():
        self._stopped.set()
        self._on_lost(reason)
        return


class TickChannel:
  """The leader's ticks to the followers, in order, through the coordinator's store; and the
  heartbeats that end the group when one of its processes is lost.

  Args:
    client: the store (None: `distributed.kv_client()`).
    prefix: the ticks' keys' prefix.
    lost_after_s: how long a peer may go without a heartbeat before the group counts it lost
      (None: `default_lost_after_s`, half of `--heartbeat_timeout`).
    grace_s: the longest a lost leader waits for its requests' replies to go out.
    exit_fn: ends the process with a status (default `exit_process`; tests pass a recorder).
  """

  def __init__(
    self,
    client: Any = None,
    prefix: str = PREFIX,
    *,
    lost_after_s: float | None = None,
    grace_s: float = GRACE_S,
    exit_fn: Callable[[int], None] | None = None,
  ):
    self._client = client if client is not None else distributed.kv_client()
    self._prefix = prefix
    self._next = 0  # the next tick's number (published or read)
    self._kept: list[int] = []  # published ticks whose keys are not deleted yet
    self.lost_after_s = lost_after_s if lost_after_s is not None else default_lost_after_s()
    self.grace_s = grace_s
    self._exit = exit_fn or exit_process
    self.heartbeat: Heartbeat | None = None
    self._scheduler: Any = None
    self._lost = threading.Lock()  # held by the first `lost`: it alone acts

  def publish(self, tick: Tick) -> None:
    """Leader: stores `tick` under the next number. Deletes the ticks every follower's
    heartbeat reports read (none before the heartbeat runs, `watch`)."""
    heartbeat = self.heartbeat
    read = heartbeat.peers_progress() if heartbeat is not None else 0
    for n in [n for n in self._kept if n < read]:
      self._client.key_value_delete(f"{self._prefix}/{n}")
    self._kept = [n for n in self._kept if n >= read]
    self._client.key_value_set(f"{self._prefix}/{self._next}", tick.to_json())
    self._kept.append(self._next)
    self._next += 1
    if heartbeat is not None:
      heartbeat.progress = self._next
      if tick.stop:
        heartbeat.watching = False  # the followers stop beating as they return

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
    if self.heartbeat is not None:
      self.heartbeat.progress = self._next  # the leader may delete it now
    return Tick.from_json(text)

  def beat(
    self, peers: Iterable[int], on_lost: Callable[[str], None], process: int | None = None
  ) -> Heartbeat:
    """Starts this process's `Heartbeat` (process: None = this one's index), watching
    `peers`."""
    if process is None:
      import jax  # pylint: disable=import-outside-toplevel

      process = jax.process_index()
    self.heartbeat = Heartbeat(self._client, process, peers, self.lost_after_s, on_lost).start()
    return self.heartbeat

  def watch(self, scheduler: Any) -> None:
    """Leader (`Scheduler.start` calls it): beats, and watches every follower's heartbeat; one
    that falls silent loses the group (`lost`)."""
    import jax  # pylint: disable=import-outside-toplevel

    self._scheduler = scheduler
    self.beat(range(1, jax.process_count()), self.lost)

  def lost(self, reason: str) -> None:
    """Leader: the group cannot go on (a follower is silent, or a tick failed, say in a
    collective whose peer died): ends every request (`Scheduler.abort`: 503, or a stream's
    error event), waits until their replies are taken (at most `grace_s`), then exits with
    `EXIT_LOST`. The scheduler thread may be stuck in a collective: nothing waits for it. Only
    the first call acts."""
    self._end(reason, abort=True)

  def die(self, reason: str) -> None:
    """Follower: the group is lost (the leader is silent or gone, or a tick failed): exits
    with `EXIT_LOST` at once."""
    self._end(reason, abort=False)

  def _end(self, reason: str, abort: bool) -> None:
    """`lost` and `die`: the first call stops the heartbeat, says why, (`abort`) ends every
    request and waits for the replies, then exits with `EXIT_LOST`."""
    if not self._lost.acquire(blocking=False):
      return
    if self.heartbeat is not None:
      self.heartbeat.stop()
    message = f"the multi-host group is lost: {reason}"
    doing = "ending every request, " if abort else ""
    print(f"jaxspec: {message}; {doing}exit {EXIT_LOST}", file=sys.stderr)
    if abort:
      handles = self._scheduler.abort(message) if self._scheduler is not None else []
      _await_replies(handles, self.grace_s)
    self._exit(EXIT_LOST)


def _first_line(e: Exception) -> str:
  lines = str(e).strip().splitlines()
  return lines[0] if lines else type(e).__name__


def _await_replies(handles: list[Any], grace_s: float) -> None:
  """Returns once each handle's reader has taken its last Delta and a moment has passed for
  the reply to be written, or after `grace_s`."""

  def untaken() -> bool:
    return any(h._queue.qsize() for h in handles)  # pylint: disable=protected-access

  deadline = time.monotonic() + grace_s
  time.sleep(min(0.1, grace_s))  # the Deltas reach their event loops' queues
  while time.monotonic() < deadline and untaken():
    time.sleep(0.02)
  time.sleep(max(0.0, min(_SETTLE_S, deadline - time.monotonic())))


def follow(engine: SpecEngine, channel: TickChannel | None = None) -> int:
  """A follower's serving loop: compiles what the leader's `Scheduler.start` compiles, then
  replays every tick until the leader's stop tick. Returns the number of ticks replayed.

  Beats a heartbeat and watches the leader's all along: a silent leader, an unreachable store
  or a tick that fails (a collective whose peer died) ends the process with `EXIT_LOST`
  (`TickChannel.die`), as the group cannot go on without it."""
  channel = channel or TickChannel()
  heartbeat = channel.beat([0], lambda reason: channel.die(f"process 0, the leader: {reason}"))
  replayed = 0
  try:
    state = engine.warm_up_slots()  # the leader's Scheduler.start runs the same calls
    while True:
      tick = channel.receive()
      if tick.stop:
        heartbeat.stop()
        return replayed
      state, _ = apply_tick(engine, state, tick)
      replayed += 1
  except Exception as e:  # pylint: disable=broad-except  # the leader is gone, or a tick failed
    traceback.print_exc()
    channel.die(f"after {replayed} ticks: {type(e).__name__}: {_first_line(e)}")
    raise  # only if `die` returned (a test's exit_fn)


__all__ = [
  "ALIVE_PREFIX",
  "EXIT_LOST",
  "GRACE_S",
  "POLL_MS",
  "PREFIX",
  "Heartbeat",
  "TickChannel",
  "default_lost_after_s",
  "exit_process",
  "follow",
]
