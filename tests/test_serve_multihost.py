"""The server across two processes: the leader serves HTTP, the follower replays its ticks.

Two local processes with 4 virtual CPU devices each (tests/test_multihost.py's launcher) build
the bundled target's n-gram engine on a (data=1, expert=2, tensor=4) mesh over all 8 devices.
Process 0 serves on loopback with a `multihost.TickChannel`; process 1 runs `multihost.follow`.
A greedy completion and a streamed one must answer what a one-process server answers, and the
follower must exit when the leader shuts down. A follower that replays ticks wrongly either
diverges (its shards of the state differ) or hangs in a collective; both processes are killed
at the deadline, so that fails rather than hangs.
"""

from __future__ import annotations

import http.client
import json
import textwrap
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
  """The coordinator's key-value store, in memory (the calls TickChannel makes)."""

  def __init__(self):
    self.data = {}

  def key_value_set(self, key, value):
    assert key not in self.data, key  # a tick is never overwritten
    self.data[key] = value

  def key_value_delete(self, key):
    del self.data[key]

  def blocking_key_value_get(self, key, timeout_ms):
    if key not in self.data:
      raise RuntimeError(f"DEADLINE_EXCEEDED: {key} after {timeout_ms} ms")
    return self.data[key]


def test_tick_channel_orders_ticks_and_forgets_only_read_ones():
  from jaxspec.serve import multihost  # pylint: disable=import-outside-toplevel
  from jaxspec.serve.scheduler import Tick  # pylint: disable=import-outside-toplevel

  store = _Store()
  leader, follower = multihost.TickChannel(store), multihost.TickChannel(store)
  sent = [
    Tick([[1, [5, 6], {"seed": 2**62 + 1, "temperature": 0.7}]], [], 2),
    Tick([], [0], 0),  # evict only: no gather, so a follower may not have read it yet ...
    Tick([], [], 2),
  ]
  leader.publish(sent[0])
  got = [follower.receive()]  # read before its gather, which the leader waits for
  leader.publish(sent[1])
  leader.publish(sent[2])  # ... when the leader publishes the next tick
  got += [follower.receive(timeout_s=1), follower.receive(timeout_s=1)]
  assert got == sent  # in order, values exact (a 63-bit seed, a float)
  assert sorted(store.data) == [f"{multihost.PREFIX}/{n}" for n in (1, 2)]  # 0 is deleted
  leader.publish(Tick([], [], 0, stop=True))
  assert follower.receive().stop
  with pytest.raises(TimeoutError, match="no tick 4"):
    follower.receive(timeout_s=0)
  store.blocking_key_value_get = lambda key, ms: (_ for _ in ()).throw(RuntimeError("UNAVAILABLE"))
  with pytest.raises(RuntimeError, match="UNAVAILABLE"):  # the leader is gone: not a wait
    follower.receive()
