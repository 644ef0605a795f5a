"""Serve a model over the OpenAI HTTP API, with continuous batching over the speculative step.

Defaults to the bundled target and its best drafter (as launch/generate.py), bound to
127.0.0.1. See docs/serving.md for the API subset.

  python launch/serve.py                                    # http://127.0.0.1:8000/v1
  python launch/serve.py --method=dflash --verify=tree --batch_size=8 --max_len=2048
  JAXSPEC_API_KEY=sk-... python launch/serve.py --host=0.0.0.0 --port=8080

Ctrl-C or SIGTERM drains: new requests get 503 with Retry-After (and /health 503), the ones in
flight finish (up to --drain_timeout, then they are cancelled), then the server exits 0; a
second signal stops at once. K/V is paged with a prefix cache by default (--page_size=0 and
--noprefix_cache turn them off).

Several hosts: run it on each with --coordinator_address, --num_processes, --process_id (as
launch/generate.py) and a --mesh over all their devices; process 0 serves HTTP, the others
replay its scheduler's ticks and exit when it stops (docs/serving.md, "Multi-host").
"""

from __future__ import annotations

import ipaddress
import os
import signal
import sys

from absl import flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import uvicorn  # pylint: disable=wrong-import-position

from jaxspec import distributed  # pylint: disable=wrong-import-position
from jaxspec.errors import ConfigError  # pylint: disable=wrong-import-position
from jaxspec.serve import admission  # pylint: disable=wrong-import-position
from jaxspec.serve import app as app_lib  # pylint: disable=wrong-import-position
from jaxspec.serve import draining  # pylint: disable=wrong-import-position
from jaxspec.serve import multihost  # pylint: disable=wrong-import-position
from jaxspec.serve import scheduler as scheduler_lib  # pylint: disable=wrong-import-position
from jaxspec.serve import speculation  # pylint: disable=wrong-import-position
from jaxspec.speculative import prefix as prefix_lib  # pylint: disable=wrong-import-position
from launch import cli  # pylint: disable=wrong-import-position
from launch.cli import common_flags  # pylint: disable=wrong-import-position
from launch.cli import defaults  # pylint: disable=wrong-import-position

