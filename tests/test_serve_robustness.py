"""The server under abuse, on the bundled model served as `launch/serve.py` serves it by default
(paged K/V with a prefix cache): property tests of the request parser against the server's own
OpenAPI document, an API fuzzer (schemathesis), clients that vanish, and a soak of mixed
traffic.

The parser and the document must agree: a body that differs from a valid one in one field is
accepted exactly when the document says it is valid, and otherwise refused with a
BadParameter naming that field; no JSON body makes the parser raise anything else (the app
would answer 500). The fuzzer sends bodies generated from the document (valid ones, and
invalid ones it derives from it): no 5xx, every status and content type the document lists,
every error in OpenAI's shape, invalid data refused with a 4xx, no request past its deadline,
and afterwards every slot and page free again. The default run sends a few hundred requests;
the slow one thousands.

A client that goes away (a stream closed after its first chunk, a non-streaming request whose
client times out) frees its slot and pages within two scheduler ticks (the one running when
it left, the next). The soak sends mixed traffic (streams, n = 2, shared prefixes, cancelled
streams, timed-out clients, bad requests) from several threads and checks that slots, pages
and the process's resident memory return to their baseline.
"""

from __future__ import annotations

import collections
import concurrent.futures
import functools
import json
import random
import resource
import threading
import time

import jsonschema
import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import checks as st_checks

from jaxspec.serve import app as app_lib
from jaxspec.serve import openapi, protocol
from jaxspec.serve.background import BackgroundServer
from jaxspec.serve.scheduler import Scheduler
from launch.cli import defaults

MODEL = "jaxspec-fuzz"
SLOTS = 2
MAX_LEN = 128
PAGE = 16
REQUEST_S = 60  # a request past this (client side) is a hang
DOCUMENT = openapi.document(MODEL, SLOTS)
ROUTES = {"/v1/completions": "CompletionRequest", "/v1/chat/completions": "ChatRequest"}
CHECKS = [
  st_checks.not_a_server_error,
  st_checks.status_code_conformance,
  st_checks.content_type_conformance,
  st_checks.response_schema_conformance,
  st_checks.negative_data_rejection,
]
# Constraints between fields, which the document cannot state (checked at request time).
CROSS_FIELD = {"stream_options", "top_logprobs", "max_completion_tokens", "best_of"}
# What the server checks after parsing (the model served, choices within the slots), which the
# document states.
SERVER_CHECKED = {"model", "n", "best_of"}

# Object keys: any text, and the strings a token-id key check gets wrong (str.isdigit takes
# "²", int() refuses it).
KEYS = st.text(max_size=6) | st.sampled_from(["", "1", " 1", "²", "٣", "-1", "1.5", "9" * 30])
JSON = st.recursive(
  st.none()
  | st.booleans()
  | st.integers(-(2**64), 2**64)
  | st.integers(-3, 300)
  | st.floats(allow_nan=False, allow_infinity=False)
  | st.floats(-3, 3)
  | st.text(max_size=8),
  lambda inner: st.lists(inner, max_size=4) | st.dictionaries(KEYS, inner, max_size=4),
  max_leaves=8,
)
BASES = {
  "CompletionRequest": {"model": MODEL, "prompt": "x"},
  "ChatRequest": {"model": MODEL, "messages": [{"role": "user", "content": "x"}]},
}


def validator(name: str) -> jsonschema.Draft202012Validator:
  """The document's schema of request body `name` (its $refs resolved within the document)."""
  root = {"$ref": f"#/components/schemas/{name}", "components": DOCUMENT["components"]}
  return jsonschema.Draft202012Validator(root)


