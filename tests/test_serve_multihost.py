"""The server across two processes: the leader serves HTTP, the follower replays its ticks.

Two local processes with 4 virtual CPU devices each (tests/test_multihost.py's launcher) build
the bundled target's n-gram engine on a (data=1, expert=2, tensor=4) mesh over all 8 devices.
Process 0 serves on loopback with a `multihost.TickChannel`; process 1 runs `multihost.follow`.
A greedy completion and a streamed one must answer what a one-process server answers, and the
follower must exit when the leader shuts down. A follower that replays ticks wrongly either
diverges (its shards of the state differ) or hangs in a collective; both processes are killed
at the deadline, so that fails rather than hangs.

Processes that die: a follower killed (SIGKILL) or frozen (SIGSTOP: a hung or cut-off host,
whose sockets stay open) with requests in flight must make the leader answer them (503, a
stream's error event then [DONE]) and exit with `multihost.EXIT_LOST` within a bound; a leader
killed or frozen must end its follower within a bound (the heartbeat watchdogs, at a small
--heartbeat_timeout).
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import textwrap
import threading
import time
import urllib.parse

import pytest

from tests import test_multihost

MODEL = "jaxspec-mh"
TIMEOUT_S = 420
# The expert axis spans the two processes (devices 0-3 are process 0's): every step's MoE
# layers combine both processes' experts, so a follower's wrong state reaches the leader's
# tokens. (With data=2 outermost, each process would hold whole replicas and never meet.)
MESH = {"data": 1, "expert": 2, "tensor": 4}
# A completion (repeats, so the n-gram drafter proposes) and a streamed chat-free completion.
ASKS = [("def f(x):\n  return x\ndef f(x):\n", False), ("import os\nimport", True)]

SCRIPT = test_multihost.DIE_AT_ONCE + textwrap.dedent(r"""
    from jaxspec import distributed
    joined = distributed.initialize()
    from jaxspec import sharding
    from jaxspec.serve import multihost
    from tests import test_serve_multihost as t

    import jax
    engine = t.make_engine(sharding.make_mesh(t.MESH))
    if not distributed.is_leader():
        print(json.dumps({"ticks": multihost.follow(engine)}))
        sys.exit(0)
    report = t.serve_and_ask(engine, multihost.TickChannel())
    report["spans"] = any(not x.is_fully_addressable for x in jax.tree.leaves(engine.target.params))
    print(json.dumps(report))
""")


# The kill tests' processes: JAX aborts a process silent for HEARTBEAT_S; the serving watchdogs
# act at half of it. A clean failure must come before JAX's abort, plus load slack.
HEARTBEAT_S = 10
BOUND_S = HEARTBEAT_S + 5
STARTUP_S = 300  # two processes building and compiling the engine on 2 busy cores

KILL_SCRIPT = test_multihost.DIE_AT_ONCE + textwrap.dedent(r"""
    from jaxspec import distributed
    config = distributed.resolve(heartbeat_timeout_s=int(sys.argv[1]))
    joined = distributed.initialize(config)
    from jaxspec import sharding
    from jaxspec.serve import multihost
    from tests import test_serve_multihost as t

    engine = t.make_engine(sharding.make_mesh(t.MESH))
    if not distributed.is_leader():
        print(json.dumps({"ticks": multihost.follow(engine)}))
        sys.exit(0)
    t.serve_forever(engine, multihost.TickChannel())
""")


def make_engine(mesh=None):
  """The bundled target's n-gram engine: 2 slots of 64 tokens, one prefill program."""
  from launch.cli import defaults  # pylint: disable=import-outside-toplevel

  target, _ = defaults.load_target(None)
  engine, _ = defaults.make_engine(
    target,
    "ngram",
    draft_dir=None,
    verify="chain",
    tree_budget=0,
    mesh=mesh,
    max_len=64,
    batch_size=2,
    min_prompt_bucket=64,
  )
  return engine


