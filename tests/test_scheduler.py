"""The continuous-batching scheduler: more requests than slots, each equal to it alone.

One scheduler over the bundled target with an EAGLE-3 drafter (chain verification) and three
slots; requests of mixed lengths and sampling settings come and go while others run.
"""

from __future__ import annotations

import asyncio
import threading
import types

import numpy as np
import pytest

from jaxspec import distributed
from jaxspec.errors import ConfigError, InputError
from jaxspec.serve import QueueFull, SamplingOptions, Scheduler, SchedulerClosed
from jaxspec.serve import handles, ticks
from jaxspec.serve.ticks import Tick, apply_tick
from jaxspec.speculative.engine import SpecEngine
from jaxspec.speculative.engine_config import EngineConfig
from jaxspec.speculative.request import SamplingArgs

from tests import engine_models, near_ties

PROMPTS = [
  "def fib(n):\n",
  "class Stack:\n    def __init__(self):\n",
  "import os\n",
  "for i in range(",
  'def read_json(path):\n    """Read a JSON file."""\n',
  "x = [",
]


@pytest.fixture(scope="module")
def engine(target, bundled_drafter):
  drafter = bundled_drafter("eagle3")
  return SpecEngine(target, drafter, EngineConfig(max_len=96, batch_size=3, stream_every=2))


@pytest.fixture(scope="module")
def scheduler(engine):
  s = Scheduler(engine, max_queue=32)
  s.start()
  yield s
  s.shutdown(drain=False, timeout=60)


def _options(i: int) -> SamplingOptions:
  sampled = i % 2 == 1
  return SamplingOptions(
    max_tokens=10 + 3 * i,
    temperature=0.9 if sampled else 0.0,
    top_p=0.95 if sampled else 1.0,
    seed=100 + i,
    logprobs=True,
  )


def _alone(engine, prompt_ids, o: SamplingOptions):
  out = engine.generate(
    [prompt_ids],
    max_new_tokens=o.max_tokens,
    temperature=o.temperature,
    top_p=o.top_p,
    top_k=o.top_k,
    seed=o.seed if o.seed is not None else 0,
    stop_token_ids=list(o.stop_token_ids),
  )
  return out.tokens[0], out.logprobs[0]


def _strip_stop(engine, tokens):
  return tokens[:-1] if tokens and tokens[-1] in engine.stop_ids else tokens


def test_more_requests_than_slots_each_equal_alone(scheduler, engine, target):
  compiled = engine.compile_counts()
  ids = [target.tokenizer.encode(p) for p in PROMPTS * 2]
  handles = [scheduler.submit(p, _options(i)) for i, p in enumerate(ids)]
  results = [h.result() for h in handles]
  assert engine.compile_counts() == compiled  # nothing compiled while serving
  for i, (p, (tokens, logprobs, reason)) in enumerate(zip(ids, results)):
    want, want_lp = _alone(engine, p, _options(i))
    expected = _strip_stop(engine, want)
    assert reason == ("stop" if expected != want else "length")
    assert len(logprobs) == len(tokens)
    if _options(i).temperature == 0:
      near_ties.assert_greedy_match(target, [p], [expected], [tokens])
    else:
      assert tokens == expected, i
  m = scheduler.metrics()
  assert m["requests_finished_total"] >= len(ids) and m["acceptance_length"] > 1.0
  assert m["requests_running"] == 0 and m["requests_waiting"] == 0


def test_cancel_frees_the_slot_for_the_next_request(scheduler, engine, target):
  long = SamplingOptions(max_tokens=80, temperature=0.0, stop_token_ids=())
  ids = target.tokenizer.encode(PROMPTS[0])
  hogs = [scheduler.submit(ids, long) for _ in range(scheduler.slots)]
  waiting = scheduler.submit(target.tokenizer.encode(PROMPTS[2]), _options(2))
  for h in hogs:
    assert next(iter(h)).finish_reason is None  # every slot is busy
  for h in hogs:
    h.cancel()
  for h in hogs:
    tokens, _, reason = h.result()
    assert reason == "cancelled" and len(tokens) < 80
  tokens, _, _ = waiting.result()  # got a freed slot and finished correctly
  want, _ = _alone(engine, target.tokenizer.encode(PROMPTS[2]), _options(2))
  near_ties.assert_greedy_match(
    target, [target.tokenizer.encode(PROMPTS[2])], [_strip_stop(engine, want)], [tokens]
  )
  assert scheduler.metrics()["requests_cancelled_total"] >= scheduler.slots