@pytest.mark.parametrize("name", sorted(BASES))
def test_the_parser_and_the_document_agree_field_by_field(name):
  model = getattr(protocol, name)
  schema = validator(name)
  assert schema.is_valid(BASES[name])
  fields = sorted(model.model_fields)

  @settings(max_examples=250, deadline=None, derandomize=True, database=None)
  @given(field=st.sampled_from(fields), value=JSON)
  def one_field(field, value):
    body = {**BASES[name], field: value}
    try:
      protocol.parse(model, body)
      accepted = True
    except protocol.BadParameter as e:
      accepted = False
      assert e.param == field, (body, str(e), e.param)
    valid = schema.is_valid(body)
    if accepted:  # the document refuses only what the server refuses later
      assert valid or field in SERVER_CHECKED, body
    else:  # what the document allows, the parser accepts
      assert not valid or field in CROSS_FIELD, body

  one_field()


@settings(max_examples=200, deadline=None, derandomize=True, database=None)
@given(bias=st.dictionaries(KEYS, st.integers(-100, 100), min_size=1, max_size=3))
def test_logit_bias_keys_are_ascii_token_ids(bias):
  body = {**BASES["CompletionRequest"], "logit_bias": bias}
  try:
    ids = protocol.parse(protocol.CompletionRequest, body).logit_bias_ids
  except protocol.BadParameter as e:
    assert e.param == "logit_bias" and not validator("CompletionRequest").is_valid(body)
  else:
    assert [str(i) for i, _ in ids] == sorted(bias, key=int)


@settings(max_examples=150, deadline=None, derandomize=True, database=None)
@given(body=st.dictionaries(st.sampled_from(sorted(protocol.ChatRequest.model_fields)), JSON))
def test_no_body_makes_the_parser_fail_otherwise(body):
  for model in (protocol.CompletionRequest, protocol.ChatRequest):
    try:
      protocol.parse(model, body)
    except protocol.BadParameter:
      pass


@pytest.fixture(scope="module")
def scheduler():
  target, _ = defaults.load_target(None)
  engine, _ = defaults.make_engine(
    target,
    "plain",
    draft_dir=None,
    verify="chain",
    tree_budget=0,
    max_len=MAX_LEN,
    batch_size=SLOTS,
    min_prompt_bucket=MAX_LEN,
    page_size=PAGE,
    prefix_cache=True,
    penalties=True,
    top_logprobs=5,
  )
  sched = Scheduler(engine, max_queue=8, steps_per_tick=4)
  sched.start()
  yield sched
  sched.shutdown(drain=False, timeout=60)


@pytest.fixture(scope="module")
def server(scheduler):
  app = app_lib.create_app(scheduler, MODEL, max_body_bytes=1 << 16, request_timeout_s=REQUEST_S)
  with BackgroundServer(app) as srv:
    yield srv


def served_document_is_the_module_document(server):
  got = requests.get(server.url + "/openapi.json", timeout=10).json()
  assert got == json.loads(json.dumps(DOCUMENT)), "the server publishes another document"


def fuzz(server, scheduler, examples: int) -> collections.Counter:
  """`examples` valid and `examples` invalid cases of each generation route; returns the
  responses' status counts. Fails on the first check a response breaks."""
  served_document_is_the_module_document(server)
  schema = schemathesis.openapi.from_dict(DOCUMENT)
  counts: collections.Counter = collections.Counter()
  session = requests.Session()
  slowest = [0.0]
  for path in ROUTES:
    for mode in (schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE):
      strategy = schema[path]["POST"].as_strategy(generation_mode=mode)

      @settings(
        max_examples=examples,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=list(HealthCheck),
      )
      @given(case=strategy)
      def one_case(case):
        start = time.monotonic()
        response = case.call(base_url=server.url, session=session, timeout=REQUEST_S)
        slowest[0] = max(slowest[0], time.monotonic() - start)
        counts[response.status_code] += 1
        case.validate_response(response, checks=CHECKS)
        if response.status_code >= 400:  # OpenAI's error shape, the field named when known
          error = response.json()["error"]
          assert set(error) == {"message", "type", "param", "code"}, error
          assert error["message"] and error["type"], error
          whole_body = error["message"].startswith(("the body", "the request body"))
          if response.status_code == 400 and not whole_body:
            assert error["param"], error  # the field at fault is named
          counts[f"{response.status_code} {error['param']}"] += 1

      one_case()
  # Every request has ended: the slots, pages and prefix-cache holds are free again.
  deadline = time.monotonic() + 30
  while scheduler.metrics()["requests_running"] or scheduler.metrics()["requests_waiting"]:
    assert time.monotonic() < deadline, scheduler.metrics()
    time.sleep(0.05)
  metrics = scheduler.metrics()
  # No row holds a page; the prefix cache's pages are idle (evictable), none held for a row.
  assert metrics["kv_pages_used"] == 0 and metrics["batch_occupancy"] == 0, metrics
  counts["slowest_s"] = round(slowest[0], 2)
  return counts


