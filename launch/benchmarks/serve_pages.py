"""Paged against contiguous K/V at one KV memory budget: how many requests run at once.

A contiguous engine reserves max_len positions of every full-attention layer per slot, so a
budget of S × max_len positions serves S requests at a time whatever their lengths. A paged
engine (`EngineConfig(page_size=..., kv_pages=S × max_len / page_size)`) holds the same pool of
positions in pages and gives each row only the pages its text reaches, so more rows fit when
requests are shorter than max_len. For each method, both engines serve the same burst of
requests of mixed lengths (all submitted at once, greedy), and the run reports, from one run:

* the target's K/V bytes of each engine (equal by construction) and the drafter's state bytes
  (per row in both: drafter caches are not paged);
* the most requests running at once, the wall time of the burst, tokens/s, the mean latency
  and the preemptions (rows freed when the pool ran out, resumed later by recomputation);
* the ratios paged / contiguous.

The paged engine serves the burst once per admission reserve (`--admission_reserves`: the
share of the running requests' remaining tokens whose pages admission keeps free; 0 keeps
none, 'measured' the share finished requests used): how many run at once against how many are
preempted and recomputed.

Then, with `--shared_prefix` > 0, the paged engine serves the burst again with every prompt
behind the same opening of that many tokens (a system prompt), without and with the prefix
cache (`EngineConfig(prefix_cache=True)`): prompt tokens prefilled, tokens read from cached
pages, the bytes of the kept drafter features, tokens/s and the mean latency.

  python launch/bench.py serve-pages                          # plain and EAGLE-3, ~10 min
  python launch/bench.py serve-pages --methods=plain --requests=32 --shared_prefix=0

A script, not a test: on this CPU a step over more rows costs more (compute-bound), so the
throughput gain is smaller than the concurrency gain; on an accelerator a decode step's cost
stays near flat in the rows until it is compute-bound.
"""

from __future__ import annotations

import json
import threading
import time
from typing import Any, Optional, Sequence

from absl import flags
import numpy as np

import jaxspec
from jaxspec.drafters import registry
from jaxspec.serve import SamplingOptions, Scheduler
from jaxspec.serve.scheduler import parse_admission_reserve
from jaxspec.train import data as data_lib
from launch.cli import common_flags
from launch.benchmarks.serve import build_engine

FLAGS = flags.FLAGS


def define_flags() -> None:
  """This benchmark's flags (defined when it runs)."""
  flags.DEFINE_list("methods", ["plain", "eagle3"], "plain, eagle3, dflash-ddtree.")
  flags.DEFINE_integer("budget_rows", 4, "The KV budget, in contiguous rows of max_len.")
  flags.DEFINE_integer("rows", 32, "The paged engine's rows (slots).")
  flags.DEFINE_integer("page_size", 16, "Positions per page.")
  flags.DEFINE_integer("requests", 64, "Requests in the burst.")
  flags.DEFINE_integer("max_tokens", 64, "Tokens per request (greedy; EOS stops early).")
  flags.DEFINE_integer("min_prompt", 16, "Shortest prompt, in tokens.")
  flags.DEFINE_integer("max_prompt", 384, "Longest prompt, in tokens.")
  flags.DEFINE_integer("tree_budget", 22, "DDTree draft nodes per step.")
  flags.DEFINE_integer("steps_per_tick", 4, "Engine steps per scheduler round trip.")
  flags.DEFINE_list(
    "admission_reserves",
    ["0", "measured"],
    "The paged engine's admission reserves (Scheduler(admission_reserve=)): a share of the "
    "running requests' remaining tokens in [0, 1], or 'measured'; each serves the burst.",
  )
  flags.DEFINE_integer(
    "shared_prefix", 256, "Tokens of the shared opening for the prefix-cache part (0: skip)."
  )
  common_flags.define_max_len(1024)
  common_flags.define_out("/tmp/jaxspec_bench_serve_pages.json", "results JSON")