FLAGS = flags.FLAGS
defaults.define_model_flags()
distributed.define_flags()
flags.DEFINE_integer("batch_size", 4, "Slots: requests decoded together.", lower_bound=1)
common_flags.define_max_len(2048, "Per slot.")
common_flags.define_kv_format()
flags.DEFINE_integer(
  "page_size",
  None,
  "Paged K/V: positions per page of the pool that holds full-attention K/V (MLA: latents "
  "and DSA indexer keys); must divide --max_len (default: 16, or the largest power of two "
  "from 4 to 16 that divides --max_len; 0: off, every slot reserves max_len positions).",
  lower_bound=0,
)
flags.DEFINE_bool(
  "penalties",
  True,
  "Accept presence / frequency / repetition penalties and logit_bias (each slot counts its "
  "tokens: batch_size × vocabulary int32; off: such requests get 400).",
)
flags.DEFINE_integer(
  "top_logprobs",
  5,
  "Alternatives per token a request may ask for (completions' logprobs, chat's top_logprobs; "
  "each slot keeps max_len × this many; at most 20).",
  lower_bound=0,
  upper_bound=20,
)
flags.DEFINE_bool(
  "prefix_cache",
  True,
  "Paged K/V: keep prompts' full pages, so that a prompt starting with the same tokens "
  "prefills only the rest (off, with the reason printed, for targets whose state pages cannot "
  "hold: sliding windows, Gated DeltaNet).",
)
flags.DEFINE_integer(
  "warm_choices",
  4,
  "The most choices of one prompt (n, best_of) whose one-prefill groups are compiled at start "
  "(in power-of-two groups, up to --batch_size); a larger n compiles its group on first use.",
  lower_bound=1,
)
flags.DEFINE_string(
  "admission_reserve",
  "measured",
  "Paged K/V: the share (0 to 1) of running requests' remaining max_tokens whose pages "
  "admission keeps free (1: no request is ever preempted; 0: only the next tick's pages), or "
  "'measured': the mean share finished requests used, raised after a preemption.",
)
flags.DEFINE_enum(
  "speculation",
  "fixed",
  ["fixed", "auto"],
  "fixed: every step drafts the method's full budget; auto: each tick runs the budget (0, "
  "half or full, or --speculation_budgets) and row bucket worth the most tokens per second "
  "by measured step costs and acceptance.",
)
flags.DEFINE_list(
  "speculation_budgets", [], "--speculation=auto: the budgets offered (default 0, half, full)."
)
flags.DEFINE_list(
  "row_buckets",
  None,
  "Row counts below --batch_size that ticks may compact the live rows into (default with "
  "--speculation=auto: a quarter and a sixteenth of the batch; fixed: none).",
)
flags.DEFINE_integer(
  "kv_pages",
  0,
  "Paged K/V: pages in the pool (0: batch_size × max_len / page_size).",
  lower_bound=0,
)
flags.DEFINE_integer(
  "steps_per_tick",
  None,
  "Compiled steps between admissions (default: the scheduler's).",
  lower_bound=1,
)
flags.DEFINE_integer("max_queue", 256, "Waiting requests before 429s.", lower_bound=0)
flags.DEFINE_integer(
  "max_stop_ids",
  64,
  "Stop token ids a request may hold, the model's eos ids included (a static shape).",
  lower_bound=1,
)
flags.DEFINE_string("host", "127.0.0.1", "Address to bind (loopback by default).")
flags.DEFINE_integer("port", 8000, "Port to bind.", lower_bound=1, upper_bound=65535)
flags.DEFINE_string(
  "api_key",
  os.environ.get("JAXSPEC_API_KEY"),
  "Bearer key the /v1 routes require (default: $JAXSPEC_API_KEY; unset = none).",
)
flags.DEFINE_string(
  "model_name", None, "The model id clients send (default: --model or 'jaxspec')."
)
flags.DEFINE_integer("max_body_bytes", 1 << 20, "Request body limit (413 above).", lower_bound=1)
flags.DEFINE_float(
  "drain_timeout",
  300,
  "Seconds the first SIGTERM / Ctrl-C waits for in-flight requests (new ones get 503 with "
  "Retry-After meanwhile); those still running then are cancelled (503).",
  lower_bound=0,
)
flags.DEFINE_float(
  "request_timeout",
  600,
  "Seconds a generation request may run before it is cancelled and answered 504 (0: none).",
  lower_bound=0,
)


CANCELLED_REPLY_S = 10  # after the drain: time for cancelled requests' 503s to be sent


def _ignore(signum, frame) -> None:
  """Stands in for SIGINT/SIGTERM's default once uvicorn has drained and hands the signal on,
  so the scheduler is shut down here rather than the process killed."""
  del signum, frame


