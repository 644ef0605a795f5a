"""The OpenAI-compatible server, live on loopback, driven by the official `openai` client.

The server runs the real scheduler over the bundled target with its EAGLE-3 drafter (4 slots,
128 tokens each, one prompt bucket, one step per tick so streams last several ticks); a plain
decoding server joins in the slow tests. Error paths the engine cannot be made to take (an
engine failure, a full queue) use small stand-in schedulers.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import http.client
import json
import math
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import openai
import pytest
import uvicorn

from jaxspec.drafters import registry
from jaxspec.serve import app as app_lib
from jaxspec.serve import background
from jaxspec.serve import draining
from jaxspec.serve import handles
from jaxspec.serve.handles import Delta, QueueFull, SamplingOptions, SchedulerClosed
from jaxspec.serve.scheduler import Scheduler
from launch.cli import defaults

MODEL = "jaxspec-test"
KEY = "sk-test-key"
PROMPTS = ["def fib(n):", "import os\n", "class Stack:\n  def push(self, x):", "x", "# sum\n" * 6]
SLOTS = 4
MAX_LEN = 128


def make_scheduler(method: str) -> Scheduler:
  target, _ = defaults.load_target(None)
  engine, _ = defaults.make_engine(
    target,
    method,
    draft_dir=registry.bundled_dir(method) if method == "eagle3" else None,
    verify="chain",
    tree_budget=0,
    max_len=MAX_LEN,
    batch_size=SLOTS,
    min_prompt_bucket=MAX_LEN,  # one prefill program to compile
    penalties=True,
    top_logprobs=5,
  )
  sched = Scheduler(engine, max_queue=64, steps_per_tick=1)
  sched.start()
  return sched


@pytest.fixture(scope="module")
def scheduler():
  sched = make_scheduler("eagle3")
  yield sched
  sched.shutdown(drain=False, timeout=60)


@pytest.fixture(scope="module")
def server(scheduler):
  app = app_lib.create_app(scheduler, MODEL, max_body_bytes=4096)
  with background.BackgroundServer(app) as srv:
    yield srv


@pytest.fixture(scope="module")
def client(server):
  return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def async_client(server, **kw) -> openai.AsyncOpenAI:
  """A client for one event loop (asyncio.run): its connections belong to that loop."""
  return openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, **kw)


def greedy(client, prompt, **kw):
  kw.setdefault("max_tokens", 24)
  return client.completions.create(model=MODEL, prompt=prompt, temperature=0, **kw)


def raw(server, method, path, body=b"", headers=None, chunked=False):
  """(status, decoded JSON or text) of a raw HTTP request."""
  conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
  conn.request(method, path, body=body, headers=headers or {}, encode_chunked=chunked)
  resp = conn.getresponse()
  data = resp.read().decode()
  conn.close()
  try:
    return resp.status, json.loads(data)
  except json.JSONDecodeError:
    return resp.status, data


def test_models_and_health(client, server):
  assert [m.id for m in client.models.list().data] == [MODEL]
  assert raw(server, "GET", "/health") == (200, {"status": "ok"})


def test_completion(client, scheduler):
  out = greedy(client, PROMPTS[0])
  choice = out.choices[0]
  assert out.object == "text_completion" and out.model == MODEL and out.id.startswith("cmpl-")
  assert choice.text and choice.finish_reason in ("stop", "length")
  prompt_ids = scheduler.engine.target.tokenizer.encode(PROMPTS[0], split_special_tokens=True)
  assert out.usage.prompt_tokens == len(prompt_ids)
  assert 0 < out.usage.completion_tokens <= 24
  assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens
  # The same prompt as token ids (and as one-element lists) is the same request.
  assert greedy(client, prompt_ids).choices[0].text == choice.text
  assert greedy(client, [PROMPTS[0]]).choices[0].text == choice.text
  assert greedy(client, [prompt_ids]).choices[0].text == choice.text


def test_penalties_and_logit_bias_reach_the_engine(client, scheduler):
  """The OpenAI parameters change the output, and the server's output is the scheduler's for
  the same adjustments (their sampling law is tested in tests/test_penalties.py)."""
  tokenizer = scheduler.engine.target.tokenizer
  prompt = PROMPTS[0]
  plain = greedy(client, prompt, max_tokens=16).choices[0].text
  first = tokenizer.encode(prompt + plain, split_special_tokens=True)[
    len(tokenizer.encode(prompt, split_special_tokens=True))
  ]
  adjust = dict(frequency_penalty=1.5, presence_penalty=0.5, logit_bias={str(first): -100})
  got = greedy(client, prompt, max_tokens=16, extra_body={"repetition_penalty": 1.3}, **adjust)
  assert got.choices[0].text != plain
  ids = tokenizer.encode(prompt, split_special_tokens=True)
  options = SamplingOptions(
    max_tokens=16,
    temperature=0.0,
    frequency_penalty=1.5,
    presence_penalty=0.5,
    repetition_penalty=1.3,
    logit_bias=((first, -100.0),),
  )
  tokens, _, _ = scheduler.submit(ids, options).result()
  assert first not in tokens[:1]
  assert got.choices[0].text == tokenizer.decode(
    [t for t in tokens if t not in scheduler.engine.stop_ids]
  )


def test_n_choices_each_equal_their_seeds_single_request(client, server, scheduler):
  """n = 3: one prefill (counted once), three choices, choice i what a single request with
  `choice_seed(seed, i)` returns; streamed, the same texts arrive under their indices."""
  kw = dict(model=MODEL, prompt=PROMPTS[1], max_tokens=12, temperature=0.9)
  before = scheduler.metrics()["prompt_tokens_prefilled_total"]
  out = client.completions.create(n=3, seed=5, **kw)
  prompt_tokens = out.usage.prompt_tokens
  assert scheduler.metrics()["prompt_tokens_prefilled_total"] == before + prompt_tokens
  assert [c.index for c in out.choices] == [0, 1, 2]
  singles = [
    client.completions.create(seed=handles.choice_seed(5, i), **kw).choices[0] for i in range(3)
  ]
  assert [c.text for c in out.choices] == [c.text for c in singles]
  assert len({c.text for c in out.choices}) > 1  # different draws
  assert out.usage.completion_tokens == sum(
    client.completions.create(seed=handles.choice_seed(5, i), **kw).usage.completion_tokens
    for i in range(3)
  )
  texts = ["", "", ""]
  for chunk in client.completions.create(n=3, seed=5, stream=True, **kw):
    for choice in chunk.choices:
      texts[choice.index] += choice.text
  assert texts == [c.text for c in singles]
  chat = client.chat.completions.create(
    model=MODEL, messages=[{"role": "user", "content": "hi"}], n=2, max_tokens=8, seed=3
  )
  assert [c.index for c in chat.choices] == [0, 1]


def test_best_of_returns_the_most_likely_candidates(client, scheduler):
  """best_of = 3, n = 2: the three candidates are n = 3's choices (one prefill); the two with
  the highest mean log-prob per token come back, best first, without log-probs nobody asked
  for; usage counts every candidate. Streaming it, or best_of < n, is refused."""
  kw = dict(model=MODEL, prompt=PROMPTS[1], max_tokens=12, temperature=0.9)
  out = client.completions.create(n=2, best_of=3, seed=5, **kw)
  singles = [
    client.completions.create(seed=handles.choice_seed(5, i), logprobs=1, **kw) for i in range(3)
  ]
  means = [math.fsum(s.choices[0].logprobs.token_logprobs) / len(s.choices[0].logprobs.tokens)
           for s in singles]  # fmt: skip
  best = sorted(range(3), key=lambda i: -means[i])[:2]
  assert [c.text for c in out.choices] == [singles[i].choices[0].text for i in best]
  assert [c.index for c in out.choices] == [0, 1] and out.choices[0].logprobs is None
  assert out.usage.completion_tokens == sum(s.usage.completion_tokens for s in singles)
  with pytest.raises(openai.BadRequestError, match="streamed"):
    client.completions.create(n=1, best_of=2, stream=True, **kw)
  with pytest.raises(openai.BadRequestError, match="at least n"):
    client.completions.create(n=2, best_of=1, **kw)


def test_chat_uses_the_template(client):
  messages = [{"role": "user", "content": "hi"}]
  out = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=12)
  assert out.object == "chat.completion" and out.id.startswith("chatcmpl-")
  assert out.choices[0].message.role == "assistant"
  # The default template renders "user: hi\nassistant:"; a completion of that is the same.
  assert (
    out.choices[0].message.content
    == greedy(client, "user: hi\nassistant:", max_tokens=12).choices[0].text
  )


def test_chat_without_max_tokens_fills_the_slot(client, scheduler):
  messages = [{"role": "user", "content": "def fib(n):"}]
  out = client.chat.completions.create(model=MODEL, messages=messages, temperature=0)
  room = MAX_LEN - out.usage.prompt_tokens - scheduler.engine.lookahead - 1
  assert out.choices[0].finish_reason == "stop" or out.usage.completion_tokens == room


def test_streaming_equals_non_streaming(client):
  whole = greedy(client, PROMPTS[2], logprobs=1)
  chunks = list(
    greedy(client, PROMPTS[2], stream=True, logprobs=1, stream_options={"include_usage": True})
  )
  assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
  assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[
    0
  ].finish_reason
  assert (
    chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
  )
  streamed_lps = [x for c in chunks if c.choices for x in c.choices[0].logprobs.token_logprobs]
  assert streamed_lps == whole.choices[0].logprobs.token_logprobs

  messages = [{"role": "user", "content": PROMPTS[1]}]
  chat = client.chat.completions.create(
    model=MODEL, messages=messages, temperature=0, max_tokens=10
  )
  stream = list(
    client.chat.completions.create(
      model=MODEL, messages=messages, temperature=0, max_tokens=10, stream=True
    )
  )
  assert stream[0].choices[0].delta.role == "assistant"
  assert (
    "".join(c.choices[0].delta.content or "" for c in stream) == chat.choices[0].message.content
  )
  assert stream[-1].choices[0].finish_reason == chat.choices[0].finish_reason


def mixed_cases(n: int = 32) -> list[tuple[str, dict]]:
  """Prompts of mixed lengths; greedy and seeded sampled requests (top-k / top-p) alternate."""
  cases = []
  for i in range(n):
    prompt = PROMPTS[i % len(PROMPTS)] * (1 + i % 3)
    if i % 2:
      kw = {"temperature": 0.8, "top_p": 0.9, "seed": i}
      if i % 4 == 1:
        kw["extra_body"] = {"top_k": 20}
    else:
      kw = {"temperature": 0}
    cases.append((prompt, {"max_tokens": 4 + i % 13, **kw}))
  return cases


def run_concurrently(server, cases) -> list:
  async def run_all():
    aclient = async_client(server)
    calls = (aclient.completions.create(model=MODEL, prompt=p, **kw) for p, kw in cases)
    return await asyncio.gather(*calls)

  return asyncio.run(run_all())


def test_32_concurrent_mixed_requests_equal_served_alone(client, server):
  """Each request (greedy, or sampled with a seed) returns what it returns served alone."""
  cases = mixed_cases()
  alone = [client.completions.create(model=MODEL, prompt=p, **kw) for p, kw in cases]
  together = run_concurrently(server, cases)
  for i, (out, ref) in enumerate(zip(together, alone)):
    assert out.choices[0].finish_reason in ("stop", "length")
    assert out.usage.completion_tokens <= cases[i][1]["max_tokens"]
    assert out.choices[0].text == ref.choices[0].text, (i, cases[i])


@pytest.mark.slow
def test_plain_server_agrees(client):
  """A plain-decoding server: the same mixed load equals its served-alone outputs, and every
  greedy output equals the speculative server's (lossless speculative decoding)."""
  cases = mixed_cases()
  sched = make_scheduler("plain")
  try:
    with background.BackgroundServer(app_lib.create_app(sched, MODEL)) as srv:
      plain = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=60)
      alone = [plain.completions.create(model=MODEL, prompt=p, **kw) for p, kw in cases]
      together = run_concurrently(srv, cases)
  finally:
    sched.shutdown(drain=False, timeout=60)
  for i, (prompt, kw) in enumerate(cases):
    assert together[i].choices[0].text == alone[i].choices[0].text, (i, cases[i])
    if kw["temperature"] == 0:
      spec = client.completions.create(model=MODEL, prompt=prompt, **kw)
      assert alone[i].choices[0].text == spec.choices[0].text, (i, cases[i])


