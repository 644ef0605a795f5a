"""Adaptive against fixed speculation on one server, at concurrency 1, 4, 16 and 64.

One engine of `--slots` rows serves c client threads (a closed loop: each sends its next
request when the last one finished, `--waves` each), for each c, in three configurations:

* fixed: every tick steps all slots with the method's full budget (the default server);
* fixed+buckets: the live rows compacted into a row bucket (a quarter and a sixteenth of the
  slots), full budget;
* auto: row buckets, and per tick the budget (0, half, full) worth the most tokens per second
  by the measured step costs and acceptance (`--speculation=auto`, serve/speculation.py).

Reported per (method, configuration, c), from one run: throughput, per-request tokens/s,
acceptance length, mean step time, and which budgets and buckets the ticks ran; then the
ratios auto / fixed and auto / fixed+buckets.

  python launch/bench.py serve-adaptive                      # EAGLE-3, ~10 min on 2 cores
  python launch/bench.py serve-adaptive --methods=eagle3,dflash-ddtree --concurrency=1,16

A script, not a test. On this CPU a step costs about what its rows × block width cost, so
compaction is where a lightly loaded server gains; on an accelerator the verify is near free
until the step turns compute-bound, and the budget is where the load matters.
"""

from __future__ import annotations

import json
from typing import Any, Sequence

from absl import flags

import jaxspec
from jaxspec.drafters import registry
from jaxspec.serve import Scheduler
from jaxspec.serve.speculation import default_row_buckets
from jaxspec.train import data as data_lib
from launch.cli import common_flags
from launch.benchmarks.serve import build_engine, run_load

FLAGS = flags.FLAGS
CONFIGS = ("fixed", "fixed+buckets", "auto")


def define_flags() -> None:
  """This benchmark's flags (defined when it runs)."""
  flags.DEFINE_list("methods", ["eagle3"], "eagle3, dflash-ddtree.")
  flags.DEFINE_integer("slots", 64, "The server's rows.")
  flags.DEFINE_list("concurrency", ["1", "4", "16", "64"], "Client threads.")
  flags.DEFINE_integer("waves", 2, "Requests per client thread.")
  flags.DEFINE_integer("max_tokens", 64, "Tokens per request (greedy; EOS stops early).")
  flags.DEFINE_integer("tree_budget", 22, "DDTree draft nodes per step.")
  flags.DEFINE_integer("steps_per_tick", 4, "Engine steps per scheduler round trip.")
  common_flags.define_max_len(256)
  common_flags.define_out("/tmp/jaxspec_bench_serve_adaptive.json", "results JSON")


def _config(kind: str) -> dict[str, Any]:
  buckets = default_row_buckets(FLAGS.slots)
  if kind == "fixed":
    return {}
  if kind == "fixed+buckets":
    return dict(row_buckets=buckets)
  return dict(row_buckets=buckets, speculation="auto")


def table(results: dict[str, dict[str, dict[int, dict]]]) -> list[str]:
  lines = [
    f"{'method':<15}{'config':<15}{'c':>4}{'tok/s':>9}{'req tok/s':>11}{'τ':>6}"
    f"{'step ms':>9}  budgets:ticks"
  ]
  for method, by_kind in results.items():
    for kind, by_c in by_kind.items():
      for c, r in sorted(by_c.items()):
        lines.append(
          f"{method:<15}{kind:<15}{c:>4}{r['throughput_tok_s']:>9.1f}"
          f"{r['per_request_tok_s']:>11.1f}{r['acceptance_length']:>6.2f}"
          f"{1e3 * r['step_seconds_avg']:>9.1f}  {r['chosen']}"
        )
    auto = by_kind.get("auto", {})
    for c in sorted(auto):
      ratios = [
        f"{auto[c]['throughput_tok_s'] / by_kind[k][c]['throughput_tok_s']:.2f}× {k}"
        for k in ("fixed", "fixed+buckets")
        if c in by_kind.get(k, {})
      ]
      lines.append(f"{method:<15}{'auto vs':<15}{c:>4}  " + ", ".join(ratios))
  return lines


def main(argv: Sequence[str]) -> None:
  del argv
  target = jaxspec.load_model(registry.bundled_dir("target"), scan_layers=False)
  texts = data_lib.function_prompts("validation", n=64, seed=0)
  prompts = [target.tokenizer.encode(t)[:96] for t in texts]
  results: dict[str, dict[str, dict[int, dict]]] = {}
  for method in FLAGS.methods:
    for kind in CONFIGS:
      engine = build_engine(target, method, FLAGS.slots, **_config(kind))
      for c in (int(x) for x in FLAGS.concurrency):
        # A fresh scheduler per load (its counters and policy start afresh); the engine's
        # programs are compiled by the first one's warm-up.
        scheduler = Scheduler(engine, max_queue=4 * FLAGS.slots)
        scheduler.start()  # before the clock: warm-up and (auto) the step-cost measurement
        try:
          r = run_load(scheduler, prompts, c)
        finally:
          scheduler.shutdown(drain=False, timeout=600)
        chosen = scheduler._policy.chosen  # pylint: disable=protected-access
        r["chosen"] = {f"{b}@{rows}": n for (b, rows), n in sorted(chosen.items())}
        results.setdefault(method, {}).setdefault(kind, {})[c] = r
        print(f"{method} {kind} c={c}: {json.dumps(r)}", flush=True)
  print("\n".join(table(results)))
  with open(FLAGS.out, "w") as f:
    json.dump(results, f, indent=1, default=str)
  print(f"saved {FLAGS.out}")