def test_fuzzed_requests_get_no_5xx_and_leak_nothing(server, scheduler):
  counts = fuzz(server, scheduler, examples=25)
  statuses = {k: v for k, v in counts.items() if isinstance(k, int)}
  assert sum(statuses.values()) >= 4 * 25 * 0.9, counts  # hypothesis may stop a little early
  assert not any(s >= 500 for s in statuses), counts
  assert statuses.get(200) and statuses.get(400), counts  # both kinds were reached
  print("fuzzed:", dict(counts))


@pytest.mark.slow
def test_thousands_of_fuzzed_requests(server, scheduler):
  counts = fuzz(server, scheduler, examples=750)
  assert not any(isinstance(s, int) and s >= 500 for s in counts), counts
  print("fuzzed:", dict(counts))


def idle_metrics(scheduler, timeout: float = 30) -> dict:
  """The scheduler's metrics once no request runs or waits."""
  deadline = time.monotonic() + timeout
  while True:
    m = scheduler.metrics()
    if not (m["requests_running"] or m["requests_waiting"]):
      return m
    assert time.monotonic() < deadline, m
    time.sleep(0.01)


def ticks_until_free(scheduler, steps_before: int) -> float:
  """Scheduler ticks from `steps_before` until no request runs and no row holds a page."""
  m = idle_metrics(scheduler)
  assert m["kv_pages_used"] == 0, m
  return (m["steps_total"] - steps_before) / scheduler.steps_per_tick


LONG = "def fib(n):"  # the bundled model does not stop within 100 tokens after it


def test_vanished_clients_free_their_slots_and_pages_within_two_ticks(server, scheduler):
  body = {"model": MODEL, "prompt": LONG, "max_tokens": 100, "temperature": 0}
  idle_metrics(scheduler)
  cancelled = scheduler.metrics()["requests_cancelled_total"]
  # A stream closed after its first chunk.
  response = requests.post(
    server.url + "/v1/completions", json={**body, "stream": True}, stream=True, timeout=30
  )
  next(response.iter_lines())
  assert scheduler.metrics()["kv_pages_used"] > 0  # it holds pages while it runs
  steps = scheduler.metrics()["steps_total"]
  response.close()
  stream_ticks = ticks_until_free(scheduler, steps)
  # A non-streaming request whose client gives up.
  with pytest.raises(requests.Timeout):
    requests.post(server.url + "/v1/completions", json=body, timeout=0.2)
  waited_ticks = ticks_until_free(scheduler, scheduler.metrics()["steps_total"])
  m = scheduler.metrics()
  assert m["requests_cancelled_total"] == cancelled + 2, m
  assert stream_ticks <= 2 and waited_ticks <= 2, (stream_ticks, waited_ticks)
  tokens = m["tokens_generated_total"]
  time.sleep(0.2)
  assert scheduler.metrics()["tokens_generated_total"] == tokens  # no work for nobody
  print(f"ticks to free: closed stream {stream_ticks}, timed-out client {waited_ticks}")


SHARED = "You are a careful assistant. Answer briefly.\n" * 3