def wait_for(pred, timeout=30.0):
  deadline = time.monotonic() + timeout
  while not pred():
    assert time.monotonic() < deadline, "timed out"
    time.sleep(0.01)


LONG = "def fib(n):"  # the bundled model does not stop within 100 tokens after it


def test_cancelled_streams_free_their_slots_and_leave_others_intact(client, scheduler):
  others = [(PROMPTS[i], {"max_tokens": 40, "temperature": 0}) for i in range(1, 4)]
  alone = [client.completions.create(model=MODEL, prompt=p, **kw) for p, kw in others]
  before = scheduler.metrics()["requests_cancelled_total"]
  with concurrent.futures.ThreadPoolExecutor(len(others)) as pool:
    running = [
      pool.submit(client.completions.create, model=MODEL, prompt=p, **kw) for p, kw in others
    ]
    # As many cancelled streams as there are slots: each next one needs a freed slot.
    for _ in range(SLOTS):
      stream = greedy(client, LONG, max_tokens=100, stream=True)
      next(iter(stream))
      stream.close()  # the client goes away mid-stream
    results = [f.result() for f in running]
  wait_for(lambda: scheduler.metrics()["requests_cancelled_total"] == before + SLOTS)
  wait_for(lambda: scheduler.metrics()["requests_running"] == 0)
  assert [r.choices[0].text for r in results] == [r.choices[0].text for r in alone]
  assert greedy(client, LONG, max_tokens=100).usage.completion_tokens == 100  # slots reused


