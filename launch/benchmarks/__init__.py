"""jaxspec's benchmarks behind one command: `python launch/bench.py <subcommand> [flags]`.

Each subcommand is a module of this package with `define_flags()` (its absl flags, defined
only when it runs, so that two subcommands may give a flag different defaults) and
`main(argv)`; launch/bench.py only dispatches. `python launch/bench.py --help` lists the
subcommands, `python launch/bench.py <subcommand> --help` the subcommand's flags.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import sys
from typing import NoReturn, Optional, Sequence

PROG = "jaxspec"
EXIT_ERROR = 2  # as launch.cli.run reports a usage error
HELP_FLAGS = ("--help", "-h", "-?", "--helpshort", "--helpfull")


@dataclasses.dataclass(frozen=True)
class Subcommand:
  """One benchmark: its name on the command line, its module and what it measures."""

  name: str
  module: str  # under launch.benchmarks
  summary: str


SUBCOMMANDS = {
  s.name: s
  for s in (
    Subcommand(
      "generate",
      "generate",
      "methods × temperatures on real prompts, against transformers (tokens/s, τ, speedups)",
    ),
    Subcommand(
      "cost-curve",
      "cost_curve",
      "forward cost t(T) against tokens T, the memory roofline, projected speedups",
    ),
    Subcommand(
      "quant",
      "quant",
      "bytes read and time per decode step per weight format (float32, bf16, policies)",
    ),
    Subcommand(
      "quant-profile",
      "quant_profile",
      "quantization sensitivity per layer and module kind, and the policy it implies",
    ),
    Subcommand(
      "kv",
      "kv",
      "plain decoding time against max_len per KV format, and FP8-KV fidelity",
    ),
    Subcommand(
      "long",
      "long",
      "long context (1K-128K): speed, acceptance, fidelity and the feature ring",
    ),
    Subcommand(
      "serve",
      "serve",
      "continuous batching: throughput and per-request speed against concurrency",
    ),
    Subcommand(
      "ep",
      "ep",
      "expert-parallel MoE backends against the GSPMD path, on one mesh",
    ),
    Subcommand(
      "compile",
      "compile_time",
      "compile time and per-token decode time against depth (scanned layers)",
    ),
    Subcommand(
      "device",
      "device",
      "the accelerator check: kernels, lossless decoding, cost, speedup (pass/fail table)",
    ),
    Subcommand(
      "hybrid-context",
      "hybrid_context",
      "decode step cost against context: Gated DeltaNet hybrids against attention",
    ),
    Subcommand(
      "latent",
      "latent",
      "decode-step attention over MLA's latent cache against an equivalent GQA cache",
    ),
    Subcommand(
      "gdn",
      "gdn",
      "the gated delta rule: recurrent against chunked form (XLA and Pallas), per call",
    ),
    Subcommand(
      "hybrid-tree",
      "hybrid_tree",
      "verify-block cost of tree against chain verification on a hybrid target",
    ),
    Subcommand(
      "ordered-head",
      "ordered_head",
      "the Gemma 4 assistant's ordered-embedding head against the full head (262K vocabulary)",
    ),
    Subcommand(
      "serve-pages",
      "serve_pages",
      "paged against contiguous K/V at one KV memory budget: requests running at once, tokens/s",
    ),
    Subcommand(
      "serve-adaptive",
      "serve_adaptive",
      "adaptive against fixed speculation on one server at concurrency 1, 4, 16, 64",
    ),
    Subcommand(
      "tree-calibrate",
      "tree_calibrate",
      "a drafter's sampled-tree acceptance by depth and rank; writes tree_acceptance.json",
    ),
    Subcommand(
      "llamacpp",
      "llamacpp",
      "jaxspec against llama.cpp on the same weights (GGUF F32/Q8_0/Q4_0), plain and n-gram",
    ),
  )
}


def entry_point() -> str:
  """launch/bench.py of the tree this package was imported from (subprocesses run it)."""
  return os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench.py")


def command(name: str, *args: str) -> list[str]:
  """The command line that runs subcommand `name` with `args` in a fresh interpreter."""
  return [sys.executable, entry_point(), name, *args]


def usage(prog: str = "launch/bench.py") -> str:
  """The top-level help: every subcommand and what it measures."""
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
  return "\n".join(lines)


def _error(message: str) -> NoReturn:
  sys.stdout.flush()
  print(f"{PROG}: error: {message}", file=sys.stderr, flush=True)
  sys.exit(EXIT_ERROR)


def run_subcommand(name: str, args: Sequence[str]) -> NoReturn:
  """Defines subcommand `name`'s flags, then runs it like `launch.cli.run` on `args`."""
  from absl import flags  # pylint: disable=import-outside-toplevel

  from launch import cli  # pylint: disable=import-outside-toplevel

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
  if not args or args[0] not in SUBCOMMANDS:
    given = f"unknown subcommand {args[0]!r}" if args else "no subcommand given"
    _error(f"{given}; choose one of {', '.join(SUBCOMMANDS)} (--help)")
  run_subcommand(args[0], args[1:])