def one_request(url: str, rng: random.Random) -> str:
  """One request of the soak's mix; returns its kind and outcome."""
  kind = rng.choice(["plain", "stream", "chat", "n2", "cancel", "gone", "bad", "badjson"])
  prompt = SHARED + rng.choice(["def f(x):", "import os", "x = ", "# sum"])
  body = {"model": MODEL, "prompt": prompt, "max_tokens": rng.randint(1, 24)}
  body["temperature"] = rng.choice([0, 0.7, 1.0])
  post = functools.partial(requests.post, timeout=REQUEST_S)
  if kind == "plain":
    status = post(url + "/v1/completions", json=body).status_code
  elif kind == "n2":
    status = post(url + "/v1/completions", json={**body, "n": 2, "temperature": 1}).status_code
  elif kind == "chat":
    chat = {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": 8}
    status = post(url + "/v1/chat/completions", json=chat).status_code
  elif kind in ("stream", "cancel"):
    r = post(url + "/v1/completions", json={**body, "stream": True, "max_tokens": 40}, stream=True)
    status = r.status_code
    lines = r.iter_lines()
    if kind == "cancel":
      next(lines)
    else:
      assert [line for line in lines if line][-1] == b"data: [DONE]"
    r.close()
  elif kind == "gone":
    try:
      status = requests.post(
        url + "/v1/completions", json={**body, "max_tokens": 40}, timeout=0.05
      ).status_code
    except requests.Timeout:
      status = 0
  elif kind == "bad":
    status = post(url + "/v1/completions", json={**body, "top_p": 2}).status_code
  else:
    status = post(url + "/v1/completions", data=b"{nope").status_code
  return f"{kind} {status}"


def rss_mb() -> float:
  """This process's resident memory now (MB), from /proc (the high-water mark never falls)."""
  with open("/proc/self/statm") as f:
    return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def soak(server, scheduler, seconds: float, threads: int = 4) -> dict:
  """Mixed traffic for `seconds` from `threads` threads; returns the outcomes and drifts."""
  stop = time.monotonic() + seconds
  outcomes: collections.Counter = collections.Counter()
  lock = threading.Lock()

  def worker(seed: int) -> None:
    rng = random.Random(seed)
    while time.monotonic() < stop:
      got = one_request(server.url, rng)
      with lock:
        outcomes[got] += 1

  with concurrent.futures.ThreadPoolExecutor(threads) as pool:
    for f in [pool.submit(worker, i) for i in range(threads)]:
      f.result()
  return dict(outcomes)


def soak_and_check(server, scheduler, seconds: float) -> None:
  soak(server, scheduler, min(5.0, seconds / 4))  # warm: compiled programs, caches, pools
  base, rss0 = idle_metrics(scheduler), rss_mb()
  outcomes = soak(server, scheduler, seconds)
  end, rss1 = idle_metrics(scheduler), rss_mb()
  assert not [k for k in outcomes if int(k.split()[1]) >= 500], outcomes
  odd = [k for k in outcomes if not k.startswith("bad") and k.split()[1] not in ("200", "0")]
  assert not odd, outcomes
  assert all(k.split()[1] == "400" for k in outcomes if k.startswith("bad")), outcomes
  assert end["kv_pages_used"] == 0 and end["batch_occupancy"] == 0, end
  assert end["requests_total"] - base["requests_total"] >= sum(outcomes.values()) // 2, end
  drift = rss1 - rss0
  print(
    f"soak {seconds:.0f} s: {sum(outcomes.values())} requests {outcomes}; RSS "
    f"{rss0:.0f} -> {rss1:.0f} MB; pages used {end['kv_pages_used']}, "
    f"prefix-cache pages {end['prefix_cache_pages']}"
  )
  assert drift < 64, f"resident memory grew {drift:.0f} MB"


def test_a_short_soak_returns_to_baseline(server, scheduler):
  soak_and_check(server, scheduler, 8)


@pytest.mark.slow
def test_a_ten_minute_soak_returns_to_baseline(server, scheduler):
  soak_and_check(server, scheduler, 600)
