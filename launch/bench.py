"""Benchmark jaxspec's speculative decoding against plain decoding and against transformers.

For one target, one draft model and a prompt set (default: the openings of functions in the
validation files of the bundled corpus), at each temperature, this runs every jaxspec method
(plain, draft_model, ngram) and, on the same weights and token ids, transformers (torch, CPU):
plain `generate`, assisted generation (`assistant_model=`) and prompt lookup
(`prompt_lookup_num_tokens=`). It prints a table of tokens/s, acceptance length and speedups,
and saves everything (per-prompt times and tokens, machine facts) as JSON.

All numbers that matter are ratios measured in one run: runners are interleaved prompt by
prompt, so slow drifts of the machine's load hit them alike. See docs/benchmarks.md.

  python launch/bench.py                                   # bundled target and draft
  python launch/bench.py --model=/hf/target --draft_model=/hf/draft --num_prompts=16
  python launch/bench.py --random=small --temperatures=0   # random models, no assets needed
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import sys
import tempfile
import time
from typing import Any, Callable, Optional, Sequence

from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # pylint: disable=wrong-import-position
import numpy as np  # pylint: disable=wrong-import-position

import jaxspec  # pylint: disable=wrong-import-position
from jaxspec.errors import ConfigError
from jaxspec import cli  # pylint: disable=wrong-import-position
from jaxspec.io import hf as hf_io  # pylint: disable=wrong-import-position
from jaxspec.drafters import registry  # pylint: disable=wrong-import-position
from jaxspec.speculative import engine as engine_lib  # pylint: disable=wrong-import-position

ASSETS = os.path.join(os.path.dirname(jaxspec.__file__), "assets")

# jaxspec method → the transformers peer that does the same thing.
HF_PEERS = {
  "plain": "generate",
  "draft_model": "assisted",
  "ngram": "prompt_lookup",
  "mtp": "mtp",
}

FLAGS = flags.FLAGS
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
flags.DEFINE_list("temperatures", ["0", "1"], "Sampling temperatures (0 = greedy).")
flags.DEFINE_integer("num_prompts", 8, "Prompts from the validation split.")
flags.DEFINE_integer("max_new_tokens", 128, "Tokens generated per prompt (EOS does not stop).")
flags.DEFINE_integer("gamma", 4, "Draft tokens per step (jaxspec and transformers alike).")
flags.DEFINE_integer("ngram_n", 3, "Longest n-gram matched by prompt lookup.")
flags.DEFINE_bool("hf", True, "Also run the transformers peers.")
flags.DEFINE_string(
  "out",
  None,
  "JSON output path (default: ./bench_results.json, or /tmp if "
  "the working directory is not writable).",
)
flags.DEFINE_integer("seed", 0, "Prompt selection and sampling seed.")
flags.DEFINE_integer(
  "repeats",
  1,
  "Runs of each (runner, prompt); the fastest counts (robust to "
  "bursts of load from other processes; outputs are identical across repeats).",
)
flags.DEFINE_integer(
  "max_len", 0, "Engine cache length; 0 = the smallest multiple of 64 that fits."
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
  "kv_format", "float", ("float", "fp8", "q4_0"), "How jaxspec stores the target's KV."
)
flags.DEFINE_enum(
  "random",
  None,
  ["tiny", "small"],
  "Benchmark random models of this size instead (no trained assets needed).",
)
flags.DEFINE_enum(
  "mode",
  "generate",
  ["generate", "cost_curve", "quant_cost"],
  "generate: methods on real prompts (the default); cost_curve: forward cost against T on "
  "random models of realistic shape, the memory roofline, and projected speedups; "
  "quant_cost: bytes read and time per decode step of those models per weight format.",
)
flags.DEFINE_list(
  "quant_policies",
  ["float32", "bfloat16", "default"],
  "quant_cost: weight formats: float32, bfloat16 (stored; computed in float32), a policy name "
  "or a policy JSON file.",
)
flags.DEFINE_enum(
  "cost_size", "1gb", ["1gb", "tiny"], "cost_curve: model sizes (tiny: seconds, for tests)."
)
flags.DEFINE_list("cost_tokens", ["1", "2", "4", "8", "16", "32", "64"], "cost_curve: T values.")
flags.DEFINE_integer("cost_max_len", 1024, "cost_curve: cache length (forwards at max_len/2).")
flags.DEFINE_integer("cost_prompts", 8, "cost_curve: bundled-pair prompts measuring τ.")
flags.DEFINE_enum(
  "random_draft",
  "truncated",
  ["truncated", "qwen3"],
  "With --random: the draft is the target's first layer, or a random Qwen3.",
)


# --------------------------------------------------------------------------------------------------
# Settings and random models
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
  kv_format: str = "float"

  def drafter_dir(self, method: str) -> Optional[str]:
    return {"draft_model": self.draft_model, "dflash": self.dflash, "eagle3": self.eagle3}.get(
      method
    )


RANDOM_SIZES = {
  # name → (GLM-4-MoE target kwargs, Qwen3 draft kwargs); vocab = the bundled 8192.
  "tiny": (
    dict(
      hidden_size=32,
      intermediate_size=64,
      moe_intermediate_size=16,
      num_hidden_layers=2,
      num_attention_heads=2,
      num_key_value_heads=1,
      head_dim=16,
      n_routed_experts=4,
    ),
    dict(
      hidden_size=32,
      intermediate_size=64,
      num_hidden_layers=1,
      num_attention_heads=2,
      num_key_value_heads=1,
      head_dim=16,
    ),
  ),
  # The bundled models' shapes (configs/tiny_code.py).
  "small": (
    dict(
      hidden_size=192,
      intermediate_size=512,
      moe_intermediate_size=128,
      num_hidden_layers=6,
      num_attention_heads=6,
      num_key_value_heads=2,
      head_dim=32,
      n_routed_experts=8,
    ),
    dict(
      hidden_size=96,
      intermediate_size=256,
      num_hidden_layers=2,
      num_attention_heads=3,
      num_key_value_heads=1,
      head_dim=32,
    ),
  ),
}


def write_random_models(
  out_dir: str, size: str = "tiny", seed: int = 0, draft: str = "truncated", damping: float = 0.15
) -> tuple[str, str]:
  """Writes a random GLM-4-MoE target and a draft model (HF layout, bundled tokenizer).

  Args:
    out_dir: folder that receives `target/` and `draft/`.
    size: a key of RANDOM_SIZES.
    seed: weight seed.
    draft: "truncated": the draft is the target's first (dense) layer with the target's
      embedding, final norm and head, and the target's later layers have their output
      projections scaled by `damping`, so the draft agrees with the target often and
      speculation has something to accept, as with a trained pair. "qwen3": an independent
      random Qwen3 draft (acceptance near zero).
    damping: output-projection scale of the target's layers after the first.

  Returns:
    (target_dir, draft_dir).
  """
  import torch  # pylint: disable=import-outside-toplevel
  import transformers  # pylint: disable=import-outside-toplevel
  from jaxspec.io.tokenizer import Tokenizer  # pylint: disable=import-outside-toplevel

  target_kw, draft_kw = RANDOM_SIZES[size]
  common = dict(
    vocab_size=8192, eos_token_id=0, pad_token_id=1, bos_token_id=None, tie_word_embeddings=True
  )
  glm = dict(
    num_experts_per_tok=2,
    n_group=1,
    topk_group=1,
    n_shared_experts=1,
    first_k_dense_replace=1,
    norm_topk_prob=True,
    partial_rotary_factor=0.5,
    num_nextn_predict_layers=0,
    **common,
  )

  def randomize(model: Any, seed_: int, damp_layers_from: Optional[int]) -> None:
    gen = torch.Generator().manual_seed(seed_)
    with torch.no_grad():  # Larger-than-init weights: peaked, repetitive next-token laws.
      for pname, p in model.named_parameters():
        if pname.endswith("norm.weight"):
          p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
        else:
          p.copy_(0.3 * torch.randn(p.shape, generator=gen))
        parts = pname.split(".")
        if (
          damp_layers_from is not None
          and "layers" in parts
          and int(parts[parts.index("layers") + 1]) >= damp_layers_from
          and ("o_proj" in pname or "down_proj" in pname)
        ):
          p.mul_(damping)

  torch.manual_seed(seed)
  target = (
    transformers.Glm4MoeForCausalLM(transformers.Glm4MoeConfig(**target_kw, **glm)).float().eval()
  )
  randomize(target, seed + 1, 1 if draft == "truncated" else None)
  if draft == "truncated":
    kw = dict(target_kw, num_hidden_layers=1)
    draft_model = transformers.Glm4MoeForCausalLM(transformers.Glm4MoeConfig(**kw, **glm))
    missing, _ = draft_model.load_state_dict(target.state_dict(), strict=False)
    if [k for k in missing if "rotary" not in k]:
      raise RuntimeError(f"truncated draft: missing {missing}")
  elif draft == "qwen3":
    torch.manual_seed(seed + 10)
    draft_model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**draft_kw, **common))
    randomize(draft_model, seed + 11, None)
  else:
    raise ConfigError(f"draft must be 'truncated' or 'qwen3', got {draft!r}")
  dirs = []
  for name, model in (("target", target), ("draft", draft_model.float().eval())):
    path = os.path.join(out_dir, name)
    model.save_pretrained(path)
    Tokenizer.bundled().save_hf(path)
    dirs.append(path)
  return dirs[0], dirs[1]


def machine_facts(
  torch_threads: Optional[int], load_at_start: Optional[list[float]] = None
) -> dict[str, Any]:
  """Cores, library versions and thread settings: what the numbers were measured on."""
  facts = {
    "platform": platform.platform(),
    "processor": platform.processor() or platform.machine(),
    "cpu_count": os.cpu_count(),
    "usable_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
    "load_average_at_start": load_at_start,
    "python": platform.python_version(),
    "jax": jax.__version__,
    "jax_backend": jax.default_backend(),
    "jax_devices": [str(d) for d in jax.devices()],
    "xla_flags": os.environ.get("XLA_FLAGS", ""),
    "numpy": np.__version__,
  }
  try:
    import flax  # pylint: disable=import-outside-toplevel

    facts["flax"] = flax.__version__
  except ImportError:
    pass
  if torch_threads is not None:
    import torch  # pylint: disable=import-outside-toplevel
    import transformers  # pylint: disable=import-outside-toplevel

    facts.update(
      torch=torch.__version__,
      transformers=transformers.__version__,
      torch_threads=torch.get_num_threads(),
      torch_interop_threads=torch.get_num_interop_threads(),
    )
  return facts


# --------------------------------------------------------------------------------------------------
# Runners: one generate call per prompt, timed from token ids in to token ids out
# --------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Run:
  """One prompt through one runner."""

  tokens: list[int]
  seconds: float
  target_passes: int  # target forwards, prefill included
  acceptance_length: float = float("nan")  # jaxspec: committed tokens per verify pass
  accept_hist: Optional[list[int]] = None
  ttft_s: float = float("nan")
  decode_s: float = float("nan")


class JaxspecRunner:
  """A jaxspec engine for one method, run one prompt at a time (tree_budget > 0: DDTree
  verification of that many draft nodes; the runner is named '<method>+tree<N>')."""

  def __init__(
    self,
    method: str,
    target: jaxspec.TargetModel,
    drafter: Any,
    max_len: int,
    tree_budget: int = 0,
    kv_format: str = "float",
  ):
    label = f"{method}+tree{tree_budget}" if tree_budget else method
    self.name, self.method = f"jaxspec/{label}", method
    tree = dict(verify="tree", tree_budget=tree_budget) if tree_budget else {}
    self.engine = jaxspec.SpecEngine(
      target,
      drafter,
      jaxspec.EngineConfig(
        method=split_method(method)[0],
        max_len=max_len,
        batch_size=1,
        use_eos=False,
        kv_format=kv_format,
        **tree,
      ),
    )

  def warmup(self, prompts: Sequence[list[int]]) -> None:
    """Compiles prefill (one per prompt bucket) and the loop, outside the timed runs."""
    cfg = self.engine.config
    seen = set()
    for p in prompts:
      bucket = engine_lib._bucket(len(p), cfg.min_prompt_bucket, cfg.max_len)  # pylint: disable=protected-access
      if bucket not in seen:
        seen.add(bucket)
        self.engine.generate([p], max_new_tokens=2, temperature=1.0)

  def compile_counts(self) -> dict[str, int]:
    return self.engine.compile_counts()

  def __call__(self, prompt: list[int], max_new_tokens: int, temperature: float, seed: int) -> Run:
    t0 = time.perf_counter()
    out = self.engine.generate(
      [prompt],
      max_new_tokens=max_new_tokens,
      temperature=temperature,
      top_k=0,
      top_p=1.0,
      seed=seed,
    )
    seconds = time.perf_counter() - t0
    st = out.stats
    return Run(
      tokens=out.tokens[0],
      seconds=seconds,
      target_passes=st.target_passes + 1,
      acceptance_length=st.acceptance_length,
      accept_hist=st.summary["accept_hist"],
      ttft_s=st.time_to_first_token_s,
      decode_s=st.decode_time_s,
    )


class HFRunner:
  """transformers `generate` in one of three modes, with its target forwards counted."""

  def __init__(self, mode: str, model: Any, assistant: Any, gamma: int, ngram_n: int, pad_id: int):
    self.name, self.mode = f"transformers/{mode}", mode
    self.model, self.passes = model, 0
    self.kwargs: dict[str, Any] = dict(eos_token_id=None, pad_token_id=pad_id)
    if mode == "assisted":
      # A fixed γ: no heuristic schedule, no confidence-based early stop (threshold 0 disables
      # both the stopping criterion and its ROC-based adaptation).
      gc = assistant.generation_config
      gc.num_assistant_tokens = gamma
      gc.num_assistant_tokens_schedule = "constant"
      gc.assistant_confidence_threshold = 0.0
      self.kwargs["assistant_model"] = assistant
    elif mode == "prompt_lookup":
      self.kwargs.update(prompt_lookup_num_tokens=gamma, max_matching_ngram_size=ngram_n)
    elif mode == "mtp":
      # transformers drafts with the checkpoint's own MTP layers (one token per layer).
      hf_io.enable_transformers_mtp(model)
      self.kwargs["use_mtp"] = True
    elif mode != "generate":
      raise ConfigError(f"unknown transformers mode {mode!r}")

  def _count(self, *unused) -> None:
    self.passes += 1

  def warmup(self, prompts: Sequence[list[int]]) -> None:
    for t in (0.0, 1.0):
      self(prompts[0], 4, t, 0)

  def __call__(self, prompt: list[int], max_new_tokens: int, temperature: float, seed: int) -> Run:
    import torch  # pylint: disable=import-outside-toplevel

    ids = torch.tensor([prompt], dtype=torch.long)
    sampling = (
      dict(do_sample=True, temperature=float(temperature), top_k=0, top_p=1.0)
      if temperature > 0
      else dict(do_sample=False)
    )
    torch.manual_seed(seed)
    self.passes = 0
    hook = self.model.register_forward_hook(self._count)
    try:
      with torch.inference_mode():
        t0 = time.perf_counter()
        out = self.model.generate(
          ids,
          attention_mask=torch.ones_like(ids),
          max_new_tokens=max_new_tokens,
          **sampling,
          **self.kwargs,
        )
        seconds = time.perf_counter() - t0
    finally:
      hook.remove()
    return Run(tokens=out[0, len(prompt) :].tolist(), seconds=seconds, target_passes=self.passes)


def choose_torch_threads(
  model: Any, prompt: list[int], new_tokens: int = 16, repeats: int = 3
) -> tuple[int, dict[int, float]]:
  """The faster torch thread count for `model.generate`, of 1 and all usable cores.

  Returns the count and the best ms/token measured for each candidate (interleaved).
  """
  import torch  # pylint: disable=import-outside-toplevel

  cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
  candidates = sorted({1, cores or 1})
  ids = torch.tensor([prompt], dtype=torch.long)
  best = {n: float("inf") for n in candidates}
  for _ in range(repeats + 1):  # the first round warms up
    for n in candidates:
      torch.set_num_threads(n)
      with torch.inference_mode():
        t0 = time.perf_counter()
        model.generate(
          ids,
          attention_mask=torch.ones_like(ids),
          max_new_tokens=new_tokens,
          do_sample=False,
          eos_token_id=None,
          pad_token_id=0,
        )
        best[n] = min(best[n], 1e3 * (time.perf_counter() - t0) / new_tokens)
  chosen = min(candidates, key=lambda n: best[n])
  return chosen, {n: round(v, 3) for n, v in best.items()}


# --------------------------------------------------------------------------------------------------
# Aggregation
# --------------------------------------------------------------------------------------------------


def _rates(hist: np.ndarray) -> list[float]:
  """P(draft i accepted | drafts < i accepted) from a histogram of accepted counts 0..γ."""
  at_least = np.cumsum(hist[::-1])[::-1]
  reached, passed = at_least[:-1], at_least[1:]
  return [float(p / r) if r else float("nan") for p, r in zip(passed, reached)]


def summarize_runs(runs: Sequence[Run], max_new_tokens: int) -> dict[str, Any]:
  """Totals and means over prompts for one runner at one temperature."""
  tokens = sum(len(r.tokens) for r in runs)
  seconds = sum(r.seconds for r in runs)
  passes = sum(r.target_passes for r in runs)
  out: dict[str, Any] = {
    "tokens_generated": tokens,
    "all_full_length": all(len(r.tokens) == max_new_tokens for r in runs),
    "wall_s": seconds,
    "tokens_per_second": tokens / seconds if seconds > 0 else float("nan"),
    "target_passes": passes,
    "tokens_per_target_pass": tokens / passes if passes else float("nan"),
    "seconds_per_prompt": [r.seconds for r in runs],
  }
  if runs and runs[0].accept_hist is not None:
    hist = np.sum([np.asarray(r.accept_hist) for r in runs], axis=0)
    verify_passes = passes - len(runs)
    out.update(
      acceptance_length=float(np.nanmean([r.acceptance_length for r in runs])),
      acceptance_length_pooled=(tokens - len(runs)) / verify_passes
      if verify_passes
      else float("nan"),
      acceptance_length_per_prompt=[r.acceptance_length for r in runs],
      acceptance_rate_per_position=_rates(hist),
      accept_hist=hist.tolist(),
      ttft_s_mean=float(np.mean([r.ttft_s for r in runs])),
      decode_s=float(sum(r.decode_s for r in runs)),
      seconds_per_target_pass=float(sum(r.decode_s for r in runs)) / max(verify_passes, 1),
    )
  return out


def greedy_check(tokens: dict[str, list[list[int]]], reference: str) -> dict[str, Any]:
  """Per runner, how many prompts' greedy outputs differ from the reference's, and where."""
  ref = tokens[reference]
  report = {}
  for name, seqs in tokens.items():
    if name == reference:
      continue
    first = []
    for a, b in zip(ref, seqs):
      diff = [i for i, (x, y) in enumerate(zip(a, b)) if x != y]
      if len(a) != len(b) and not diff:
        diff = [min(len(a), len(b))]
      first.append(diff[0] if diff else None)
    report[name] = {
      "mismatched_prompts": sum(f is not None for f in first),
      "first_mismatch_position": first,
    }
  return {"reference": reference, "vs": report}


# Issue 4's performance targets (bundled models, CPU, greedy, 128 new tokens): (name, the runner
# or ratio key measured at temperature 0, the bound).
TARGETS = (
  ("draft-model speculation ≥ 1.5× jaxspec plain", ("speedup", "jaxspec/draft_model"), 1.5),
  ("jaxspec plain ≥ 2× transformers generate", ("ratio", "plain/generate"), 2.0),
  ("jaxspec draft_model ≥ 2× transformers assisted", ("ratio", "draft_model/assisted"), 2.0),
)


def check_targets(results: dict[str, Any]) -> list[dict[str, Any]]:
  """The performance targets that this run measured (greedy), with their values."""
  entry = results.get("0")
  out = []
  if entry is None:
    return out
  for name, (kind, key), bound in TARGETS:
    if kind == "speedup":
      value = entry["runners"].get(key, {}).get("speedup_vs_plain")
    else:
      value = entry["jaxspec_over_transformers"].get(key)
    if value is not None:
      out.append({"target": name, "value": value, "bound": bound, "met": value >= bound})
  return out


# --------------------------------------------------------------------------------------------------
# Cost model: single forwards timed in isolation
# --------------------------------------------------------------------------------------------------


def _time_call(fn: Callable[[], Any], repeats: int) -> float:
  jax.block_until_ready(fn())
  best = float("inf")
  for _ in range(3):
    t0 = time.perf_counter()
    for _ in range(repeats):
      jax.block_until_ready(fn())
    best = min(best, (time.perf_counter() - t0) / repeats)
  return best


def profile_forwards(
  target: jaxspec.TargetModel,
  draft: Optional[jaxspec.TargetModel],
  gamma: int,
  max_len: int,
  repeats: int = 20,
) -> dict[str, float]:
  """Seconds per jitted forward at position max_len/2: target on 1 and γ+1 tokens, draft on 1.

  The floor of one engine step: plain ≈ t_target(1); draft-model speculation ≈
  t_target(γ+1) + γ·t_draft(1) + t_draft(2) per step. Comparing these with the measured
  seconds per target pass shows the engine's own overhead.
  """
  from jaxspec.models import target as target_lib  # pylint: disable=import-outside-toplevel

  def forward_s(model: jaxspec.TargetModel, n: int) -> float:
    state = model.init_state(1, max_len)
    fn = jax.jit(lambda p, t, s, st: target_lib.apply_decoder(model.config, p, t, s, st).logits)
    toks = np.ones((1, n), np.int32)
    start = np.full((1,), max_len // 2, np.int32)
    return _time_call(lambda: fn(model.params, toks, start, state), repeats)

  out = {
    "target_1_token_s": forward_s(target, 1),
    f"target_{gamma + 1}_tokens_s": forward_s(target, gamma + 1),
  }
  if draft is not None:
    out["draft_1_token_s"] = forward_s(draft, 1)
    out["draft_2_tokens_s"] = forward_s(draft, 2)
    out["draft_step_floor_s"] = (
      out[f"target_{gamma + 1}_tokens_s"]
      + (gamma - 1) * out["draft_1_token_s"]
      + out["draft_2_tokens_s"]
    )
  return out


# --------------------------------------------------------------------------------------------------
# The benchmark
# --------------------------------------------------------------------------------------------------


def _log(cfg: BenchConfig, msg: str) -> None:
  if cfg.verbose:
    print(msg, flush=True)


def load_prompts(cfg: BenchConfig) -> list[str]:
  if cfg.prompts is not None:
    return list(cfg.prompts)[: cfg.num_prompts]
  return data_prompts(cfg.num_prompts, cfg.seed)


ARGMAX = ":argmax"  # runner-name suffix: DFlash drafts the argmax at every temperature


def split_method(name: str) -> tuple[str, Optional[int]]:
  """'eagle3@15' → ('eagle3', 15): a method with its own draft length; 'eagle3' → (…, None).

  A trailing ':argmax' ('dflash:argmax', 'dflash@7:argmax') is dropped here: it asks DFlash to
  draft the argmax at T > 0 too (`drafter_options`), the reference's rule, instead of sampling."""
  name = name.removesuffix(ARGMAX)
  base, sep, gamma = name.partition("@")
  if not sep:
    return name, None
  if not gamma.isdigit() or int(gamma) < 1:
    raise ConfigError(f"method {name!r}: the draft length after '@' must be an integer ≥ 1")
  return base, int(gamma)