def _post(url: str, body: dict) -> str:
  """The text of a /v1/completions reply, streamed (SSE) or not."""
  parts = urllib.parse.urlsplit(url)
  conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=120)
  conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
  resp = conn.getresponse()
  data = resp.read().decode()
  assert resp.status == 200, data
  if not body.get("stream"):
    return json.loads(data)["choices"][0]["text"]
  events = [line[6:] for line in data.splitlines() if line.startswith("data: ")]
  assert events[-1] == "[DONE]", events
  return "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1])


def serve_and_ask(engine, channel=None) -> dict:
  """Serves `engine` on loopback (ticks published on `channel`), asks ASKS, shuts down."""
  from jaxspec.serve import app as app_lib  # pylint: disable=import-outside-toplevel
  from jaxspec.serve import background  # pylint: disable=import-outside-toplevel
  from jaxspec.serve import scheduler as scheduler_lib  # pylint: disable=import-outside-toplevel

  sched = scheduler_lib.Scheduler(engine, steps_per_tick=1, channel=channel)
  sched.start()
  try:
    with background.BackgroundServer(app_lib.create_app(sched, MODEL)) as srv:
      texts = [
        _post(
          srv.url,
          dict(model=MODEL, prompt=prompt, max_tokens=16, temperature=0, stream=stream),
        )
        for prompt, stream in ASKS
      ]
  finally:
    sched.shutdown(drain=False, timeout=60)
  return {"texts": texts, "metrics": sched.metrics()}


def serve_forever(engine, channel) -> None:
  """Serves `engine` on loopback (ticks on `channel`) and prints its URL, until killed or
  until the channel ends the process (a lost group)."""
  from jaxspec.serve import app as app_lib  # pylint: disable=import-outside-toplevel
  from jaxspec.serve import background  # pylint: disable=import-outside-toplevel
  from jaxspec.serve import scheduler as scheduler_lib  # pylint: disable=import-outside-toplevel

  sched = scheduler_lib.Scheduler(engine, steps_per_tick=1, channel=channel)
  sched.start()
  with background.BackgroundServer(app_lib.create_app(sched, MODEL)) as srv:
    print(json.dumps({"url": srv.url}), flush=True)
    while True:
      time.sleep(1)


@pytest.mark.slow
@pytest.mark.timeout(TIMEOUT_S + 60)
def test_two_processes_serve_as_one(tmp_path):
  deadline = time.monotonic() + TIMEOUT_S
  logs = tmp_path / "logs"
  procs = test_multihost._start_processes([], logs, script=SCRIPT)  # pylint: disable=protected-access
  try:  # the one-process server, while the processes run
    reference = serve_and_ask(make_engine())
  finally:
    leader, follower = test_multihost._finish(procs, logs, deadline)  # pylint: disable=protected-access
  assert all(reference["texts"]), reference  # something was generated
  assert leader["spans"]  # the weights span both processes: they compute every step together
  assert leader["texts"] == reference["texts"]
  assert leader["metrics"]["requests_finished_total"] == len(ASKS)
  # One tick per step at steps_per_tick=1: the follower replayed every one the leader ran.
  assert follower["ticks"] >= leader["metrics"]["steps_total"] > 0, (leader, follower)


class _Store:
  """The coordinator's key-value store, in memory (the calls TickChannel and Heartbeat make)."""

  def __init__(self):
    self.data = {}

  def key_value_set(self, key, value, allow_overwrite=False):
    assert allow_overwrite or key not in self.data, key  # a tick is never overwritten
    self.data[key] = value

  def key_value_delete(self, key):
    del self.data[key]

  def key_value_dir_get(self, prefix):
    return [(k, v) for k, v in self.data.items() if k.startswith(prefix)]

  def blocking_key_value_get(self, key, timeout_ms):
    if key not in self.data:
      raise RuntimeError(f"DEADLINE_EXCEEDED: {key} after {timeout_ms} ms")
    return self.data[key]