def test_disconnect_while_waiting_cancels_a_non_streaming_request(server, scheduler):
  before = scheduler.metrics()["requests_cancelled_total"]

  async def scenario():
    aclient, quick = async_client(server), async_client(server, timeout=0.3)
    # Enough work queued ahead that the last request is still waiting when its client leaves.
    ahead = [
      asyncio.ensure_future(
        aclient.completions.create(model=MODEL, prompt=LONG, max_tokens=100, temperature=0)
      )
      for _ in range(6 * SLOTS)
    ]
    while scheduler.metrics()["requests_waiting"] < 4 * SLOTS:
      await asyncio.sleep(0.01)
    with pytest.raises(openai.APITimeoutError):
      await quick.completions.create(model=MODEL, prompt="x", max_tokens=100, temperature=0)
    return await asyncio.gather(*ahead)

  done = asyncio.run(scenario())
  wait_for(lambda: scheduler.metrics()["requests_running"] == 0)
  assert scheduler.metrics()["requests_cancelled_total"] == before + 1
  assert all(r.usage.completion_tokens == 100 for r in done)


@pytest.mark.parametrize(
  "body,param,needle",
  [
    ({"prompt": "x"}, "model", "model"),
    ({"model": "other", "prompt": "x"}, "model", "not served"),
    ({"model": MODEL, "prompt": "x", "n": 99}, "n", "choices"),
    ({"model": MODEL, "prompt": "x", "logprobs": 6}, "logprobs", "at most 5"),
    ({"model": MODEL, "prompt": "x", "echo": True}, "echo", "echo"),
    ({"model": MODEL, "prompt": "x", "temperature": -1}, "temperature", "temperature"),
    ({"model": MODEL, "prompt": "x", "top_p": 0}, "top_p", "top_p"),
    ({"model": MODEL, "prompt": "x", "max_tokens": "5"}, "max_tokens", "integer"),
    ({"model": MODEL, "prompt": [True]}, "prompt", "token ids"),
    ({"model": MODEL, "prompt": "", "max_tokens": 4}, "prompt", "empty"),
    ({"model": MODEL, "prompt": ["a", "b"]}, "prompt", "one prompt"),
    ({"model": MODEL, "prompt": "x", "stop": [""]}, "stop", "non-empty"),
    ({"model": MODEL, "prompt": "x", "presence_penalty": 2.5}, "presence_penalty", "less than"),
    ({"model": MODEL, "prompt": "x", "logit_bias": {"a": 1}}, "logit_bias", "token ids"),
    ({"model": MODEL, "prompt": "x", "logit_bias": {"1": 101}}, "logit_bias", "less than"),
    ({"model": MODEL, "prompt": "x", "logit_bias": {"99999": 1}}, None, "vocabulary"),
    ({"model": MODEL, "prompt": "x", "max_tokens": 100000}, None, "max_len"),
    ({"model": MODEL, "prompt": [10**9]}, None, "vocab"),
    (
      {"model": MODEL, "prompt": "x", "stream_options": {"include_usage": True}},
      "stream_options",
      "stream",
    ),
  ],
)
def test_bad_completion_requests_are_400(server, body, param, needle):
  status, out = raw(server, "POST", "/v1/completions", json.dumps(body).encode())
  assert status == 400, out
  err = out["error"]
  assert err["type"] == "invalid_request_error" and needle in err["message"], err
  if param:
    assert err["param"] == param