def main(argv):
  del argv
  # First: the backend learns the other processes' devices when it starts.
  joined = distributed.initialize(distributed.config_from_flags())
  reserve = admission.parse_admission_reserve(FLAGS.admission_reserve)
  try:
    loopback = ipaddress.ip_address(FLAGS.host).is_loopback
  except ValueError:
    raise ConfigError(f"--host={FLAGS.host}: expected an IP address") from None
  target, source = defaults.load_target(FLAGS.model)
  row_buckets = tuple(int(r) for r in FLAGS.row_buckets or ())
  if FLAGS.row_buckets is None and FLAGS.speculation == "auto":
    row_buckets = speculation.default_row_buckets(FLAGS.batch_size)
  page_size, why = admission.default_page_size(FLAGS.max_len, FLAGS.page_size)
  if not page_size:
    print(f"paged K/V and prefix cache: off ({why})", flush=True)
  prefix_cache = FLAGS.prefix_cache and page_size > 0
  why = prefix_cache and prefix_lib.why_uncacheable(
    target.config, FLAGS.max_len, FLAGS.kv_format, page_size
  )
  if why:
    print(f"prefix cache: off ({why})", flush=True)
    prefix_cache = False
  engine, _, label = defaults.engine_from_flags(
    target,
    mesh=defaults.mesh_from_flags(always=joined is not None),
    max_len=FLAGS.max_len,
    batch_size=FLAGS.batch_size,
    kv_format=FLAGS.kv_format,
    max_stop_ids=FLAGS.max_stop_ids,
    page_size=page_size,
    kv_pages=FLAGS.kv_pages,
    penalties=FLAGS.penalties,
    top_logprobs=FLAGS.top_logprobs,
    prefix_cache=prefix_cache,
    speculation=FLAGS.speculation,
    speculation_budgets=tuple(int(b) for b in FLAGS.speculation_budgets),
    row_buckets=row_buckets,
    warm_choices=min(FLAGS.warm_choices, FLAGS.batch_size),
  )
  if not distributed.is_leader():  # a follower: no HTTP, the leader's ticks until it stops
    print(f"process {joined.process_id}/{joined.num_processes}: following process 0", flush=True)
    ticks = multihost.follow(engine)
    print(f"stopped after {ticks} ticks", flush=True)
    return
  scheduler = scheduler_lib.Scheduler(
    engine,
    admission_reserve=reserve,
    max_queue=FLAGS.max_queue,
    steps_per_tick=FLAGS.steps_per_tick,
    channel=multihost.TickChannel() if joined else None,
  )
  name = FLAGS.model_name or FLAGS.model or "jaxspec"
  app = app_lib.create_app(
    scheduler,
    name,
    api_key=FLAGS.api_key or None,
    max_body_bytes=FLAGS.max_body_bytes,
    request_timeout_s=FLAGS.request_timeout or None,
  )
  kv = ""
  if page_size:
    kv = f"; K/V in {engine.config.num_pages} pages of {page_size}"
    kv += ", prefix cache" if prefix_cache else ""
  if FLAGS.speculation == "auto":
    kv += f"; speculation budgets {engine.budgets} on row buckets {engine.row_buckets}"
  print(
    f"target: {source}; method: {label}; {FLAGS.batch_size} slots of {FLAGS.max_len} tokens{kv}"
  )
  if not loopback and not FLAGS.api_key:
    print(f"warning: serving on {FLAGS.host} without an API key", file=sys.stderr)
  print("compiling and warming up ...", flush=True)
  scheduler.start()
  host = f"[{FLAGS.host}]" if ":" in FLAGS.host else FLAGS.host
  print(f"serving {name!r} on http://{host}:{FLAGS.port}/v1", flush=True)
  server = draining.DrainingServer(
    uvicorn.Config(
      app,
      host=FLAGS.host,
      port=FLAGS.port,
      lifespan="off",
      log_level="info",
      # Drained already: this only lets the cancelled requests' 503s go out.
      timeout_graceful_shutdown=CANCELLED_REPLY_S,
    ),
    app.state.drain,
    FLAGS.drain_timeout,
    on_timeout=lambda: scheduler.shutdown(drain=False, timeout=CANCELLED_REPLY_S),
  )
  previous = {sig: signal.signal(sig, _ignore) for sig in (signal.SIGINT, signal.SIGTERM)}
  try:
    server.run()  # returns once a signal arrived and the drain ended
  finally:
    for sig, handler in previous.items():
      signal.signal(sig, handler)
    scheduler.shutdown(drain=False, timeout=CANCELLED_REPLY_S)
  if server.drain_seconds is not None:
    left = "" if server.drained_idle else ", requests still running were cancelled"
    print(f"drained in {server.drain_seconds:.1f} s{left}", flush=True)
  print("stopped", flush=True)


if __name__ == "__main__":
  cli.run(main)
