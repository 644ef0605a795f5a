"""Benchmark jaxspec's speculative decoding against plain decoding and against transformers.

For one target, one draft model and a prompt set (default: the openings of functions in the
validation files of the bundled corpus), at each temperature, this runs every jaxspec method
(plain, draft_model, ngram) and, on the same weights and token ids, transformers (torch, CPU):
plain `generate`, assisted generation (`assistant_model=`) and prompt lookup
(`prompt_lookup_num_tokens=`). It prints a table of tokens/s, acceptance length and speedups,
and saves everything (per-prompt times and tokens, machine facts) as JSON.

All numbers that matter are ratios measured in one run: runners are interleaved prompt by
prompt, so slow drifts of the machine's load hit them alike. See docs/benchmarks.md.

  python launch/bench.py generate                          # bundled target and draft
  python launch/bench.py generate --model=/hf/target --draft_model=/hf/draft --num_prompts=16
  python launch/bench.py generate --random=small --temperatures=0   # random models, no assets
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import tempfile
import time
from typing import Any, Optional, Sequence

from absl import app, flags
import numpy as np

import jaxspec
from jaxspec.drafters import registry
from jaxspec.errors import ConfigError
from jaxspec.quant import policy as quant_policy
from launch.cli import common_flags
from launch.benchmarks import cost_curve
from launch.benchmarks import runners as runners_lib

ASSETS = os.path.join(os.path.dirname(jaxspec.__file__), "assets")

FLAGS = flags.FLAGS


def define_flags() -> None:
  """The generate benchmark's flags (defined when it runs)."""
  common_flags.define_max_len(0, "0 = the smallest multiple of 64 that fits.")
  common_flags.define_out(
    None,
    "results JSON (default: ./bench_results.json, or /tmp if the working directory is not "
    "writable); the plot beside it",
  )
  common_flags.define_kv_format()
  flags.DEFINE_string("model", None, "Target HF model directory (default: the bundled target).")
  flags.DEFINE_string("draft_model", None, "Draft HF model directory (default: the bundled draft).")
  flags.DEFINE_list(
    "methods",
    ["plain", "draft_model", "ngram"],
    "jaxspec methods to run; 'method@N' drafts N tokens per step instead of --gamma (e.g. "
    "eagle3@15 beside eagle3); 'dflash:argmax' drafts DFlash's argmax at T > 0 too.",
  )
  flags.DEFINE_string("dflash", None, "DFlash drafter directory (default: the bundled one).")
  flags.DEFINE_string("eagle3", None, "EAGLE-3 drafter directory (default: the bundled one).")
  flags.DEFINE_list(
    "tree_budgets",
    [],
    "DDTree budgets to sweep: each adds a runner '<method>+tree<N>' (tree verification with the "
    "drafter of each --tree_methods entry).",
  )
  flags.DEFINE_list("tree_methods", ["dflash"], "Drafters verified as trees in the budget sweep.")
  flags.DEFINE_list(
    "tree_rules",
    [],
    "Tree verification rules to sweep (ddtree, eagle2, recursive; default: the engine's); "
    "a rule other than the default is named in the runner, e.g. 'dflash+tree22[ddtree]'.",
  )
  flags.DEFINE_list("temperatures", ["0", "1"], "Sampling temperatures (0 = greedy).")
  flags.DEFINE_integer("num_prompts", 8, "Prompts from the validation split.")
  flags.DEFINE_string(
    "prompt_root",
    None,
    "Draw the prompts from the Python sources under this folder (its validation split) instead "
    "of the standard library's: e.g. an installed third-party package, text the target was "
    "not trained on.",
  )
  flags.DEFINE_enum(
    "prompt_set",
    "functions",
    ["functions", "instructions"],
    "functions: openings of Python functions (code models); instructions: held-out requests "
    "of jaxspec.train.instructions' mix, rendered with the target's chat template (chat "
    "models; their sources are never in a drafter's training split).",
  )
  flags.DEFINE_string(
    "quant_policy",
    None,
    "Quantize the target first (a jaxspec.quant policy name: fp8, mxfp4, ... or a JSON file); "
    "the drafters read its quantized embedding / head where they share them.",
  )
  flags.DEFINE_integer("max_new_tokens", 128, "Tokens generated per prompt (EOS does not stop).")
  flags.DEFINE_integer("gamma", 4, "Draft tokens per step (jaxspec and transformers alike).")
  flags.DEFINE_integer("ngram_n", 3, "Longest n-gram matched by prompt lookup.")
  flags.DEFINE_bool("hf", True, "Also run the transformers peers.")
  flags.DEFINE_integer("seed", 0, "Prompt selection and sampling seed.")
  flags.DEFINE_integer(
    "repeats",
    1,
    "Runs of each (runner, prompt); the fastest counts (robust to "
    "bursts of load from other processes; outputs are identical across repeats).",
  )
  flags.DEFINE_integer(
    "torch_threads",
    0,
    "torch intra-op threads; 0 = auto: the faster of 1 and all usable cores, "
    "timed on a short generate (on a loaded machine OpenMP's spinning barriers "
    "can make all-cores torch many times slower than one thread).",
  )
  flags.DEFINE_bool("profile", True, "Also time single target/draft forwards (a cost model).")
  flags.DEFINE_enum(
    "random",
    None,
    ["tiny", "small"],
    "Benchmark random models of this size instead (no trained assets needed).",
  )
  flags.DEFINE_enum(
    "random_draft",
    "truncated",
    ["truncated", "qwen3"],
    "With --random: the draft is the target's first layer, or a random Qwen3.",
  )