def _ticks(store) -> list[int]:
  from jaxspec.serve import multihost  # pylint: disable=import-outside-toplevel

  return sorted(int(k.rsplit("/", 1)[1]) for k in store.data if k.startswith(multihost.PREFIX))


def test_tick_channel_orders_ticks_and_forgets_only_read_ones():
  from jaxspec.serve import multihost  # pylint: disable=import-outside-toplevel
  from jaxspec.serve.scheduler import Tick  # pylint: disable=import-outside-toplevel

  store = _Store()
  leader, follower = multihost.TickChannel(store), multihost.TickChannel(store)
  leader.publish(Tick([], [], 2))  # Scheduler.start's tick, before the heartbeats run
  # The heartbeats' rounds by hand: the follower's reports the ticks it read.
  leader.heartbeat = multihost.Heartbeat(store, 0, [1], 5.0, print)
  follower.heartbeat = multihost.Heartbeat(store, 1, [0], 5.0, print)
  sent = [
    Tick([[1, [5, 6], {"seed": 2**62 + 1, "temperature": 0.7}]], [], 2),
    Tick([], [0], 0),
    Tick([], [], 2),
  ]
  leader.publish(sent[0])
  # Steps and their read-back gather do not prove a follower read a tick (with no live row,
  # or arrays every process holds whole, the leader meets no other process): kept until the
  # follower's heartbeat says so.
  leader.heartbeat.beat()
  leader.publish(sent[1])
  assert _ticks(store) == [0, 1, 2]
  got = [follower.receive(), follower.receive(timeout_s=1)]
  follower.heartbeat.beat()  # it read ticks 0 and 1 (of 0 to 2)
  leader.heartbeat.beat()
  assert leader.heartbeat.peers_progress() == 2
  leader.publish(sent[2])
  got += [follower.receive(timeout_s=1), follower.receive(timeout_s=1)]
  assert got[1:] == sent  # in order, values exact (a 63-bit seed, a float)
  assert _ticks(store) == [2, 3]  # 0 and 1 are deleted
  leader.publish(Tick([], [], 0, stop=True))
  assert not leader.heartbeat.watching  # the followers stop beating now: no alarm
  assert follower.receive().stop
  with pytest.raises(TimeoutError, match="no tick 5"):
    follower.receive(timeout_s=0)
  store.blocking_key_value_get = lambda key, ms: (_ for _ in ()).throw(RuntimeError("UNAVAILABLE"))
  with pytest.raises(RuntimeError, match="UNAVAILABLE"):  # the leader is gone: not a wait
    follower.receive()


# -- processes that die ----------------------------------------------------------------------

# Long enough to be running when the follower stops (max_len 64); prose the n-gram drafter
# guesses poorly, so it takes many ticks.
STREAM = dict(model=MODEL, prompt="The weather", max_tokens=40, temperature=0, stream=True)
PLAIN = dict(model=MODEL, prompt="Once upon", max_tokens=40, temperature=0)


def _launch(tmp_path) -> tuple[list, str]:
  """The leader and the follower of KILL_SCRIPT, and the leader's URL once it serves."""
  logs = tmp_path / "logs"
  procs = test_multihost._start_processes(  # pylint: disable=protected-access
    [str(HEARTBEAT_S)], logs, script=KILL_SCRIPT
  )
  deadline = time.monotonic() + STARTUP_S
  while time.monotonic() < deadline:
    for line in (logs / "0.out").read_text().splitlines():
      if line.startswith('{"url"'):
        return procs, json.loads(line)["url"]
    if any(p.poll() is not None for p in procs):
      break
    time.sleep(0.5)
  _kill(procs)
  raise AssertionError(f"the leader did not serve:\n{_logs(tmp_path)}")


def _kill(procs) -> None:
  for p in procs:
    if p.poll() is None:
      p.kill()
    p.wait()


def _logs(tmp_path) -> str:
  logs = tmp_path / "logs"
  return "\n".join(
    f"--- process {i} stderr:\n{(logs / f'{i}.err').read_text()[-2500:]}" for i in range(2)
  )