@pytest.mark.parametrize(
  "body,needle",
  [
    ({"model": MODEL, "messages": []}, "messages"),
    ({"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}, "role"),
    (
      {
        "model": MODEL,
        "messages": [{"role": "user", "content": "x"}],
        "top_logprobs": 21,
        "logprobs": True,
      },
      "at most 20",
    ),
    (
      {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
      "content",
    ),
  ],
)
def test_bad_chat_requests_are_400(server, body, needle):
  status, out = raw(server, "POST", "/v1/chat/completions", json.dumps(body).encode())
  assert status == 400 and needle in out["error"]["message"], out


def test_malformed_and_oversized_requests_then_still_serving(server, client):
  status, out = raw(server, "POST", "/v1/completions", b"{not json")
  assert status == 400 and "JSON" in out["error"]["message"]
  status, out = raw(server, "POST", "/v1/completions", b"[1, 2]")
  assert status == 400 and "JSON object" in out["error"]["message"]
  big = json.dumps({"model": MODEL, "prompt": "x" * 5000}).encode()
  status, out = raw(server, "POST", "/v1/completions", big)
  assert status == 413 and out["error"]["code"] == "request_too_large"
  # Chunked, without a Content-Length: the limit is checked while reading.
  chunks = (big[i : i + 1000] for i in range(0, len(big), 1000))
  status, out = raw(server, "POST", "/v1/completions", chunks, chunked=True)
  assert status == 413 and out["error"]["code"] == "request_too_large"
  for depth in (900, 2000):  # past the parser's recursion, then past json.loads's
    deep = b'{"model": "%s", "prompt": "x", "user": ' % MODEL.encode()
    status, out = raw(server, "POST", "/v1/completions", deep + b"[" * depth + b"]" * depth + b"}")
    assert status == 400 and "nests too deeply" in out["error"]["message"], (depth, out)
  status, out = raw(server, "GET", "/v1/nothing")
  assert status == 404 and "error" in out
  with pytest.raises(openai.BadRequestError):
    client.completions.create(model=MODEL, prompt="x", n=99)
  assert greedy(client, "x", max_tokens=3).choices[0].text


def test_unknown_fields_are_ignored_and_null_means_unset(server):
  body = {"model": MODEL, "prompt": "x", "max_tokens": 2, "user": "u1", "whatever": {"a": 1}}
  assert raw(server, "POST", "/v1/completions", json.dumps(body).encode())[0] == 200
  nulls = {"temperature": None, "stop": None, "logprobs": None, "stream": None, "n": None}
  status, out = raw(server, "POST", "/v1/completions", json.dumps({**body, **nulls}).encode())
  assert status == 200 and out["choices"][0]["logprobs"] is None, out


def test_api_key_is_enforced(scheduler):
  app = app_lib.create_app(scheduler, MODEL, api_key=KEY)
  with background.BackgroundServer(app) as srv:
    body = json.dumps({"model": MODEL, "prompt": "x", "max_tokens": 2}).encode()
    wrong = (
      {},
      {"Authorization": "Bearer nope"},
      {"Authorization": KEY},
      {"Authorization": f"Basic {KEY}"},
    )
    for headers in wrong:
      status, out = raw(srv, "POST", "/v1/completions", body, headers)
      assert status == 401 and out["error"]["code"] == "invalid_api_key", headers
    assert raw(srv, "GET", "/v1/models")[0] == 401
    assert raw(srv, "GET", "/health")[0] == 200
    good = openai.OpenAI(base_url=srv.url + "/v1", api_key=KEY, max_retries=0)
    assert good.completions.create(model=MODEL, prompt="x", max_tokens=2).choices[0].text
    with pytest.raises(openai.AuthenticationError):
      openai.OpenAI(base_url=srv.url + "/v1", api_key="bad", max_retries=0).models.list()


def test_stop_strings(client, scheduler):
  full = greedy(client, PROMPTS[1], max_tokens=100).choices[0].text
  at = len(full) // 4  # early, so the request is still running when the stop string shows
  stop = full[at : at + 3]
  assert stop.strip() and stop in full
  expect = full[: full.index(stop)]
  before = scheduler.metrics()["requests_cancelled_total"]
  out = greedy(client, PROMPTS[1], max_tokens=100, stop=[stop, "never seen"], logprobs=0)
  assert out.choices[0].text == expect and out.choices[0].finish_reason == "stop"
  assert len(out.choices[0].logprobs.tokens) == out.usage.completion_tokens
  wait_for(lambda: scheduler.metrics()["requests_cancelled_total"] == before + 1)  # slot freed
  streamed = greedy(client, PROMPTS[1], max_tokens=100, stop=stop, stream=True)
  chunks = [c.choices[0] for c in streamed]
  assert "".join(c.text for c in chunks) == expect and chunks[-1].finish_reason == "stop"


def test_stop_token_ids(client, scheduler):
  tok = scheduler.engine.target.tokenizer
  full = greedy(client, PROMPTS[0], max_tokens=30, logprobs=0).choices[0]
  strings, offsets = full.logprobs.tokens, full.logprobs.text_offset
  # A token after the first few whose text is plain ASCII and one id on its own.
  i = next(i for i, t in enumerate(strings) if i >= 3 and t.isascii() and len(tok.encode(t)) == 1)
  cut = tok.encode(strings[i])[0]
  first = strings.index(strings[i])
  out = greedy(client, PROMPTS[0], max_tokens=30, extra_body={"stop_token_ids": [cut]})
  assert out.choices[0].finish_reason == "stop"
  assert out.choices[0].text == full.text[: offsets[first]]


def test_logprobs_are_present_and_finite(client):
  out = greedy(client, PROMPTS[0], max_tokens=8, logprobs=1).choices[0].logprobs
  assert len(out.tokens) == len(out.token_logprobs) == len(out.text_offset) > 0
  assert all(math.isfinite(x) and x <= 0 for x in out.token_logprobs)
  messages = [{"role": "user", "content": "hi"}]
  chat = client.chat.completions.create(
    model=MODEL, messages=messages, max_tokens=6, logprobs=True, temperature=0
  )
  content = chat.choices[0].logprobs.content
  assert len(content) == chat.usage.completion_tokens
  assert all(math.isfinite(c.logprob) and c.logprob <= 0 for c in content)
  assert bytes(b for c in content for b in c.bytes).decode() == chat.choices[0].message.content


def test_top_logprobs_are_the_alternatives(client, server):
  """Greedy: each token is its own most likely alternative, with its own log-prob; the
  alternatives come most likely first (completions: logprobs=N; chat: top_logprobs)."""
  out = greedy(client, PROMPTS[0], max_tokens=8, logprobs=3).choices[0].logprobs
  assert len(out.top_logprobs) == len(out.tokens) > 0
  for token, lp, alts in zip(out.tokens, out.token_logprobs, out.top_logprobs):
    assert 1 <= len(alts) <= 3  # (alternatives decoding to the same text share a key)
    assert alts[token] == pytest.approx(lp, abs=1e-5)
    assert max(alts.values()) == pytest.approx(lp, abs=1e-5)
  chat = client.chat.completions.create(
    model=MODEL,
    messages=[{"role": "user", "content": "hi"}],
    max_tokens=6,
    temperature=0,
    logprobs=True,
    top_logprobs=4,
  )
  for c in chat.choices[0].logprobs.content:
    values = [a.logprob for a in c.top_logprobs]
    assert len(values) == 4 and values == sorted(values, reverse=True)
    assert c.top_logprobs[0].token == c.token and values[0] == pytest.approx(c.logprob, abs=1e-5)
  body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "logprobs": True}
  status, body = raw(
    server, "POST", "/v1/chat/completions", json.dumps({**body, "top_logprobs": 6}).encode()
  )
  assert status == 400 and "at most 5" in body["error"]["message"]  # the server keeps 5


class _Refusing:
  """A scheduler whose submit raises `error`."""

  slots = 4

  def __init__(self, error, engine):
    self.error, self.engine = error, engine

  def submit(self, ids, options):
    raise self.error

  def submit_n(self, ids, options, n):
    return [self.submit(ids, options) for _ in range(n)]

  def metrics(self):
    return {}


class _Failing(_Refusing):
  """A scheduler whose requests end with finish_reason `reason` after one token."""

  def submit(self, ids, options):
    reason = self.error

    class Handle:
      prompt_tokens = len(ids)

      def cancel(self):
        pass

      async def __aiter__(self):
        yield Delta([481], None, None)
        yield Delta([], None, reason, "boom" if reason == "error" else None)

    return Handle()


@pytest.mark.parametrize("reason,status", [("error", 500), ("cancelled", 503)])
def test_engine_failure_is_reported(scheduler, reason, status):
  app = app_lib.create_app(_Failing(reason, scheduler.engine), MODEL)
  with background.BackgroundServer(app) as srv:
    body = {"model": MODEL, "prompt": "x"}
    got, out = raw(srv, "POST", "/v1/completions", json.dumps(body).encode())
    assert got == status and out["error"]["type"] == "server_error", out
    got, out = raw(srv, "POST", "/v1/completions", json.dumps({**body, "stream": True}).encode())
    events = [e for e in out.split("\n\n") if e]
    assert got == 200 and '"error"' in events[-2] and events[-1] == "data: [DONE]", events


@pytest.mark.parametrize(
  "error,status,retry", [(QueueFull("full"), 429, "1"), (SchedulerClosed("bye"), 503, "5")]
)
def test_queue_full_and_closed_say_when_to_retry(scheduler, error, status, retry):
  app = app_lib.create_app(_Refusing(error, scheduler.engine), MODEL)
  with background.BackgroundServer(app) as srv:
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=60)
    conn.request("POST", "/v1/completions", json.dumps({"model": MODEL, "prompt": "x"}))
    resp = conn.getresponse()
    out = json.loads(resp.read())
    assert resp.status == status and resp.getheader("Retry-After") == retry, out
    assert out["error"]["code"] in ("queue_full", "shutting_down")


def test_metrics_are_prometheus_text(server, client):
  greedy(client, "x", max_tokens=2)
  status, body = raw(server, "GET", "/metrics")
  assert status == 200
  samples = {}
  for line in body.splitlines():
    if line and not line.startswith("#"):
      name, value = line.rsplit(" ", 1)
      samples[name] = float(value)
  assert samples["jaxspec_requests_total"] >= 1
  assert "jaxspec_requests_running" in samples and "jaxspec_batch_occupancy" in samples
  assert samples['jaxspec_http_requests_total{endpoint="/v1/completions",status="200"}'] >= 1
  assert "# TYPE jaxspec_tokens_generated_total counter" in body


def test_shutdown_drains_a_stream_in_flight(scheduler):
  app = app_lib.create_app(scheduler, MODEL)
  srv = background.BackgroundServer(app)
  srv.__enter__()
  c = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=60)
  alone = greedy(c, PROMPTS[2], max_tokens=60).choices[0]
  chunks = iter(greedy(c, PROMPTS[2], max_tokens=60, stream=True))
  first = next(chunks)
  stopper = threading.Thread(target=srv.__exit__, args=(None, None, None))
  stopper.start()  # draining: new requests are refused, the stream goes on
  wait_for(lambda: app.state.drain.started)
  conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=60)
  conn.request("POST", "/v1/completions", json.dumps({"model": MODEL, "prompt": "x"}))
  refused = conn.getresponse()
  body = json.loads(refused.read())
  assert refused.status == 503 and refused.getheader("Retry-After") == "5", body
  assert body["error"]["code"] == "shutting_down"
  assert raw(srv, "GET", "/health") == (503, {"status": "draining"})
  assert not srv.server.should_exit  # still listening while the stream runs
  rest = [ch.choices[0] for ch in chunks]
  stopper.join(timeout=60)
  assert first.choices[0].text + "".join(ch.text for ch in rest) == alone.text
  assert rest[-1].finish_reason == alone.finish_reason
  assert srv.server.drained_idle and srv.server.drain_seconds < 30
  with pytest.raises(openai.APIConnectionError):
    c.models.list()


