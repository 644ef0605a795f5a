"""jaxspec's benchmarks behind one command: `python launch/bench.py <subcommand> [flags]`.

Each subcommand is a module of this package with `define_flags()` (its absl flags, defined
only when it runs, so that two subcommands may give a flag different defaults) and
`main(argv)`; launch/bench.py only dispatches. `python launch/bench.py --help` lists the
subcommands, `python launch/bench.py <subcommand> --help` the subcommand's flags.

The scripts the subcommands replaced (launch/bench_kv.py, launch/device_check.py,
tools/bench_hybrid_tree.py, `launch/bench.py --mode=cost_curve`, ...) still run: each prints a
DeprecationWarning naming its subcommand and forwards to it (`forward`).
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import sys
from typing import NoReturn, Optional, Sequence

PROG = "jaxspec"
EXIT_ERROR = 2  # as jaxspec.cli.run reports a usage error
HELP_FLAGS = ("--help", "-h", "-?", "--helpshort", "--helpfull")


@dataclasses.dataclass(frozen=True)
class Subcommand:
  """One benchmark: its name on the command line, its module, what it measures and replaces."""

  name: str
  module: str  # under jaxspec.cli.bench
  summary: str
  replaces: str


SUBCOMMANDS = {
  s.name: s
  for s in (
    Subcommand(
      "generate",
      "generate",
      "methods × temperatures on real prompts, against transformers (tokens/s, τ, speedups)",
      "launch/bench.py --mode=generate, its default mode",
    ),
    Subcommand(
      "cost-curve",
      "cost_curve",
      "forward cost t(T) against tokens T, the memory roofline, projected speedups",
      "launch/bench.py --mode=cost_curve",
    ),
    Subcommand(
      "quant",
      "quant",
      "bytes read and time per decode step per weight format (float32, bf16, policies)",
      "launch/bench.py --mode=quant_cost",
    ),
    Subcommand(
      "quant-profile",
      "quant_profile",
      "quantization sensitivity per layer and module kind, and the policy it implies",
      "launch/profile_quant.py",
    ),
    Subcommand(
      "kv",
      "kv",
      "plain decoding time against max_len per KV format, and FP8-KV fidelity",
      "launch/bench_kv.py",
    ),
    Subcommand(
      "long",
      "long",
      "long context (1K-128K): speed, acceptance, fidelity and the feature ring",
      "launch/bench_long.py",
    ),
    Subcommand(
      "serve",
      "serve",
      "continuous batching: throughput and per-request speed against concurrency",
      "launch/bench_serve.py",
    ),
    Subcommand(
      "ep",
      "ep",
      "expert-parallel MoE backends against the GSPMD path, on one mesh",
      "launch/bench_ep.py",
    ),
    Subcommand(
      "compile",
      "compile_time",
      "compile time and per-token decode time against depth (scanned layers)",
      "launch/compile_bench.py",
    ),
    Subcommand(
      "device",
      "device",
      "the accelerator check: kernels, lossless decoding, cost, speedup (pass/fail table)",
      "launch/device_check.py",
    ),
    Subcommand(
      "hybrid-context",
      "hybrid_context",
      "decode step cost against context: Gated DeltaNet hybrids against attention",
      "tools/bench_hybrid_context.py",
    ),
    Subcommand(
      "latent",
      "latent",
      "decode-step attention over MLA's latent cache against an equivalent GQA cache",
      "no earlier script",
    ),
    Subcommand(
      "gdn",
      "gdn",
      "the gated delta rule: recurrent against chunked form (XLA and Pallas), per call",
      "tools/bench_gated_deltanet.py",
    ),
    Subcommand(
      "hybrid-tree",
      "hybrid_tree",
      "verify-block cost of tree against chain verification on a hybrid target",
      "tools/bench_hybrid_tree.py",
    ),
    Subcommand(
      "ordered-head",
      "ordered_head",
      "the Gemma 4 assistant's ordered-embedding head against the full head (262K vocabulary)",
      "no earlier script",
    ),
    Subcommand(
      "serve-pages",
      "serve_pages",
      "paged against contiguous K/V at one KV memory budget: requests running at once, tokens/s",
      "no earlier script",
    ),
    Subcommand(
      "serve-adaptive",
      "serve_adaptive",
      "adaptive against fixed speculation on one server at concurrency 1, 4, 16, 64",
      "no earlier script",
    ),
    Subcommand(
      "tree-calibrate",
      "tree_calibrate",
      "a drafter's sampled-tree acceptance by depth and rank; writes tree_acceptance.json",
      "no earlier script",
    ),
    Subcommand(
      "llamacpp",
      "llamacpp",
      "jaxspec against llama.cpp on the same weights (GGUF F32/Q8_0/Q4_0), plain and n-gram",
      "no earlier script",
    ),
  )
}


def entry_point() -> str:
  """launch/bench.py of the tree this package was imported from (subprocesses run it)."""
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
  return os.path.join(root, "launch", "bench.py")


def command(name: str, *args: str) -> list[str]:
  """The command line that runs subcommand `name` with `args` in a fresh interpreter."""
  return [sys.executable, entry_point(), name, *args]


def usage(prog: str = "launch/bench.py") -> str:
  """The top-level help: every subcommand, what it measures and the script it replaces."""
  width = max(map(len, SUBCOMMANDS))
  lines = [
    f"usage: python {prog} <subcommand> [flags]",
    "",
    "jaxspec's benchmarks (docs/benchmarks.md says what each measured, and how to read it).",
    f"`python {prog} <subcommand> --help` lists a subcommand's flags.",
    "",
    "subcommands:",
  ]
  for s in SUBCOMMANDS.values():
    lines.append(f"  {s.name:<{width}}  {s.summary}")
    lines.append(f"  {'':<{width}}  (replaces {s.replaces})")
  return "\n".join(lines)


def _error(message: str) -> NoReturn:
  sys.stdout.flush()
  print(f"{PROG}: error: {message}", file=sys.stderr, flush=True)
  sys.exit(EXIT_ERROR)


def _deprecated(old: str, new: str) -> None:
  print(
    f"{PROG}: DeprecationWarning: {old} is deprecated; use `python launch/bench.py {new}`",
    file=sys.stderr,
    flush=True,
  )


def _legacy_mode(args: list[str]) -> tuple[str, list[str]]:
  """(subcommand, args) for the old `bench.py [--mode=...] [flags]` (no subcommand)."""
  mode, rest, i = "generate", [], 0
  while i < len(args):
    a = args[i]
    if a.startswith("--mode="):
      mode = a.split("=", 1)[1]
    elif a == "--mode" and i + 1 < len(args):
      mode, i = args[i + 1], i + 1
    else:
      rest.append(a)
    i += 1
  names = {"generate": "generate", "cost_curve": "cost-curve", "quant_cost": "quant"}
  if mode not in names:
    _error(f"--mode={mode}: expected one of {', '.join(names)} (`bench.py --help` lists the "
           "subcommands that replace it)")
  return names[mode], rest


def run_subcommand(name: str, args: Sequence[str]) -> NoReturn:
  """Defines subcommand `name`'s flags, then runs it like `jaxspec.cli.run` on `args`."""
  from absl import flags  # pylint: disable=import-outside-toplevel

  from jaxspec import cli  # pylint: disable=import-outside-toplevel

  sub = SUBCOMMANDS[name]
  module = importlib.import_module(f"{__name__}.{sub.module}")
  before = set(flags.FLAGS)
  prepare = getattr(module, "prepare_environment", None)
  if prepare is not None:  # before any backend starts (ep: virtual CPU devices)
    prepare(list(args))
  module.define_flags()
  for flag in set(flags.FLAGS) - before:  # listed by `<subcommand> --help`
    flags.FLAGS.register_key_flag_for_module(sys.argv[0], flags.FLAGS[flag])
  main_module = sys.modules["__main__"]
  main_module.__doc__ = (
    f"usage: python launch/bench.py {name} [flags]\n\n{(module.__doc__ or '').strip()}\n"
  ).replace("%", "%%")
  cli.run(module.main, argv=[sys.argv[0], *args])


def main(argv: Optional[Sequence[str]] = None) -> NoReturn:
  """`bench.py <subcommand> [flags]`; `bench.py --help` lists the subcommands."""
  argv = list(sys.argv if argv is None else argv)
  args = argv[1:]
  if args and args[0] in HELP_FLAGS:
    print(usage())
    sys.exit(0)
  if not args or args[0].startswith("-"):
    name, rest = _legacy_mode(args)
    _deprecated("launch/bench.py without a subcommand", name)
    run_subcommand(name, rest)
  name = args[0]
  if name not in SUBCOMMANDS:
    _error(f"unknown subcommand {name!r}; choose one of {', '.join(SUBCOMMANDS)} (--help)")
  run_subcommand(name, args[1:])


def forward(old: str, name: str, argv: Optional[Sequence[str]] = None) -> NoReturn:
  """What a replaced script runs: a DeprecationWarning naming `name`, then `name` itself."""
  _deprecated(old, name)
  run_subcommand(name, list(sys.argv if argv is None else argv)[1:])