def _exit_time(proc, start: float, bound_s: float) -> float:
  """Seconds from `start` until `proc` exited (an AssertionError past `bound_s`)."""
  try:
    proc.wait(timeout=max(0.0, start + bound_s - time.monotonic()))
  except Exception:  # pylint: disable=broad-except  # subprocess.TimeoutExpired
    raise AssertionError(f"process {proc.pid} still runs {bound_s} s later") from None
  return time.monotonic() - start


def _metric(url: str, name: str) -> float:
  parts = urllib.parse.urlsplit(url)
  conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
  conn.request("GET", "/metrics")
  for line in conn.getresponse().read().decode().splitlines():
    if line.startswith(f"jaxspec_{name} "):
      return float(line.split()[1])
  raise AssertionError(f"no {name} in /metrics")


class _Client(threading.Thread):
  """A /v1/completions request in a thread: its status and body; for a stream its SSE events
  (`first` is set at the first event)."""

  def __init__(self, url: str, body: dict):
    super().__init__(daemon=True)
    self.url, self.body = url, body
    self.first = threading.Event()
    self.status, self.events, self.text, self.error = None, [], "", None

  def run(self):
    try:
      parts = urllib.parse.urlsplit(self.url)
      conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=120)
      conn.request(
        "POST", "/v1/completions", json.dumps(self.body), {"Content-Type": "application/json"}
      )
      resp = conn.getresponse()
      self.status = resp.status
      if not self.body.get("stream"):
        self.text = resp.read().decode()
        return
      for raw in resp:
        line = raw.decode().strip()
        if line.startswith("data: "):
          self.events.append(line[6:])
          self.first.set()
    except Exception as e:  # pylint: disable=broad-except  # reported by the test
      self.error = f"{type(e).__name__}: {e}"
    finally:
      self.first.set()


@pytest.mark.slow
@pytest.mark.timeout(STARTUP_S + 120)
@pytest.mark.parametrize("how", ["SIGKILL", "SIGSTOP"])
def test_a_lost_follower_fails_the_requests_and_ends_the_leader(tmp_path, how):
  """SIGKILL: the leader's collective fails at once (the socket closes); SIGSTOP (a hung or
  cut-off host: the sockets stay open, the collective would wait for ever): the leader's
  watchdog sees the follower's heartbeat stop. Either way the requests in flight fail (503,
  an error event) and the leader exits with EXIT_LOST."""
  from jaxspec.serve import multihost  # pylint: disable=import-outside-toplevel

  procs, url = _launch(tmp_path)
  leader, follower = procs
  try:
    stream = _Client(url, STREAM)
    stream.start()
    assert stream.first.wait(120), _logs(tmp_path)  # the follower has replayed a tick
    # Frozen first (SIGKILL too), so that both requests are surely in flight: the leader's
    # next tick waits for the follower.
    os.kill(follower.pid, signal.SIGSTOP)
    plain = _Client(url, PLAIN)
    plain.start()
    deadline = time.monotonic() + 30
    while _metric(url, "requests_total") < 2 and time.monotonic() < deadline:
      time.sleep(0.05)
    start = time.monotonic()
    if how == "SIGKILL":
      os.kill(follower.pid, signal.SIGKILL)
    took = _exit_time(leader, start, BOUND_S)
    stream.join(30)
    plain.join(30)
  finally:
    _kill(procs)
  print(f"follower {how} -> leader exit {leader.returncode} after {took:.2f} s")
  assert leader.returncode == multihost.EXIT_LOST, _logs(tmp_path)
  assert "the multi-host group is lost" in (tmp_path / "logs" / "0.err").read_text()
  assert plain.status == 503, (plain.status, plain.text, plain.error)
  assert "error" in json.loads(plain.text), plain.text
  assert stream.status == 200 and stream.error is None, (stream.status, stream.error)
  events = stream.events
  assert events[-1] == "[DONE]", events
  assert "error" in json.loads(events[-2]), events  # after the tokens it had streamed
  assert any("choices" in json.loads(e) for e in events[:-2]), events