def test_full_queue_and_bad_requests_are_refused(engine, target):
  s = Scheduler(engine, max_queue=1)
  with pytest.raises(SchedulerClosed):
    s.submit([1, 2], SamplingOptions(max_tokens=2))
  s.start()
  try:
    ids = target.tokenizer.encode(PROMPTS[0])
    long = SamplingOptions(max_tokens=80, temperature=0.0)
    hogs = []
    for _ in range(s.slots):  # one at a time: the queue holds one
      hogs.append(s.submit(ids, long))
      next(iter(hogs[-1]))  # running

    queued = s.submit(ids, long)
    with pytest.raises(QueueFull):
      s.submit(ids, long)
    with pytest.raises(InputError, match="more than max_len=96"):
      s.submit(ids, SamplingOptions(max_tokens=200))
    with pytest.raises(InputError, match="temperature"):
      s.submit(ids, SamplingOptions(max_tokens=2, temperature=-1.0))
    with pytest.raises(InputError, match="outside the vocabulary"):
      s.submit([target.config.vocab_size], SamplingOptions(max_tokens=2))
    for h in hogs + [queued]:
      h.cancel()
  finally:
    s.shutdown(drain=False, timeout=60)
  with pytest.raises(SchedulerClosed):
    s.submit([1, 2], SamplingOptions(max_tokens=2))


def test_warmed_choice_groups_compile_nothing_while_serving(target):
  """n choices prefill as a group of the next power of two rows: a server warmed for 4
  choices (groups of 2 and 4, every prompt bucket) serves n = 3 without compiling, and
  choice i still returns what its seed returns alone (the padding row is dropped)."""
  config = EngineConfig(max_len=32, batch_size=4, stream_every=2, warm_choices=4)
  engine = SpecEngine(target, None, config)
  assert [engine.choice_group(n) for n in (1, 2, 3, 4)] == [1, 2, 4, 4]
  wide = SpecEngine(target, None, EngineConfig(max_len=32, batch_size=6))
  assert [wide.choice_group(n) for n in (5, 6)] == [6, 6]  # at most the slots
  with pytest.raises(ConfigError, match="warm_choices"):
    EngineConfig(batch_size=2, warm_choices=3)
  s = Scheduler(engine, max_queue=8)
  s.start()
  try:
    compiled = engine.compile_counts()
    assert compiled["insert_rows"] == 2  # the groups of 2 and 4
    ids = target.tokenizer.encode(PROMPTS[1])
    options = SamplingOptions(max_tokens=8, temperature=0.9, seed=5)
    choices = [h.result()[0] for h in s.submit_n(ids, options, 3)]
    assert engine.compile_counts() == compiled
    seeds = [handles.choice_seed(5, i) for i in range(3)]
    alone = [s.submit(ids, SamplingOptions(8, 0.9, seed=k)).result()[0] for k in seeds]
  finally:
    s.shutdown(drain=False, timeout=60)
  assert choices == alone and len({tuple(c) for c in choices}) > 1