def mixed_prompts(target: jaxspec.TargetModel, n: int, seed: int = 0) -> list[list[int]]:
  """n prompts of lengths drawn uniformly from [min_prompt, max_prompt] tokens, cut from the
  validation split's source files (long snippets, so that every length is real text)."""
  rng = np.random.default_rng(seed)
  texts = data_lib.function_prompts("validation", n=4 * n, max_lines=60, body_lines=40, seed=seed)
  pieces = [target.tokenizer.encode(t) for t in texts]
  stream = [t for ids in pieces for t in ids]
  out = []
  for _ in range(n):
    size = int(rng.integers(FLAGS.min_prompt, FLAGS.max_prompt + 1))
    at = int(rng.integers(0, max(len(stream) - size, 1)))
    out.append(stream[at : at + size])
  return out


def serve_burst(scheduler: Scheduler, prompts: Sequence[list[int]]) -> dict[str, Any]:
  """Every prompt submitted at once; watches how many run together until all finish."""
  options = SamplingOptions(max_tokens=FLAGS.max_tokens, temperature=0.0, seed=0)
  peak, stop = [0], threading.Event()

  def watch() -> None:
    while not stop.is_set():
      peak[0] = max(peak[0], int(scheduler.metrics()["requests_running"]))
      time.sleep(0.002)

  watcher = threading.Thread(target=watch, daemon=True)
  before = scheduler.metrics()
  t0 = time.perf_counter()
  watcher.start()
  handles = [scheduler.submit(ids, options) for ids in prompts]
  latencies, tokens = [], 0
  for h in handles:
    out, _, _ = h.result()
    tokens += len(out)
    latencies.append(time.perf_counter() - h.submitted)
  wall = time.perf_counter() - t0
  stop.set()
  watcher.join()
  after = scheduler.metrics()
  return {
    "requests": len(prompts),
    "tokens": tokens,
    "wall_s": wall,
    "throughput_tok_s": tokens / wall,
    "latency_mean_s": float(np.mean(latencies)),
    "running_peak": peak[0],
    "preemptions": after["preemptions_total"] - before["preemptions_total"],
    "acceptance_length": after["acceptance_length"],
    "prefilled": after["prompt_tokens_prefilled_total"] - before["prompt_tokens_prefilled_total"],
    "cache_hits": (
      after["prefix_cache_hit_tokens_total"] - before["prefix_cache_hit_tokens_total"]
    ),
  }


def table(results: dict[str, dict[str, dict]]) -> list[str]:
  lines = [
    f"{'method':<14}{'kv':<22}{'rows':>5}{'KV MiB':>8}{'drafter MiB':>12}{'peak':>6}"
    f"{'tok/s':>8}{'latency s':>11}{'preempt':>9}"
  ]
  for method, by_kind in results.items():
    for kind, r in by_kind.items():
      lines.append(
        f"{method:<14}{kind:<22}{r['rows']:>5}{r['kv_bytes'] / 2**20:>8.1f}"
        f"{r['drafter_bytes'] / 2**20:>12.1f}{r['running_peak']:>6}{r['throughput_tok_s']:>8.1f}"
        f"{r['latency_mean_s']:>11.2f}{r['preemptions']:>9}"
      )
    c = by_kind["contiguous"]
    for kind, p in by_kind.items():
      if kind == "contiguous":
        continue
      lines.append(
        f"{method:<14}{kind + '/contig':<22}{'':>5}{'':>8}{'':>12}"
        f"{p['running_peak'] / max(c['running_peak'], 1):>5.1f}×"
        f"{p['throughput_tok_s'] / c['throughput_tok_s']:>7.2f}×"
        f"{p['latency_mean_s'] / c['latency_mean_s']:>10.2f}×"
      )
  return lines


def prefix_table(results: dict[str, dict[str, dict]]) -> list[str]:
  lines = [
    f"{'method':<14}{'prefix cache':<14}{'prefilled':>10}{'from cache':>11}{'features MiB':>13}"
    f"{'tok/s':>8}{'latency s':>11}{'preempt':>9}"
  ]
  for method, by_kind in results.items():
    for kind, r in by_kind.items():
      lines.append(
        f"{method:<14}{kind:<14}{r['prefilled']:>10}{r['cache_hits']:>11}"
        f"{r['feature_bytes'] / 2**20:>13.1f}{r['throughput_tok_s']:>8.1f}"
        f"{r['latency_mean_s']:>11.2f}{r['preemptions']:>9}"
      )
    off, on = by_kind["off"], by_kind["on"]
    lines.append(
      f"{method:<14}{'on/off':<14}{on['prefilled'] / max(off['prefilled'], 1):>9.2f}×{'':>11}"
      f"{'':>13}{on['throughput_tok_s'] / off['throughput_tok_s']:>7.2f}×"
      f"{on['latency_mean_s'] / off['latency_mean_s']:>10.2f}×"
    )
  return lines