@pytest.mark.slow
@pytest.mark.timeout(STARTUP_S + 120)
@pytest.mark.parametrize("how", ["SIGKILL", "SIGSTOP"])
def test_a_lost_leader_ends_the_follower(tmp_path, how):
  """SIGKILL: the follower's store (the leader's coordinator) closes, so it ends at once (its
  read fails, or JAX aborts it); SIGSTOP: its watchdog sees the leader's heartbeat stop."""
  from jaxspec.serve import multihost  # pylint: disable=import-outside-toplevel

  procs, url = _launch(tmp_path)
  leader, follower = procs
  try:
    stream = _Client(url, STREAM)
    stream.start()
    assert stream.first.wait(120), _logs(tmp_path)  # the follower is replaying ticks
    start = time.monotonic()
    os.kill(leader.pid, getattr(signal, how))
    took = _exit_time(follower, start, BOUND_S)
  finally:
    _kill(procs)
  print(f"leader {how} -> follower exit {follower.returncode} after {took:.2f} s")
  assert follower.returncode != 0, _logs(tmp_path)
  if how == "SIGSTOP":  # the watchdog, before JAX's heartbeat timeout aborts it
    assert follower.returncode == multihost.EXIT_LOST, _logs(tmp_path)


class _Scheduler:
  """What TickChannel.lost calls on the leader's scheduler."""

  def __init__(self):
    self.aborted = []

  def abort(self, reason):
    self.aborted.append(reason)
    return []


def test_heartbeat_counts_a_silent_peer_lost_only_after_it_beat():
  from jaxspec.serve import multihost  # pylint: disable=import-outside-toplevel

  store, now = _Store(), [0.0]
  # Rounds by hand: `check` answers what the watch thread would pass to on_lost.
  leader = multihost.Heartbeat(store, 0, [0, 1], 5.0, print, clock=lambda: now[0])
  follower = multihost.Heartbeat(store, 1, [0], 5.0, print, clock=lambda: now[0])
  for t in range(0, 30, 2):  # the follower compiles, not yet beating: nobody is lost
    now[0] = t
    leader.beat()
    assert leader.check() is None
  for t in range(30, 60, 2):  # both beat
    now[0] = t
    follower.progress = t
    follower.beat()
    leader.beat()
    assert leader.check() is None and follower.check() is None
  now[0] = 64  # the follower stops: silent 6 s > 5 s
  leader.beat()
  assert "process 1 has sent no heartbeat for 6.0 s" in leader.check()
  assert "its last beat, #14, was at tick 58" in leader.check()

  def unreachable(*args, **kwargs):
    raise RuntimeError("UNAVAILABLE: Socket closed")

  store.key_value_set = unreachable  # process 0 and its store are gone
  for t in (66, 70):
    now[0] = t
    follower.beat()
  assert "has not answered process 1 for 12.0 s (UNAVAILABLE: Socket closed)" in follower.check()


def test_a_lost_leader_aborts_its_scheduler_then_exits_once():
  from jaxspec.serve import multihost  # pylint: disable=import-outside-toplevel

  exits = []
  channel = multihost.TickChannel(_Store(), lost_after_s=5, grace_s=0.1, exit_fn=exits.append)
  sched = _Scheduler()
  channel._scheduler = sched  # pylint: disable=protected-access  # what watch() sets
  channel.lost("process 1 has sent no heartbeat for 6.0 s")
  channel.lost("a failed tick")  # the scheduler thread, failing as the process ends: ignored
  assert exits == [multihost.EXIT_LOST]
  assert sched.aborted == [
    "the multi-host group is lost: process 1 has sent no heartbeat for 6.0 s"
  ]


# -- the leader's side of a lost group, in one process --------------------------------------