def test_a_request_past_its_deadline_is_cancelled_with_504(scheduler):
  app = app_lib.create_app(scheduler, MODEL, request_timeout_s=0.05)
  before = scheduler.metrics()["requests_cancelled_total"]
  with background.BackgroundServer(app) as srv:
    body = {"model": MODEL, "prompt": LONG, "max_tokens": 100, "temperature": 0}
    status, out = raw(srv, "POST", "/v1/completions", json.dumps(body).encode())
    assert status == 504 and out["error"]["code"] == "request_timeout", out
    status, out = raw(srv, "POST", "/v1/completions", json.dumps({**body, "stream": True}))
    events = [e for e in out.split("\n\n") if e]
    assert status == 200 and "request_timeout" in events[-2] and events[-1] == "data: [DONE]"
  wait_for(lambda: scheduler.metrics()["requests_cancelled_total"] == before + 2)
  wait_for(lambda: scheduler.metrics()["requests_running"] == 0)


def test_drain_deadline_calls_on_timeout_then_stops():
  """A drain whose requests outlive the deadline hands them to `on_timeout` (launch/serve.py
  cancels them: their clients get 503) and stops the server anyway."""
  drain = app_lib.Drain()
  assert drain.enter()  # a request that never finishes
  called = []
  config = uvicorn.Config(lambda *a: None, lifespan="off")
  server = draining.DrainingServer(config, drain, 0.2, on_timeout=lambda: called.append(1))
  server.handle_exit(signal.SIGTERM, None)  # the first signal drains ...
  assert drain.started and not drain.enter() and not server.should_exit
  assert server.wait_drained(timeout=10)
  assert called == [1] and server.should_exit and server.drained_idle is False
  assert 0.2 <= server.drain_seconds < 5
  drain.leave()
  assert drain.wait(0) and drain.in_flight == 0


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _answers(port: int) -> bool:
  try:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    conn.request("GET", "/health")
    return conn.getresponse().status == 200
  except OSError:
    return False