def test_async_iteration_and_draining_shutdown(engine, target):
  s = Scheduler(engine, max_queue=8, steps_per_tick=1)
  s.start()
  ids = target.tokenizer.encode(PROMPTS[3])
  options = SamplingOptions(max_tokens=12, temperature=0.0)

  async def serve():
    handles = [s.submit(ids, options) for _ in range(4)]
    outs = []
    for h in handles:
      tokens, deltas = [], 0
      async for d in h:
        tokens += d.token_ids
        deltas += 1
      outs.append((tokens, deltas, h.finish_reason))
    return outs

  stopper = None
  try:
    outs = asyncio.run(serve())
    want = _strip_stop(engine, _alone(engine, ids, options)[0])
    for tokens, deltas, reason in outs:
      assert tokens == outs[0][0]
      assert reason in ("stop", "length")
      assert deltas > 1  # streamed, one tick at a time
    near_ties.assert_greedy_match(target, [ids], [want], [outs[0][0]])
    # Shutdown with drain: a request submitted just before still completes.
    late = s.submit(ids, options)
    stopper = threading.Thread(target=s.shutdown, kwargs=dict(drain=True, timeout=60))
    stopper.start()
    assert late.result()[2] in ("stop", "length")
  finally:
    if stopper is not None:
      stopper.join()
    s.shutdown(drain=False, timeout=60)
  assert not s.running


class _Recorder:
  """A stand-in TickChannel: keeps what the scheduler publishes."""

  def __init__(self):
    self.ticks = []

  def publish(self, tick):
    self.ticks.append(Tick.from_json(tick.to_json()))  # what a follower would read


def test_published_ticks_replay_the_leaders_engine_calls(engine, target):
  # A follower replays the ticks from a warmed-up free state (multihost.follow): its read-backs
  # must equal the leader's, sampled rows (seeds travel in the tick) and an eviction included.
  channel = _Recorder()
  s = Scheduler(engine, max_queue=8, steps_per_tick=2, channel=channel)
  seen = []
  deliver = s._deliver_tokens  # pylint: disable=protected-access
  s._deliver_tokens = lambda host: (seen.append(host), deliver(host))[1]  # pylint: disable=protected-access
  s.start()
  try:
    ids = [target.tokenizer.encode(p) for p in PROMPTS[:4]]
    hog = s.submit(ids[0], SamplingOptions(max_tokens=60, temperature=0.0))
    handles = [s.submit(i, _options(k)) for k, i in enumerate(ids[1:], 1)]
    next(iter(hog))
    hog.cancel()
    for h in handles:
      h.result()
  finally:
    s.shutdown(drain=True, timeout=60)
  ticks = channel.ticks
  assert ticks[-1].stop and not any(t.stop for t in ticks[:-1])
  assert any(t.evict for t in ticks) and sum(len(t.admit) for t in ticks) == 4
  state, replayed = engine.warm_up_slots(), []
  for tick in ticks[:-1]:
    state, host = apply_tick(engine, state, tick)
    if host is not None:
      replayed.append(host)
  assert len(replayed) == len(seen)
  for want, got in zip(seen, replayed):
    assert want.keys() == got.keys()
    for k in want:
      np.testing.assert_array_equal(want[k], got[k], err_msg=k)


def test_a_tick_reads_back_only_what_it_produced(monkeypatch):
  """The read-back of a tick is a window of the rows' last tokens, O(B·window): the same bytes
  for max_len 64 and 512, no array as long as the buffers, and the window ends at seq_len."""
  gathered = []

  def spy(tree):
    host = distributed.gather(tree)
    gathered.append(host)
    return host

  monkeypatch.setattr(ticks, "distributed", types.SimpleNamespace(gather=spy))
  target = engine_models.random_target()
  sizes = {}
  for max_len in (64, 512):
    engine = SpecEngine(target, None, EngineConfig(max_len=max_len, batch_size=2, use_eos=False))
    args = SamplingArgs(max_new_tokens=20, temperature=0.0).to_json()
    tick = Tick([[1, [5, 6, 7], args]], [], 3)
    state, host = apply_tick(engine, engine.empty_state(), tick)
    assert gathered[-1] is host
    for name, value in host.items():
      assert max_len not in np.shape(value), (name, np.shape(value))
    window = engine.window(tick.steps)
    assert host["tokens"].shape == (2, window) == (2, 4)
    seq = int(host["seq_len"][1])
    last = np.asarray(state.tokens)[1, seq - window : seq]
    np.testing.assert_array_equal(host["tokens"][1], last)
    sizes[max_len] = sum(np.asarray(v).nbytes for v in host.values())
  assert sizes[64] == sizes[512], sizes