class _Stalling(_Store):
  """A store whose first request tick (after Scheduler.start's tick 0) fails, as a collective
  fails when its peer died, or hangs until `release`, as one whose peer hung."""

  def __init__(self, fail: bool):
    super().__init__()
    self.fail, self.entered, self.release = fail, threading.Event(), threading.Event()

  def key_value_set(self, key, value, allow_overwrite=False):
    from jaxspec.serve import multihost  # pylint: disable=import-outside-toplevel

    if key == f"{multihost.PREFIX}/1":
      self.entered.set()
      if self.fail:
        raise RuntimeError("Gloo AllGather failed: Read error: Connection reset by peer")
      self.release.wait(60)
    super().key_value_set(key, value, allow_overwrite)


@pytest.fixture(scope="module")
def small_engine():
  return make_engine()


@pytest.mark.parametrize("fail", [True, False], ids=["failed_tick", "stuck_tick"])
def test_a_lost_group_fails_every_request_and_ends_the_leader(small_engine, fail):
  """A tick that fails (a peer died mid-collective) or that never returns while the watchdog
  sees a follower fall silent: every running and queued request ends "cancelled" with the
  reason (the app's 503), new ones are refused, no stop tick goes out, and the process exits
  with EXIT_LOST."""
  from jaxspec.serve import multihost  # pylint: disable=import-outside-toplevel
  from jaxspec.serve import scheduler as scheduler_lib  # pylint: disable=import-outside-toplevel
  from jaxspec.serve.handles import SamplingOptions, SchedulerClosed  # pylint: disable=import-outside-toplevel

  store, exits = _Stalling(fail), []
  channel = multihost.TickChannel(store, lost_after_s=60, grace_s=0.2, exit_fn=exits.append)
  sched = scheduler_lib.Scheduler(small_engine, steps_per_tick=1, channel=channel)
  sched.start()  # publishes tick 0, then watches (no follower in one process)
  options = SamplingOptions(max_tokens=8, temperature=0.0)
  handles = sched.submit_many([([5, 6, 7], options)] * 3)  # two slots: two run, one waits
  assert store.entered.wait(60)
  if not fail:  # the scheduler thread sits in its tick: the watchdog's call
    channel.lost("process 1 has sent no heartbeat for 6.0 s")
  deadline = time.monotonic() + 30
  while not exits and time.monotonic() < deadline:
    time.sleep(0.05)
  assert exits == [multihost.EXIT_LOST]
  why = "scheduler stopped: RuntimeError: Gloo" if fail else "process 1 has sent no heartbeat"
  for h in handles:
    last = list(h)[-1]
    assert last.finish_reason == "cancelled" and why in last.error, last
    assert last.error.startswith("the multi-host group is lost: ")
  with pytest.raises(SchedulerClosed, match="group is lost"):
    sched.submit([5], options)
  store.release.set()  # the stuck tick returns at last: it must deliver and publish nothing
  sched.shutdown(timeout=60)
  assert not sched.running
  assert _ticks(store) == [0] if fail else [0, 1]  # no stop tick
  assert exits == [multihost.EXIT_LOST]


def test_heartbeat_timeout_is_a_bounded_setting():
  from jaxspec import distributed  # pylint: disable=import-outside-toplevel
  from jaxspec.errors import ConfigError  # pylint: disable=import-outside-toplevel
  from jaxspec.serve import multihost  # pylint: disable=import-outside-toplevel

  assert distributed.resolve("host:99", 2, 1).heartbeat_timeout_s == 20
  assert distributed.resolve("host:99", 2, 1, heartbeat_timeout_s=7).heartbeat_timeout_s == 7
  for bad in (1, True, 2.5):
    with pytest.raises(ConfigError, match="heartbeat_timeout_s"):
      distributed.DistributedConfig("host:99", 2, 1, bad)
  assert distributed.joined() is None  # this process joined no run: the default, halved
  assert multihost.default_lost_after_s() == distributed.HEARTBEAT_TIMEOUT_S / 2