# --------------------------------------------------------------------------------------------------
# Settings
# --------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class BenchConfig:
  """Everything one benchmark run depends on (the flags, as a value)."""

  model: str
  draft_model: Optional[str] = None
  methods: Sequence[str] = ("plain", "draft_model", "ngram")
  temperatures: Sequence[float] = (0.0, 1.0)
  num_prompts: int = 8
  max_new_tokens: int = 128
  gamma: int = 4
  ngram_n: int = 3
  hf: bool = True
  out: Optional[str] = None
  seed: int = 0
  repeats: int = 1
  max_len: int = 0
  torch_threads: int = 0
  profile: bool = True
  prompts: Optional[Sequence[str]] = None  # overrides the validation-split prompts
  verbose: bool = True
  dflash: Optional[str] = None  # drafter checkpoint directories
  eagle3: Optional[str] = None
  tree_budgets: Sequence[int] = ()
  tree_methods: Sequence[str] = ("dflash",)
  tree_rules: Sequence[str] = ()
  prompt_root: Optional[str] = None
  kv_format: str = "float"
  prompt_set: str = "functions"  # or "instructions" (chat requests, token ids)
  quant_policy: Optional[str] = None

  def drafter_dir(self, method: str) -> Optional[str]:
    return {"draft_model": self.draft_model, "dflash": self.dflash, "eagle3": self.eagle3}.get(
      method
    )


# --------------------------------------------------------------------------------------------------
# The benchmark
# --------------------------------------------------------------------------------------------------


def _log(cfg: BenchConfig, msg: str) -> None:
  if cfg.verbose:
    print(msg, flush=True)


def load_prompts(cfg: BenchConfig) -> list[str]:
  if cfg.prompts is not None:
    return list(cfg.prompts)[: cfg.num_prompts]
  return cost_curve.data_prompts(cfg.num_prompts, cfg.seed, cfg.prompt_root)


def prompt_ids(cfg: BenchConfig, target: Any) -> list[list[int]]:
  """The prompts as token ids: `load_prompts` encoded, or the held-out chat requests."""
  if cfg.prompt_set == "instructions" and cfg.prompts is None:
    from jaxspec.train import instructions  # pylint: disable=import-outside-toplevel

    return instructions.distill_prompt_ids(
      target.tokenizer, "validation", cfg.num_prompts, cfg.seed, max_prompt_tokens=256
    )
  texts = load_prompts(cfg)
  return [target.tokenizer.encode(t) for t in texts]