def drafter_options(name: str) -> dict[str, Any]:
  """The drafter keyword arguments a runner name asks for ('dflash:argmax': argmax drafts)."""
  if not name.endswith(ARGMAX):
    return {}
  if split_method(name)[0] != "dflash":
    raise ConfigError(
      f"method {name!r}: ':argmax' applies to DFlash (the other drafters sample their drafts "
      "at T > 0)"
    )
  return {"sample_drafts": False}


def run_benchmark(cfg: BenchConfig) -> dict[str, Any]:
  """Runs the whole benchmark; returns the results dict (also written to cfg.out if set)."""
  for m in cfg.methods:
    if split_method(m)[0] not in registry.METHODS:
      raise ConfigError(f"unknown method {m!r}; choose from {registry.METHODS}")
    drafter_options(m)  # refuses ':argmax' where it means nothing
  bases = [split_method(m)[0] for m in cfg.methods]
  for m in ("draft_model", "dflash", "eagle3"):
    if m in bases + list(cfg.tree_methods if cfg.tree_budgets else ()):
      if not cfg.drafter_dir(m):
        raise ConfigError(f"method {m} needs a drafter directory (--{m})")
  methods = ["plain"] + [m for m in cfg.methods if m != "plain"]  # plain is the baseline
  load_at_start = list(os.getloadavg()) if hasattr(os, "getloadavg") else None

  target = jaxspec.load_model(cfg.model, scan_layers=False)  # decoding's layout
  if target.tokenizer is None and cfg.prompts is None:
    raise ConfigError(f"{cfg.model} has no tokenizer.json: text prompts cannot be encoded")
  draft = jaxspec.load_model(cfg.draft_model, scan_layers=False) if "draft_model" in bases else None
  texts = load_prompts(cfg)
  if not texts:
    raise ConfigError("no prompts")
  prompts = [target.tokenizer.encode(t) for t in texts]
  drafters: dict[str, Any] = {}
  for m in dict.fromkeys(methods + (list(cfg.tree_methods) if cfg.tree_budgets else [])):
    base, gamma = split_method(m)
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
        **drafter_options(m),
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
      torch_threads, thread_timings = choose_torch_threads(hf_models[0], prompts[0])
      _log(cfg, f"torch threads: {torch_threads} (ms/token by thread count: {thread_timings})")
    torch.set_num_threads(torch_threads)

  # Runners, in the order they run on each prompt.
  runners: list[Any] = []
  for m in methods:
    runners.append(JaxspecRunner(m, target, drafters[m], max_len, kv_format=cfg.kv_format))
  for m in cfg.tree_methods if cfg.tree_budgets else ():
    for n in cfg.tree_budgets:
      runners.append(
        JaxspecRunner(m, target, drafters[m], max_len, tree_budget=int(n), kv_format=cfg.kv_format)
      )
  if hf_models is not None:
    pad = target.config.pad_token_id if target.config.pad_token_id is not None else 0
    for m in methods:
      if m in HF_PEERS:
        runners.append(
          HFRunner(HF_PEERS[m], hf_models[0], hf_models[1], cfg.gamma, cfg.ngram_n, pad)
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
  counts_before = {r.name: r.compile_counts() for r in runners if isinstance(r, JaxspecRunner)}

  results: dict[str, Any] = {}
  for temp in cfg.temperatures:
    runs: dict[str, list[Run]] = {r.name: [] for r in runners}
    for i, p in enumerate(prompts):
      for r in runners:  # interleaved: load drifts hit every runner alike
        tries = [
          r(p, cfg.max_new_tokens, float(temp), cfg.seed + i) for _ in range(max(cfg.repeats, 1))
        ]
        runs[r.name].append(min(tries, key=lambda run: run.seconds))
      _log(cfg, f"  T={temp:g}: prompt {i + 1}/{len(prompts)} done")
    res = {name: summarize_runs(rs, cfg.max_new_tokens) for name, rs in runs.items()}
    for side in ("jaxspec", "transformers"):
      base = res.get(f"{side}/{'plain' if side == 'jaxspec' else 'generate'}")
      for name, s in res.items():
        if name.startswith(side) and base:
          s["speedup_vs_plain"] = s["tokens_per_second"] / base["tokens_per_second"]
    ratios = {}
    if hf_models is not None:
      for m in (m for m in methods if m in HF_PEERS):
        ratios[f"{m}/{HF_PEERS[m]}"] = (
          res[f"jaxspec/{m}"]["tokens_per_second"]
          / res[f"transformers/{HF_PEERS[m]}"]["tokens_per_second"]
        )
    entry: dict[str, Any] = {
      "runners": res,
      "jaxspec_over_transformers": ratios,
      "tokens": {n: [r.tokens for r in rs] for n, rs in runs.items()},
    }
    if temp == 0:
      entry["greedy_check"] = greedy_check(entry["tokens"], "jaxspec/plain")
    results[f"{float(temp):g}"] = entry

  recompiled = {
    r.name: r.compile_counts() != counts_before[r.name]
    for r in runners
    if isinstance(r, JaxspecRunner)
  }
  report: dict[str, Any] = {
    "config": {k: v for k, v in dataclasses.asdict(cfg).items() if k != "verbose"},
    "max_len": max_len,
    "tokens_per_second_definition": "generated tokens / wall seconds of the whole generate "
    "call (prefill included), token ids in → token ids out, "
    "summed over prompts, batch 1 (with repeats > 1: the "
    "fastest repeat of each prompt)",
    "machine": machine_facts(torch_threads, load_at_start),
    "models": {
      "target": cfg.model,
      "target_architecture": target.config.architecture,
      "draft": cfg.draft_model if draft is not None else None,
      "draft_architecture": draft.config.architecture if draft is not None else None,
    },
    "prompts": [{"text": t, "num_tokens": len(p)} for t, p in zip(texts, prompts)],
    "recompiled_during_timing": recompiled,
    "results": results,
  }
  report["targets"] = check_targets(results)
  if cfg.profile:
    report["profile"] = profile_forwards(target, draft, cfg.gamma, max_len)
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
  sweep = {
    t: sorted(
      (int(n.rsplit("tree", 1)[1]), s)
      for n, s in report["results"][t]["runners"].items()
      if "+tree" in n
    )
    for t in temps
  }
  has_sweep = any(sweep.values())
  fig, axes = plt.subplots(
    1, len(temps) + has_sweep, figsize=(5 * (len(temps) + has_sweep), 4), squeeze=False
  )
  for ax, t in zip(axes[0], temps):
    for name, s in report["results"][t]["runners"].items():
      rates = s.get("acceptance_rate_per_position") or []
      if len(rates) and "+tree" not in name:
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
          label=f"acceptance length, T={t}",
        )
        ax.plot(
          budgets,
          [s.get("speedup_vs_plain", float("nan")) for _, s in points],
          marker="s",
          ls="--",
          label=f"speedup vs plain, T={t}",
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
# Cost curves (--mode=cost_curve)
# --------------------------------------------------------------------------------------------------

# (dense, MoE) model shapes of ≥ 1 GB of float32 weights, and tiny ones for tests.
COST_MODELS = {
  "1gb": {
    "dense": dict(hidden=2048, layers=4, intermediate=8192, vocab=32768),
    "moe": dict(
      hidden=2048, layers=2, experts=32, experts_per_tok=4, expert_intermediate=768, vocab=32768
    ),
  },
  "tiny": {
    "dense": dict(hidden=64, layers=2, intermediate=128, vocab=512, head_dim=16, kv_heads=2),
    "moe": dict(
      hidden=64,
      layers=2,
      experts=8,
      experts_per_tok=2,
      expert_intermediate=32,
      vocab=512,
      head_dim=16,
      kv_heads=2,
    ),
  },
}

# What the bundled pair runs for the projection: (label, drafter method, γ, tree budget or 0).
PROJECTED_METHODS = (
  ("eagle3 chain γ=4", "eagle3", 4, 0),
  ("eagle3 chain γ=15", "eagle3", 15, 0),
  ("dflash chain γ=15", "dflash", 15, 0),
  ("dflash + ddtree 8", "dflash", 15, 8),
  ("dflash + ddtree 22", "dflash", 15, 22),
  ("dflash + ddtree 32", "dflash", 15, 32),
)


def measure_acceptance(num_prompts: int, max_new_tokens: int = 96) -> dict[str, float]:
  """Pooled acceptance length τ (tokens per verify pass, bonus included) of each
  PROJECTED_METHODS entry on the bundled target and drafters, greedy; {} without them."""
  target_dir = registry.bundled_dir("target")
  if target_dir is None or num_prompts < 1:
    return {}
  target = jaxspec.load_model(target_dir, scan_layers=False)
  texts = data_prompts(num_prompts)
  prompts = [target.tokenizer.encode(t) for t in texts]
  max_len = -(-(max(map(len, prompts)) + max_new_tokens + 34) // 64) * 64
  taus = {}
  for label, method, gamma, budget in PROJECTED_METHODS:
    if registry.bundled_dir(method) is None:
      continue
    drafter = registry.make_drafter(
      method, target, gamma=gamma, draft_dir=registry.bundled_dir(method)
    )
    tree = dict(verify="tree", tree_budget=budget) if budget else {}
    engine = jaxspec.SpecEngine(
      target, drafter, jaxspec.EngineConfig(max_len=max_len, use_eos=False, **tree)
    )
    tokens = passes = 0
    for p in prompts:
      out = engine.generate([p], max_new_tokens=max_new_tokens)
      tokens += out.stats.tokens_generated
      passes += out.stats.target_passes
    taus[label] = tokens / max(passes, 1)
  return taus


def data_prompts(n: int, seed: int = 0) -> list[str]:
  """n function openings from the validation split (the bench's default prompts)."""
  from jaxspec.train import data  # pylint: disable=import-outside-toplevel

  return data.function_prompts(split="validation", n=n, seed=seed)


def run_cost_curves(
  size: str, tokens: Sequence[int], max_len: int, num_prompts: int, out: str
) -> dict[str, Any]:
  """Cost curves of the COST_MODELS[size] models (both layer layouts for the dense one), the
  reference bandwidth, drafter step costs at each model's scale, and projected speedups
  τ · t(1) / (t_verify + t_draft) with τ measured on the bundled pair. Saves JSON and a PNG."""
  from jaxspec.profiling import roofline  # pylint: disable=import-outside-toplevel

  shapes = COST_MODELS[size]
  bandwidth = roofline.reference_bandwidth(roofline.GIB if size == "1gb" else 1 << 24)
  peak_flops = roofline.reference_flops(2048 if size == "1gb" else 256)
  position = max_len // 2
  curves: dict[str, list] = {}
  drafts: dict[str, dict[str, float]] = {}
  lines = [
    f"reference bandwidth: stream {bandwidth['stream'] / 1e9:.1f} GB/s, matvec "
    f"{bandwidth['matvec'] / 1e9:.1f} GB/s (float32, jax {jax.__version__}, "
    f"{jax.default_backend()}); compute ceiling {peak_flops / 1e9:.0f} GFLOP/s (one square "
    f"matmul; ridge point {peak_flops / bandwidth['best']:.1f} FLOP/byte); forwards at "
    f"position {position} of {max_len}",
    "",
  ]
  for kind, kw in shapes.items():
    make = roofline.dense_config if kind == "dense" else roofline.moe_config
    layouts = (False, True) if kind == "dense" else (False,)
    for scan in layouts:
      config = make(**kw).with_options(scan_layers=scan)
      params = roofline.random_params(config)
      name = f"{kind} ({'scanned' if scan else 'unrolled'} layers)"
      curves[name] = roofline.cost_curve(config, params, tokens, max_len, position)
      lines += roofline.curve_table(name, curves[name], bandwidth["best"], peak_flops) + [""]
      if not scan:
        target = jaxspec.TargetModel(config, params)
        drafts[kind] = {}
        for label, method, gamma, _ in PROJECTED_METHODS:
          key = f"{method} γ={gamma}"
          if key not in drafts[kind]:
            drafter = roofline.random_drafter(method, target, gamma)
            drafts[kind][key] = roofline.drafter_step_seconds(
              drafter, config.hidden_size, max_len, position
            )
      del params
  taus = measure_acceptance(num_prompts)
  projections: dict[str, dict[str, float]] = {}
  if taus:
    lines.append(
      "projected speedup over plain decoding: τ · t(1) / (t_verify + t_draft), τ "
      "pooled on the bundled pair (greedy), costs of the random models above"
    )
    lines.append(f"{'method':<22}{'τ':>6}" + "".join(f"{k:>14}" for k in drafts))
    for label, method, gamma, budget in PROJECTED_METHODS:
      if label not in taus:
        continue
      width = (budget or gamma) + 1
      row = f"{label:<22}{taus[label]:>6.2f}"
      for kind in drafts:
        pts = curves[f"{kind} (unrolled layers)"]
        t_draft = drafts[kind][f"{method} γ={gamma}"]
        sp = roofline.project_speedup(
          taus[label], pts[0].seconds, roofline.interpolate(pts, width), t_draft
        )
        projections.setdefault(label, {})[kind] = sp
        row += f"{sp:>13.2f}×"
      lines.append(row)
    lines.append(
      "drafter step ms: "
      + "; ".join(
        f"{kind}: " + ", ".join(f"{k} {1e3 * v:.1f}" for k, v in d.items())
        for kind, d in drafts.items()
      )
    )
  report = {
    "bandwidth_bytes_per_s": bandwidth,
    "peak_flops_per_s": peak_flops,
    "max_len": max_len,
    "position": position,
    "curves": {name: [dataclasses.asdict(p) for p in pts] for name, pts in curves.items()},
    "drafter_step_s": drafts,
    "acceptance_length": taus,
    "projected_speedup": projections,
    "machine": machine_facts(None, list(os.getloadavg()) if hasattr(os, "getloadavg") else None),
    "table": "\n".join(lines),
    "out": out,
  }
  os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
  with open(out, "w", encoding="utf-8") as f:
    json.dump(report, f, indent=1, default=float)
  png = os.path.splitext(out)[0] + ".png"
  report["plot"] = png if roofline.plot_curves(curves, bandwidth["best"], png, peak_flops) else None
  return report


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
      if side == "jaxspec" and f"{method}/{HF_PEERS.get(method)}" in ratios:
        ratio = f"{ratios[f'{method}/{HF_PEERS[method]}']:.2f}× vs {HF_PEERS[method]}"
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


def _default_out() -> str:
  cwd = os.getcwd()
  return (
    os.path.join(cwd, "bench_results.json")
    if os.access(cwd, os.W_OK)
    else os.path.join(tempfile.gettempdir(), "bench_results.json")
  )


def run_quant_costs(
  size: str, tokens: Sequence[int], max_len: int, policies: Sequence[str], out: str
) -> dict[str, Any]:
  """Per weight format (float32, bfloat16, quantization policies) of the COST_MODELS[size]
  models: stored weight bytes, bytes a decode step reads, and forward times at `tokens`."""
  from jaxspec.profiling import roofline  # pylint: disable=import-outside-toplevel
  from jaxspec.quant import policy as policy_lib  # pylint: disable=import-outside-toplevel

  rows = []
  for kind, kw in COST_MODELS[size].items():
    make = roofline.dense_config if kind == "dense" else roofline.moe_config
    base = make(**kw).with_options(scan_layers=False)
    for name in policies:
      config, params = base, roofline.random_params(base)
      if name == "bfloat16":  # stored bf16, computed in float32 (XLA:CPU has no bf16 dots)
        config = base.with_options(param_dtype="bfloat16")
        params = jax.tree_util.tree_map(lambda x: x.astype(jax.numpy.bfloat16), params)
      elif name != "float32":
        params = jaxspec.quantize(
          jaxspec.TargetModel(base, params), policy_lib.load_policy(name)
        ).params
      points = roofline.cost_curve(config, params, tokens, max_len)
      stored = roofline.tree_bytes_stored(params)
      rows.append(
        {
          "model": kind,
          "weights": name,
          "stored_bytes": stored,
          "step_bytes": points[0].weight_bytes,
          "seconds": {p.tokens: p.seconds for p in points},
        }
      )
      del params
  f32 = {r["model"]: r for r in rows if r["weights"] == "float32"}
  lines = [
    f"{'model':>6} {'weights':>10} {'stored GB':>10} {'step reads GB':>14} "
    + "".join(f"{f't({t}) ms':>11}" for t in tokens)
    + f" {'tok/s (T=1)':>12} {'bytes × f32':>12}"
  ]
  for r in rows:
    base_bytes = f32.get(r["model"], r)["step_bytes"]
    lines.append(
      f"{r['model']:>6} {r['weights']:>10} {r['stored_bytes'] / 1e9:>10.3f} "
      f"{r['step_bytes'] / 1e9:>14.3f} "
      + "".join(f"{1e3 * r['seconds'][t]:>11.1f}" for t in tokens)
      + f" {1 / r['seconds'][tokens[0]]:>12.1f} {r['step_bytes'] / base_bytes:>12.3f}"
    )
  report = {"rows": rows, "table": "\n".join(lines), "out": out}
  os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
  with open(out, "w", encoding="utf-8") as f:
    json.dump(report, f, indent=1, default=float)
  return report


def main(argv: Sequence[str]) -> None:
  del argv
  if FLAGS.mode == "quant_cost":
    report = run_quant_costs(
      size=FLAGS.cost_size,
      tokens=tuple(int(t) for t in FLAGS.cost_tokens),
      max_len=FLAGS.cost_max_len,
      policies=FLAGS.quant_policies,
      out=FLAGS.out or _default_out().replace("bench_results", "quant_cost"),
    )
    print(report["table"])
    print(f"\nsaved {report['out']}")
    return
  if FLAGS.mode == "cost_curve":
    report = run_cost_curves(
      size=FLAGS.cost_size,
      tokens=tuple(int(t) for t in FLAGS.cost_tokens),
      max_len=FLAGS.cost_max_len,
      num_prompts=FLAGS.cost_prompts,
      out=FLAGS.out or _default_out().replace("bench_results", "cost_curve"),
    )
    print(report["table"])
    print(f"\nsaved {report['out']} and {report['plot'] or '(no plot: matplotlib missing)'}")
    return
  if FLAGS.random:
    with tempfile.TemporaryDirectory(prefix="jaxspec_bench_") as tmp:
      _main(*write_random_models(tmp, FLAGS.random, FLAGS.seed, FLAGS.random_draft))
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
    out=FLAGS.out or _default_out(),
    dflash=FLAGS.dflash or _bundled_drafter("dflash"),
    eagle3=FLAGS.eagle3 or _bundled_drafter("eagle3"),
    tree_budgets=tuple(int(n) for n in FLAGS.tree_budgets),
    tree_methods=tuple(FLAGS.tree_methods),
    seed=FLAGS.seed,
    repeats=FLAGS.repeats,
    max_len=FLAGS.max_len,
    torch_threads=FLAGS.torch_threads,
    profile=FLAGS.profile,
    kv_format=FLAGS.kv_format,
  )
  report = run_benchmark(cfg)
  print()
  print(report["table"])
  print(f"\nsaved {cfg.out}")


if __name__ == "__main__":
  cli.run(main)