def _serve(
  target, method: str, prompts, slots: int, reserve: Optional[float] = None, **extra: Any
) -> dict[str, Any]:
  """One engine (`build_engine`) serving the burst; its result with its memory."""
  engine = build_engine(target, method, slots, **extra)
  scheduler = Scheduler(
    engine,
    max_queue=len(prompts),
    steps_per_tick=FLAGS.steps_per_tick,
    admission_reserve=reserve,
  )
  scheduler.start()  # compiles (warm_up_slots) before the clock
  try:
    r = serve_burst(scheduler, prompts)
  finally:
    scheduler.shutdown(drain=False, timeout=600)
  plan = engine.memory
  r.update(
    rows=engine.config.batch_size,
    kv_bytes=plan.target_state,
    drafter_bytes=plan.drafter_state,
    feature_bytes=engine.prefix_feature_bytes,
  )
  return r


def main(argv: Sequence[str]) -> None:
  del argv
  if FLAGS.max_len % FLAGS.page_size:
    raise SystemExit(f"--page_size={FLAGS.page_size} must divide --max_len={FLAGS.max_len}")
  target = jaxspec.load_model(registry.bundled_dir("target"), scan_layers=False)
  prompts = mixed_prompts(target, FLAGS.requests)
  pool = FLAGS.budget_rows * FLAGS.max_len // FLAGS.page_size
  print(
    f"{len(prompts)} prompts of {min(map(len, prompts))}..{max(map(len, prompts))} tokens, "
    f"{FLAGS.max_tokens} new tokens each; KV budget {FLAGS.budget_rows} × {FLAGS.max_len} "
    f"positions ({pool} pages of {FLAGS.page_size})",
    flush=True,
  )
  reserves = {r: parse_admission_reserve(r) for r in FLAGS.admission_reserves}
  results: dict[str, dict[str, dict]] = {}
  for method in FLAGS.methods:
    kinds = {"contiguous": dict(slots=FLAGS.budget_rows)}
    for text, reserve in reserves.items():
      kinds[f"paged/{text}"] = dict(
        slots=FLAGS.rows, reserve=reserve, page_size=FLAGS.page_size, kv_pages=pool
      )
    for kind, extra in kinds.items():
      r = _serve(target, method, prompts, **extra)
      results.setdefault(method, {})[kind] = r
      print(f"{method} {kind}: {json.dumps(r)}", flush=True)
  print("\n".join(table(results)))
  shared: dict[str, dict[str, dict]] = {}
  if FLAGS.shared_prefix:
    opening = mixed_prompts(target, 1, seed=1)[0]
    while len(opening) < FLAGS.shared_prefix:
      opening += mixed_prompts(target, 1, seed=len(opening))[0]
    behind = [opening[: FLAGS.shared_prefix] + p[: FLAGS.max_prompt // 2] for p in prompts]
    print(f"shared prefix: every prompt behind the same {FLAGS.shared_prefix} tokens", flush=True)
    for method in FLAGS.methods:
      for kind in ("off", "on"):
        r = _serve(
          target,
          method,
          behind,
          FLAGS.rows,
          page_size=FLAGS.page_size,
          kv_pages=pool,
          prefix_cache=kind == "on",
        )
        shared.setdefault(method, {})[kind] = r
        print(f"{method} prefix cache {kind}: {json.dumps(r)}", flush=True)
    print("\n".join(table(results)))
    print("\n".join(prefix_table(shared)))
  with open(FLAGS.out, "w") as f:
    json.dump({"kv": results, "shared_prefix": shared}, f, indent=1)
  print(f"saved {FLAGS.out}")