@pytest.mark.slow
def test_serve_script_drains_on_sigterm():
  """launch/serve.py end to end: it serves (paged K/V by default), and SIGTERM mid-stream
  drains: new requests get 503, the stream finishes, the process exits 0."""
  port = _free_port()
  script = os.path.join(os.path.dirname(os.path.dirname(__file__)), "launch", "serve.py")
  args = [
    sys.executable,
    script,
    "--method=plain",
    "--batch_size=2",
    "--max_len=128",
    f"--port={port}",
    "--model_name=m",
    "--api_key=",
  ]
  proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  try:
    started = []
    for line in proc.stdout:
      started.append(line)
      if line.startswith("serving"):
        break
    else:
      pytest.fail(f"the server exited with {proc.wait()}")
    # Paged K/V with the prefix cache unless told otherwise.
    assert any("pages of 16, prefix cache" in line for line in started), started
    # "serving" is printed just before uvicorn binds: wait until it answers.
    wait_for(lambda: _answers(port), timeout=60)
    c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
    chunks = iter(
      c.completions.create(
        model="m", prompt="def f(x):", max_tokens=100, temperature=0, stream=True
      )
    )
    next(chunks)
    proc.send_signal(signal.SIGTERM)
    # Draining: a new request is refused with 503 and Retry-After while the stream goes on.
    wait_for(lambda: not _answers(port), timeout=30)  # /health turns 503
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("POST", "/v1/completions", json.dumps({"model": "m", "prompt": "x"}))
    refused = conn.getresponse()
    assert refused.status == 503 and refused.getheader("Retry-After"), refused.read()
    rest = [ch.choices[0] for ch in chunks]
    assert rest[-1].finish_reason in ("stop", "length")
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out
    assert "drained in" in out and "stopped" in out
  finally:
    if proc.poll() is None:
      proc.kill()
