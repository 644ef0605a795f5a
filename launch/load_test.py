"""A bounded load test of the OpenAI server: many concurrent requests, every output checked.

Starts its own server on loopback (the bundled target and its best drafter, as launch/serve.py)
or uses a running one given by --url (loopback addresses only). It first serves each of
--distinct greedy prompts alone, then sends --requests requests (each prompt repeated, in a
shuffled order, a third of them streamed, one in five asking for n = 2 choices) at
--concurrency, and checks that every one succeeds and returns exactly its prompt's
served-alone text in every choice: a lost, truncated or mixed-up output fails the run (exit
status 1). Half the prompts open with the same long system text (a shared prefix). Its own
server keeps the K/V in pages (--page_size) of a pool smaller than its slots × max_len
(--kv_pages), so rows grow page by page, share prompt pages (n = 2) and wait for pages at
admission (the measured admission reserve; preempted where it falls short), and it caches
prompts' full pages (--prefix_cache), so the shared opening is prefilled once. It
reports p50/p99 latency and throughput, and stops by itself: after the last request, or at
--time_limit seconds.

  python launch/load_test.py                               # 200 requests, concurrency 16
  python launch/load_test.py --url=http://127.0.0.1:8000 --model_name=jaxspec
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import os
import random
import sys
import time
import urllib.parse

from absl import flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # pylint: disable=wrong-import-position
import openai  # pylint: disable=wrong-import-position

from jaxspec.errors import ConfigError  # pylint: disable=wrong-import-position
from launch import cli  # pylint: disable=wrong-import-position
from launch.cli import common_flags  # pylint: disable=wrong-import-position
from launch.cli import defaults  # pylint: disable=wrong-import-position

FLAGS = flags.FLAGS
flags.DEFINE_string("url", None, "A running server (loopback only); default: start one here.")
flags.DEFINE_string("model_name", "jaxspec", "The model id to request.")
flags.DEFINE_string(
  "api_key", os.environ.get("JAXSPEC_API_KEY"), "Bearer key, if the server has one."
)
flags.DEFINE_integer("requests", 200, "Requests to send.", lower_bound=1)
flags.DEFINE_integer("concurrency", 16, "Requests in flight at once.", lower_bound=1)
flags.DEFINE_integer("distinct", 20, "Distinct greedy prompts (each repeated).", lower_bound=1)
flags.DEFINE_integer("max_tokens", 32, "Tokens per request.", lower_bound=1)
flags.DEFINE_float("time_limit", 600, "Seconds after which the run stops (and fails).")
flags.DEFINE_integer("seed", 0, "Shuffles the request order.")
# Only when starting its own server:
defaults.define_model_flags()
flags.DEFINE_integer("batch_size", 8, "Slots (own server).", lower_bound=1)
common_flags.define_max_len(256, "Per slot (own server).")
flags.DEFINE_integer("steps_per_tick", None, "Steps between admissions (own server).")
flags.DEFINE_integer("page_size", 16, "Paged K/V page size (own server; 0: contiguous).")
flags.DEFINE_integer("kv_pages", 40, "Pages in the K/V pool (own server; 0: slots × max_len).")
flags.DEFINE_bool("prefix_cache", True, "Cache prompts' full pages (own server, paged K/V).")

# A shared opening (a system prompt's worth of text) for half the prompts.
SHARED = (
  '"""Utilities for reading and writing configuration files.\n\n'
  "This module provides helpers used across the package: parsing, validation and the\n"
  'defaults every caller relies on.\n"""\n\nimport os\nimport sys\n\n'
)

# Source-code openings (the bundled model was trained on Python's standard library), of
# different lengths so the batch mixes prompt sizes.
OPENINGS = (
  "def fib(n):",
  "import os\n",
  "class Stack:\n    def push(self, item):",
  "def read_config(path):\n    with open(path) as f:",
  "for i in range(10):",
  "# Copyright 2001 Python Software Foundation\n",
  "def __init__(self, name, value=None):",
  "try:\n    import threading\nexcept ImportError:",
  "def main():\n    parser = argparse.ArgumentParser()",
  "if __name__ == '__main__':",
  'class Error(Exception):\n    """Base class for exceptions in this module."""',
  "def _strip(s):\n    return",
  "    def __repr__(self):",
  "def test_basic(self):\n        self.assertEqual(",
  "from collections import namedtuple\n",
  "def encode(data, errors='strict'):",
  "    @property\n    def size(self):",
  "while True:\n    line = f.readline()",
  "def walk(top, topdown=True, onerror=None):",
  "x = [",
)


def _prompt(i: int) -> str:
  base = OPENINGS[i % len(OPENINGS)]
  text = base if i < len(OPENINGS) else f"# variant {i}\n{base}"
  return SHARED + text if i % 2 else text


def _check_loopback(url: str) -> str:
  host = urllib.parse.urlparse(url).hostname or ""
  try:
    ok = host == "localhost" or ipaddress.ip_address(host).is_loopback
  except ValueError:
    ok = False
  if not ok:
    raise ConfigError(f"--url={url}: the load test only talks to loopback addresses")
  return url.rstrip("/")


async def _one(client, prompt: str, stream: bool, n: int = 1) -> tuple[list[str], int, float]:
  """(each choice's text, completion tokens, seconds) of one greedy request."""
  start = time.perf_counter()
  args = dict(model=FLAGS.model_name, prompt=prompt, max_tokens=FLAGS.max_tokens, temperature=0)
  if stream:
    parts, tokens = [[] for _ in range(n)], 0
    events = await client.completions.create(
      stream=True, stream_options={"include_usage": True}, n=n, **args
    )
    async for chunk in events:
      for choice in chunk.choices:
        parts[choice.index].append(choice.text)
      if chunk.usage:
        tokens = chunk.usage.completion_tokens
    return ["".join(p) for p in parts], tokens, time.perf_counter() - start
  out = await client.completions.create(n=n, **args)
  texts = [c.text for c in sorted(out.choices, key=lambda c: c.index)]
  return texts, out.usage.completion_tokens, time.perf_counter() - start