def run_benchmark(cfg: BenchConfig) -> dict[str, Any]:
  """Runs the whole benchmark; returns the results dict (also written to cfg.out if set)."""
  for m in cfg.methods:
    if runners_lib.split_method(m)[0] not in registry.METHODS:
      raise ConfigError(f"unknown method {m!r}; choose from {registry.METHODS}")
    runners_lib.drafter_options(m)  # refuses ':argmax' where it means nothing
  bases = [runners_lib.split_method(m)[0] for m in cfg.methods]
  for m in ("draft_model", "dflash", "eagle3"):
    if m in bases + list(cfg.tree_methods if cfg.tree_budgets else ()):
      if not cfg.drafter_dir(m):
        raise ConfigError(f"method {m} needs a drafter directory (--{m})")
  methods = ["plain"] + [m for m in cfg.methods if m != "plain"]  # plain is the baseline
  load_at_start = list(os.getloadavg()) if hasattr(os, "getloadavg") else None

  target = jaxspec.load_model(cfg.model, scan_layers=False)  # decoding's layout
  if target.tokenizer is None and cfg.prompts is None:
    raise ConfigError(f"{cfg.model} has no tokenizer.json: text prompts cannot be encoded")
  if cfg.quant_policy:
    target = jaxspec.quantize(target, quant_policy.load_policy(cfg.quant_policy))
  draft = jaxspec.load_model(cfg.draft_model, scan_layers=False) if "draft_model" in bases else None
  prompts = prompt_ids(cfg, target)
  if not prompts:
    raise ConfigError("no prompts")
  drafters: dict[str, Any] = {}
  for m in dict.fromkeys(methods + (list(cfg.tree_methods) if cfg.tree_budgets else [])):
    base, gamma = runners_lib.split_method(m)
    if base == "draft_model":
      drafters[m] = jaxspec.DraftModelDrafter.from_model(draft, gamma=gamma or cfg.gamma)
    else:
      drafters[m] = registry.make_drafter(
        base,
        target,
        # DFlash drafts its trained block unless a length is named
        gamma=gamma or (None if base == "dflash" else cfg.gamma),
        ngram_n=cfg.ngram_n,
        draft_dir=cfg.drafter_dir(base),
        **runners_lib.drafter_options(m),
      )
  lookahead = max(
    [cfg.gamma] + [d.gamma for d in drafters.values() if d is not None] + list(cfg.tree_budgets)
  )
  need = max(len(p) for p in prompts) + cfg.max_new_tokens + lookahead + 1
  max_len = cfg.max_len or -(-need // 64) * 64
  if need > max_len:
    raise ConfigError(f"max_len={max_len} is too small: the longest prompt needs {need}")

  torch_threads = None
  hf_models = None
  if cfg.hf:
    import torch  # pylint: disable=import-outside-toplevel
    import transformers  # pylint: disable=import-outside-toplevel

    transformers.logging.set_verbosity_error()
    load = lambda d: transformers.AutoModelForCausalLM.from_pretrained(
      d, dtype=torch.float32
    ).eval()
    hf_models = (load(cfg.model), load(cfg.draft_model) if draft is not None else None)
    thread_timings = {}
    if cfg.torch_threads:
      torch_threads = cfg.torch_threads
    else:
      torch_threads, thread_timings = runners_lib.choose_torch_threads(hf_models[0], prompts[0])
      _log(cfg, f"torch threads: {torch_threads} (ms/token by thread count: {thread_timings})")
    torch.set_num_threads(torch_threads)

  # Runners, in the order they run on each prompt.
  runners: list[Any] = []
  for m in methods:
    runners.append(
      runners_lib.JaxspecRunner(m, target, drafters[m], max_len, kv_format=cfg.kv_format)
    )
  for m in cfg.tree_methods if cfg.tree_budgets else ():
    for rule in cfg.tree_rules or [runners_lib.DEFAULT_TREE_RULE]:
      for n in cfg.tree_budgets:
        runners.append(
          runners_lib.JaxspecRunner(
            m, target, drafters[m], max_len, int(n), cfg.kv_format, tree_rule=rule
          )
        )
  if hf_models is not None:
    pad = target.config.pad_token_id if target.config.pad_token_id is not None else 0
    for m in methods:
      if m in runners_lib.HF_PEERS:
        runners.append(
          runners_lib.HFRunner(
            runners_lib.HF_PEERS[m], hf_models[0], hf_models[1], cfg.gamma, cfg.ngram_n, pad
          )
        )

  _log(
    cfg,
    f"{len(prompts)} prompts ({min(map(len, prompts))}–{max(map(len, prompts))} tokens), "
    f"max_len={max_len}; warming up {len(runners)} runners …",
  )
  t0 = time.perf_counter()
  for r in runners:
    r.warmup(prompts)
  _log(cfg, f"warm-up (compilation) took {time.perf_counter() - t0:.1f}s")
  counts_before = {
    r.name: r.compile_counts() for r in runners if isinstance(r, runners_lib.JaxspecRunner)
  }

  results: dict[str, Any] = {}
  for temp in cfg.temperatures:
    runs: dict[str, list[runners_lib.Run]] = {r.name: [] for r in runners}
    for i, p in enumerate(prompts):
      for r in runners:  # interleaved: load drifts hit every runner alike
        tries = [
          r(p, cfg.max_new_tokens, float(temp), cfg.seed + i) for _ in range(max(cfg.repeats, 1))
        ]
        runs[r.name].append(min(tries, key=lambda run: run.seconds))
      _log(cfg, f"  T={temp:g}: prompt {i + 1}/{len(prompts)} done")
    res = {name: runners_lib.summarize_runs(rs, cfg.max_new_tokens) for name, rs in runs.items()}
    for side in ("jaxspec", "transformers"):
      base = res.get(f"{side}/{'plain' if side == 'jaxspec' else 'generate'}")
      for name, s in res.items():
        if name.startswith(side) and base:
          s["speedup_vs_plain"] = s["tokens_per_second"] / base["tokens_per_second"]
    ratios = {}
    if hf_models is not None:
      for m in (m for m in methods if m in runners_lib.HF_PEERS):
        ratios[f"{m}/{runners_lib.HF_PEERS[m]}"] = (
          res[f"jaxspec/{m}"]["tokens_per_second"]
          / res[f"transformers/{runners_lib.HF_PEERS[m]}"]["tokens_per_second"]
        )
    entry: dict[str, Any] = {
      "runners": res,
      "jaxspec_over_transformers": ratios,
      "tokens": {n: [r.tokens for r in rs] for n, rs in runs.items()},
    }
    if temp == 0:
      entry["greedy_check"] = runners_lib.greedy_check(entry["tokens"], "jaxspec/plain")
    results[f"{float(temp):g}"] = entry

  recompiled = {
    r.name: r.compile_counts() != counts_before[r.name]
    for r in runners
    if isinstance(r, runners_lib.JaxspecRunner)
  }
  report: dict[str, Any] = {
    "config": {k: v for k, v in dataclasses.asdict(cfg).items() if k != "verbose"},
    "max_len": max_len,
    "tokens_per_second_definition": "generated tokens / wall seconds of the whole generate "
    "call (prefill included), token ids in → token ids out, "
    "summed over prompts, batch 1 (with repeats > 1: the "
    "fastest repeat of each prompt)",
    "machine": runners_lib.machine_facts(torch_threads, load_at_start),
    "models": {
      "target": cfg.model,
      "target_architecture": target.config.architecture,
      "draft": cfg.draft_model if draft is not None else None,
      "draft_architecture": draft.config.architecture if draft is not None else None,
    },
    "prompts": [{"text": target.tokenizer.decode(p), "num_tokens": len(p)} for p in prompts],
    "recompiled_during_timing": recompiled,
    "results": results,
  }
  report["targets"] = runners_lib.check_targets(results)
  if cfg.profile:
    report["profile"] = runners_lib.profile_forwards(target, draft, cfg.gamma, max_len)
  if cfg.hf:
    report["machine"]["torch_thread_calibration_ms_per_token"] = thread_timings
  report["machine"]["load_average_at_end"] = (
    list(os.getloadavg()) if hasattr(os, "getloadavg") else None
  )
  report["table"] = format_table(report)
  if cfg.out:
    os.makedirs(os.path.dirname(os.path.abspath(cfg.out)), exist_ok=True)
    report["plot"] = plot_report(report, os.path.splitext(cfg.out)[0] + ".png")
    with open(cfg.out, "w", encoding="utf-8") as f:
      json.dump(report, f, indent=1, default=float)
      f.write("\n")
  return report


TREE_RUNNER = re.compile(r"\+tree(\d+)(?:\[(\w+)\])?$")  # budget, and a non-default rule


def plot_report(report: dict[str, Any], path: str) -> Optional[str]:
  """Acceptance rate by draft position (one panel per temperature) and, with a DDTree budget
  sweep, acceptance length and speedup against the budget; a PNG at `path`, or None without
  matplotlib."""
  try:
    import matplotlib  # pylint: disable=import-outside-toplevel

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  except ImportError:
    return None
  temps = list(report["results"])
  sweep: dict[str, list] = {}  # "T=<t>" or "T=<t> <rule>" → [(budget, summary)]
  for t in temps:
    for n, s in report["results"][t]["runners"].items():
      tree = TREE_RUNNER.search(n)
      if tree:
        label = f"T={t}" + (f" {tree.group(2)}" if tree.group(2) else "")
        sweep.setdefault(label, []).append((int(tree.group(1)), s))
  sweep = {label: sorted(points, key=lambda p: p[0]) for label, points in sweep.items()}
  has_sweep = any(sweep.values())
  fig, axes = plt.subplots(
    1, len(temps) + has_sweep, figsize=(5 * (len(temps) + has_sweep), 4), squeeze=False
  )
  for ax, t in zip(axes[0], temps):
    for name, s in report["results"][t]["runners"].items():
      rates = s.get("acceptance_rate_per_position") or []
      if len(rates):  # trees: P(depth i reached | depth i − 1 reached)
        ax.plot(range(1, len(rates) + 1), rates, marker="o", label=name.split("/", 1)[1])
    ax.set_title(f"P(draft i accepted | reached), T={t}")
    ax.set_xlabel("draft position i")
    ax.set_ylim(0, 1.02)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
  if has_sweep:
    ax = axes[0][-1]
    for t, points in sweep.items():
      if points:
        budgets = [b for b, _ in points]
        ax.plot(
          budgets,
          [s["acceptance_length"] for _, s in points],
          marker="o",
          label=f"acceptance length, {t}",
        )
        ax.plot(
          budgets,
          [s.get("speedup_vs_plain", float("nan")) for _, s in points],
          marker="s",
          ls="--",
          label=f"speedup vs plain, {t}",
        )
    ax.set_title("DDTree budget sweep")
    ax.set_xlabel("tree budget (draft nodes)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)
  return path


# --------------------------------------------------------------------------------------------------
# Output
# --------------------------------------------------------------------------------------------------


def _f(x: Any, fmt: str = ".2f", suffix: str = "") -> str:
  if x is None or (isinstance(x, float) and np.isnan(x)):
    return "-"
  return f"{x:{fmt}}{suffix}"


def format_table(report: dict[str, Any]) -> str:
  """The human-readable table of a report (one block per temperature)."""
  cfg, m = report["config"], report["machine"]
  machine = f"machine: {m['usable_cores']} usable cores, jax {m['jax']} ({m['jax_backend']})"
  if "torch" in m:
    machine += (
      f", torch {m['torch']} ({m['torch_threads']} threads), transformers {m['transformers']}"
    )
  if m.get("load_average_at_start"):
    machine += f", load avg {m['load_average_at_start'][0]:.1f} → {m['load_average_at_end'][0]:.1f}"
  lines = [
    f"target: {report['models']['target']} ({report['models']['target_architecture']})",
    f"draft:  {report['models']['draft']} ({report['models']['draft_architecture']})"
    if report["models"]["draft"]
    else "draft:  none",
    f"{len(report['prompts'])} prompts, {cfg['max_new_tokens']} new tokens each (EOS ignored), "
    f"batch 1, γ={cfg['gamma']}, n-gram n={cfg['ngram_n']}, float32, max_len={report['max_len']}",
    machine,
    "tok/s = generated tokens / wall time of whole generate calls (prefill included); "
    "speedup = tok/s over the same engine's plain decoding; acc.len = tokens per verify pass "
    "(bonus included, mean over prompts); tok/pass = tokens / target forwards incl. prefill; "
    "acc.rate@i = P(draft i accepted | reached)",
  ]
  header = (
    f"{'runner':<28}{'tok/s':>9}{'speedup':>9}{'acc.len':>9}{'tok/pass':>10}"
    f"{'ms/pass':>9}  {'acc.rate@1..γ':<28}{'jaxspec/peer':>13}"
  )
  for temp, entry in report["results"].items():
    lines += [
      "",
      f"temperature {temp}" + (" (greedy)" if float(temp) == 0 else " (sampling)"),
      header,
      "-" * len(header),
    ]
    ratios = entry["jaxspec_over_transformers"]
    for name, s in entry["runners"].items():
      side, method = name.split("/")
      ratio = ""
      if side == "jaxspec" and f"{method}/{runners_lib.HF_PEERS.get(method)}" in ratios:
        peer = runners_lib.HF_PEERS[method]
        ratio = f"{ratios[f'{method}/{peer}']:.2f}× vs {peer}"
      rates = s.get("acceptance_rate_per_position")
      rate_s = " ".join(_f(r, ".2f") for r in rates) if rates and len(rates) else ""
      ms = s.get("seconds_per_target_pass")
      lines.append(
        f"{name:<28}{_f(s['tokens_per_second'], '.1f'):>9}"
        f"{_f(s.get('speedup_vs_plain'), '.2f', '×'):>9}{_f(s.get('acceptance_length')):>9}"
        f"{_f(s['tokens_per_target_pass']):>10}{_f(ms and 1e3 * ms, '.2f'):>9}  "
        f"{rate_s:<28}{ratio:>13}"
      )
    if "greedy_check" in entry:
      g = entry["greedy_check"]
      parts = [f"{n}: {v['mismatched_prompts']}" for n, v in g["vs"].items()]
      lines.append(f"greedy outputs differing from {g['reference']} (prompts): " + ", ".join(parts))
  if report.get("targets"):
    lines += ["", "performance targets (greedy; meaningful for the bundled models):"]
    lines += [
      f"  {'met ' if t['met'] else 'MISS'}  {t['target']}: {t['value']:.2f}×"
      for t in report["targets"]
    ]
  if "profile" in report:
    p = report["profile"]
    lines += [
      "",
      "single forwards (ms, jitted, at position max_len/2): "
      + ", ".join(f"{k[:-2]}={1e3 * v:.2f}" for k, v in p.items()),
    ]
  if any(report["recompiled_during_timing"].values()):
    lines.append(f"WARNING: recompiled during timing: {report['recompiled_during_timing']}")
  return "\n".join(lines)


def main(argv: Sequence[str]) -> None:
  del argv
  if FLAGS.random:
    with tempfile.TemporaryDirectory(prefix="jaxspec_bench_") as tmp:
      _main(*runners_lib.write_random_models(tmp, FLAGS.random, FLAGS.seed, FLAGS.random_draft))
  else:
    _main(FLAGS.model, FLAGS.draft_model)


def _bundled_drafter(method: str) -> Optional[str]:
  """The bundled drafter of `method` when the bundled target is benchmarked."""
  if FLAGS.model or FLAGS.random:
    return None
  return registry.bundled_dir(method)


def _main(model: Optional[str], draft: Optional[str]) -> None:
  if model is None:
    model = os.path.join(ASSETS, "target")
    if draft is None:
      draft = os.path.join(ASSETS, "draft")
    if not os.path.exists(os.path.join(model, "config.json")):
      raise app.UsageError(
        f"no bundled target at {model}: pass --model (and --draft_model), "
        "or --random=tiny|small for random models"
      )
  if "draft_model" in FLAGS.methods and (draft is None or not os.path.isdir(draft)):
    raise app.UsageError(f"method draft_model needs a draft model directory (got {draft!r})")
  cfg = BenchConfig(
    model=model,
    draft_model=draft,
    methods=tuple(FLAGS.methods),
    temperatures=tuple(float(t) for t in FLAGS.temperatures),
    num_prompts=FLAGS.num_prompts,
    max_new_tokens=FLAGS.max_new_tokens,
    gamma=FLAGS.gamma,
    ngram_n=FLAGS.ngram_n,
    hf=FLAGS.hf,
    out=FLAGS.out or runners_lib.default_out(),
    dflash=FLAGS.dflash or _bundled_drafter("dflash"),
    eagle3=FLAGS.eagle3 or _bundled_drafter("eagle3"),
    tree_budgets=tuple(int(n) for n in FLAGS.tree_budgets),
    tree_rules=tuple(FLAGS.tree_rules),
    prompt_root=FLAGS.prompt_root,
    tree_methods=tuple(FLAGS.tree_methods),
    seed=FLAGS.seed,
    repeats=FLAGS.repeats,
    max_len=FLAGS.max_len,
    torch_threads=FLAGS.torch_threads,
    profile=FLAGS.profile,
    kv_format=FLAGS.kv_format,
    prompt_set=FLAGS.prompt_set,
    quant_policy=FLAGS.quant_policy,
  )
  report = run_benchmark(cfg)
  print()
  print(report["table"])
  print(f"\nsaved {cfg.out}")

