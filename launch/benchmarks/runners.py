"""The generate benchmark's parts: random model pairs, timed runners (jaxspec and
transformers), their summaries, and single forwards timed in isolation (a cost model)."""

from __future__ import annotations

import dataclasses
import os
import platform
import tempfile
import time
from typing import Any, Callable, Optional, Sequence

import jax
import numpy as np

import jaxspec
from jaxspec.errors import ConfigError
from jaxspec.io import hf as hf_io
from jaxspec.speculative import engine as engine_lib

# jaxspec method → the transformers peer that does the same thing.
HF_PEERS = {
  "plain": "generate",
  "draft_model": "assisted",
  "ngram": "prompt_lookup",
  "mtp": "mtp",
}


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


DEFAULT_TREE_RULE = jaxspec.EngineConfig.tree_rule


class JaxspecRunner:
  """A jaxspec engine for one method, run one prompt at a time (tree_budget > 0: DDTree
  verification of that many draft nodes; the runner is named '<method>+tree<N>', with
  '[<rule>]' after it for a tree rule other than the engine's default)."""

  def __init__(
    self,
    method: str,
    target: jaxspec.TargetModel,
    drafter: Any,
    max_len: int,
    tree_budget: int = 0,
    kv_format: str = "float",
    tree_rule: Optional[str] = None,
  ):
    label = f"{method}+tree{tree_budget}" if tree_budget else method
    if tree_budget and tree_rule and tree_rule != DEFAULT_TREE_RULE:
      label += f"[{tree_rule}]"
    self.name, self.method = f"jaxspec/{label}", method
    tree = dict(verify="tree", tree_budget=tree_budget) if tree_budget else {}
    if tree_budget and tree_rule:
      tree["tree_rule"] = tree_rule
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


def default_out(stem: str = "bench_results") -> str:
  """./<stem>.json, or in the temporary folder when the working directory is not writable."""
  cwd = os.getcwd()
  folder = cwd if os.access(cwd, os.W_OK) else tempfile.gettempdir()
  return os.path.join(folder, f"{stem}.json")