async def _run(url: str) -> dict:
  client = openai.AsyncOpenAI(
    base_url=url + "/v1",
    api_key=FLAGS.api_key or "none",
    max_retries=0,
    timeout=FLAGS.time_limit,
  )
  prompts = [_prompt(i) for i in range(FLAGS.distinct)]
  alone = [(await _one(client, p, stream=False))[0][0] for p in prompts]  # the references
  order = [i % FLAGS.distinct for i in range(FLAGS.requests)]
  random.Random(FLAGS.seed).shuffle(order)
  gate = asyncio.Semaphore(FLAGS.concurrency)
  results: list = [None] * len(order)

  async def worker(k: int, i: int) -> None:
    async with gate:
      try:
        results[k] = await _one(client, prompts[i], stream=k % 3 == 0, n=2 if k % 5 == 0 else 1)
      except openai.OpenAIError as e:
        results[k] = e

  start = time.perf_counter()
  await asyncio.gather(*(worker(k, i) for k, i in enumerate(order)))
  wall = time.perf_counter() - start
  errors = [r for r in results if isinstance(r, Exception)]
  done = [(k, r) for k, r in enumerate(results) if not isinstance(r, Exception)]
  mismatched = [k for k, r in done if any(text != alone[order[k]] for text in r[0])]
  latencies = np.array([r[2] for _, r in done]) if done else np.zeros(1)
  tokens = sum(r[1] for _, r in done)
  await client.close()
  return dict(
    requests=len(order),
    errors=errors,
    mismatched=mismatched,
    wall=wall,
    tokens=tokens,
    p50=float(np.percentile(latencies, 50)),
    p99=float(np.percentile(latencies, 99)),
  )


def _own_server():
  """(context manager serving on loopback, the scheduler, a description) for the flags."""
  from jaxspec.serve import app as app_lib  # pylint: disable=import-outside-toplevel
  from jaxspec.serve import background  # pylint: disable=import-outside-toplevel
  from jaxspec.serve import scheduler as scheduler_lib  # pylint: disable=import-outside-toplevel

  target, source = defaults.load_target(FLAGS.model)
  engine, _, label = defaults.engine_from_flags(
    target,
    mesh=defaults.mesh_from_flags(),
    max_len=FLAGS.max_len,
    batch_size=FLAGS.batch_size,
    page_size=FLAGS.page_size,
    kv_pages=FLAGS.kv_pages if FLAGS.page_size else 0,
    prefix_cache=FLAGS.prefix_cache and FLAGS.page_size > 0,
    warm_choices=min(2, FLAGS.batch_size),  # its n = 2 requests compile nothing while served
  )
  sched = scheduler_lib.Scheduler(engine, steps_per_tick=FLAGS.steps_per_tick)
  sched.start()
  app = app_lib.create_app(sched, FLAGS.model_name, api_key=FLAGS.api_key or None)
  kv = f", K/V in {engine.config.num_pages} pages of {FLAGS.page_size}" if FLAGS.page_size else ""
  kv += ", prefix cache" if engine.config.prefix_cache else ""
  what = f"{source}, {label}, {FLAGS.batch_size} slots{kv}"
  return background.BackgroundServer(app), sched, what


def _load(url: str, what: str, sched) -> None:
  """Runs the load against `url`, prints the report; exits with status 1 on any failure."""
  print(
    f"load test: {FLAGS.requests} requests at concurrency {FLAGS.concurrency} "
    f"({FLAGS.distinct} greedy prompts, {FLAGS.max_tokens} tokens each) against {what}",
    flush=True,
  )
  try:
    r = asyncio.run(asyncio.wait_for(_run(url), FLAGS.time_limit))
  except asyncio.TimeoutError:
    print(f"FAILED: not finished within --time_limit={FLAGS.time_limit:g} s")
    sys.exit(1)
  ok = r["requests"] - len(r["errors"])
  print(
    f"ok {ok}/{r['requests']}, errors {len(r['errors'])}, mismatched outputs {len(r['mismatched'])}"
  )
  print(
    f"latency p50 {r['p50']:.3f} s, p99 {r['p99']:.3f} s; throughput "
    f"{ok / r['wall']:.2f} req/s, {r['tokens'] / r['wall']:.1f} tok/s over {r['wall']:.1f} s"
  )
  if sched is not None:
    m = sched.metrics()
    print(
      f"scheduler: acceptance length {m.get('acceptance_length', float('nan')):.2f}, "
      f"mean step {1e3 * m.get('step_seconds_avg', float('nan')):.1f} ms, "
      f"preemptions {m.get('preemptions_total', 0)}, "
      f"prompt tokens prefilled {m.get('prompt_tokens_prefilled_total', 0)}, "
      f"read from the prefix cache {m.get('prefix_cache_hit_tokens_total', 0)}"
    )
  for e in r["errors"][:5]:
    print(f"  error: {type(e).__name__}: {e}")
  if r["errors"] or r["mismatched"]:
    sys.exit(1)


def main(argv):
  del argv
  for name in ("httpx", "httpx2"):  # a log line per request otherwise
    logging.getLogger(name).setLevel(logging.WARNING)
  if FLAGS.url:
    _load(_check_loopback(FLAGS.url), FLAGS.url, None)
    return
  server, sched, what = _own_server()
  try:
    with server:
      _load(server.url, what, sched)
  finally:
    sched.shutdown(drain=False)


if __name__ == "__main__":
  cli.run(main)
