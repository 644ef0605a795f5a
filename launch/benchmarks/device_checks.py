"""`bench.py device`: the sizes of the device and CPU runs, the rows a section records, and
the first two sections (environment, pallas kernels)."""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import functools
import json
import math
import os
import platform
import time
import traceback
import warnings
from typing import Any, Callable, Iterator, Optional, Sequence


import jax
import jax.numpy as jnp
import numpy as np

import jaxspec
from jaxspec.drafters import registry
from jaxspec.models import target as target_lib
from jaxspec.profiling import near_ties
from jaxspec.profiling import roofline
from launch import cli


SECTIONS = ("environment", "pallas", "qmatmul", "lossless", "cost", "speedup")
RESULTS = ("pass", "fail", "timeout", "skip")

# Vendor datasheet memory bandwidth (bytes/s) by device kind, a cross-check of the measured one.
NOMINAL_BANDWIDTH = {"H200": 4.8e12, "H100": 3.35e12}
# Greedy near-tie thresholds (top-2 logit gap under plain decoding): float32 as the tests'
# (jaxspec/profiling/near_ties.py), bf16 wider (its logits round at ~1e-2).
TIE_GAP = {"float32": near_ties.LOGIT_GAP, "bfloat16": 1e-2}
PROMPT_CAP = 64  # prompt tokens kept; with min_prompt_bucket = 64, one prefill program
MAX_LOOKAHEAD = 32  # γ or tree budget of every method below (DFlash's γ is 15, DDTree's 22)
FALLBACK_PROMPTS = (
  "def fib(n):\n",
  "class Stack:\n    def __init__(self):\n",
  'def read_json(path):\n    """Read a JSON file and return its contents."""\n',
  "def merge_sorted(a, b):\n    result = []\n",
)
# label -> (method, DDTree budget or 0 for chain verification).
METHOD_SPECS = {
  "plain": ("plain", 0),
  "eagle3-chain": ("eagle3", 0),
  "dflash-chain": ("dflash", 0),
  "mtp-chain": ("mtp", 0),
  "draft_model-chain": ("draft_model", 0),
  "dflash-ddtree22": ("dflash", 22),
}


# --------------------------------------------------------------------------------------------------
# Sizes: the device run and the CPU smoke run
# --------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class KernelCase:
  """One tree-attention shape: q [B, T, H, D] over a cache of S slots (stacked over `layers`)."""

  name: str
  batch: int
  block: int  # T: 1 = plain decoding, 23 = DDTree's budget 22 + the root
  heads: int
  kv_heads: int
  head_dim: int
  cache_len: int
  layers: Optional[int]  # stacked [L, B, S, K, D] cache read at layer L - 1; None: one layer
  dtype: str  # float32, bfloat16, or fp8 (float8_e4m3fn cache with float32 scales)
  tree: bool  # a random ancestor mask; False: causal in the block
  block_k: int = 64
  num_splits: Optional[int] = None


@dataclasses.dataclass(frozen=True)
class GmmCase:
  """One MXFP4 grouped-matmul shape: `rows` (token, expert) rows of width K, sorted over E
  experts (random group sizes, some empty), times [E, K, N] MXFP4 weights."""

  name: str
  rows: int
  experts: int
  k: int
  n: int
  dtype: str  # activations: float32 or bfloat16


@dataclasses.dataclass(frozen=True)
class Sizes:
  """Everything that differs between the device run and the CPU smoke run."""

  kernel_cases: tuple[KernelCase, ...]
  gmm_cases: tuple[GmmCase, ...]
  lowerings: tuple[str, ...]  # GPU Pallas lowerings to try ("interpret" on CPU)
  kernel_tolerance: dict  # dtype -> largest ‖out − ref‖ / ‖ref‖
  time_kernels: bool
  model_prefill: bool  # compare a Pallas prefill too (else only the verify block)
  model_generate: bool  # also a DDTree generation through the Pallas model path
  prompts: int
  new_tokens: int
  lossless_f32: tuple[str, ...]
  lossless_bf16: tuple[str, ...]
  speed_methods: tuple[str, ...]
  speed_prompts: int
  speed_tokens: int
  speed_repeats: int
  cost_model: dict  # roofline.dense_config kwargs
  cost_tokens: tuple[int, ...]
  cost_max_len: int
  cost_repeats: int
  bandwidth_bytes: int


DEVICE_CASES = (
  KernelCase("decode_s4096", 1, 1, 32, 8, 128, 4096, None, "float32", False),
  KernelCase("ddtree23_s2048", 2, 23, 32, 8, 128, 2048, 3, "float32", True),
  KernelCase("ddtree23_s2048", 2, 23, 32, 8, 128, 2048, 3, "bfloat16", True),
  KernelCase("ddtree23_s1024", 2, 23, 16, 4, 128, 1024, 2, "fp8", True),
  KernelCase("bundled_t23_s256", 1, 23, 4, 2, 32, 256, 4, "float32", True),
)
CPU_CASES = (
  KernelCase("ddtree7_s48", 2, 7, 4, 2, 16, 48, 2, "float32", True, block_k=16, num_splits=2),
  KernelCase("ddtree7_s48", 2, 7, 4, 2, 16, 48, 2, "bfloat16", True, block_k=16, num_splits=2),
)

# gpt-oss-20b's expert shapes (32 experts of 2880 → 2 × 2880 and back): a decode step's
# 4 rows × top-4, a DDTree verify block of 23 × 4, and a 512-token prefill chunk × 4.
DEVICE_GMM_CASES = (
  GmmCase("decode_m16", 16, 32, 2880, 5760, "bfloat16"),
  GmmCase("verify_m92", 92, 32, 2880, 5760, "bfloat16"),
  GmmCase("prefill_m2048", 2048, 32, 2880, 5760, "bfloat16"),
  GmmCase("down_m92", 92, 32, 2880, 2880, "float32"),
)
CPU_GMM_CASES = (
  GmmCase("m40", 40, 4, 128, 64, "float32"),
  GmmCase("m40", 40, 4, 128, 64, "bfloat16"),
)

DEVICE = Sizes(
  kernel_cases=DEVICE_CASES,
  gmm_cases=DEVICE_GMM_CASES,
  lowerings=("triton",),  # every kernel pins Triton (pallas.triton.CompilerParams)
  # float32 dots may run as TF32 on the GPU (~3e-4); bf16 outputs round at ~4e-3.
  kernel_tolerance={"float32": 2e-3, "fp8": 2e-3, "bfloat16": 1e-2},
  time_kernels=True,
  model_prefill=True,
  model_generate=True,
  prompts=4,
  new_tokens=64,
  lossless_f32=(
    "eagle3-chain",
    "dflash-chain",
    "mtp-chain",
    "draft_model-chain",
    "dflash-ddtree22",
  ),
  lossless_bf16=("eagle3-chain", "dflash-ddtree22"),
  speed_methods=("plain", "eagle3-chain", "dflash-ddtree22"),
  speed_prompts=4,
  speed_tokens=128,
  speed_repeats=2,
  cost_model=dict(
    hidden=4096, layers=36, intermediate=12288, vocab=151936, head_dim=128, kv_heads=8
  ),  # Qwen3-8B: 32 query heads of 128
  cost_tokens=(1, 2, 4, 8, 16, 32, 64),
  cost_max_len=4096,
  cost_repeats=5,
  bandwidth_bytes=1 << 30,
)
# The CPU run shares engines between sections through the compilation cache: the lossless
# float32 engines (batch 1, same max_len) are the speedup section's.
CPU = Sizes(
  kernel_cases=CPU_CASES,
  gmm_cases=CPU_GMM_CASES,
  lowerings=("interpret",),
  kernel_tolerance={"float32": 1e-5, "fp8": 1e-5, "bfloat16": 1e-2},
  time_kernels=False,
  model_prefill=False,
  model_generate=False,
  prompts=1,
  new_tokens=12,
  lossless_f32=("dflash-ddtree22",),
  lossless_bf16=("eagle3-chain",),
  speed_methods=("plain", "dflash-ddtree22"),
  speed_prompts=1,
  speed_tokens=12,
  speed_repeats=1,
  cost_model=dict(hidden=64, layers=2, intermediate=128, vocab=512, head_dim=16, kv_heads=2),
  cost_tokens=(1, 2, 4),
  cost_max_len=64,
  cost_repeats=3,
  bandwidth_bytes=1 << 24,
)


# --------------------------------------------------------------------------------------------------
# Rows
# --------------------------------------------------------------------------------------------------


class SkipCheck(Exception):
  """Raised inside a check: the row is "skip", with the message as its reason."""


def jsonable(value: Any) -> Any:
  """Numbers for JSON: numpy scalars as Python ones, non-finite floats as strings."""
  if isinstance(value, (np.generic,)):
    value = value.item()
  if isinstance(value, float) and not math.isfinite(value):
    return str(value)
  if isinstance(value, (list, tuple)):
    return [jsonable(v) for v in value]
  if isinstance(value, dict):
    return {str(k): jsonable(v) for k, v in value.items()}
  return value


class Recorder:
  """Runs a section's checks and appends each one's row to the rows file as it finishes.

  Before a check starts, a {"start": check} line names it, so that the parent process can
  report the check a timeout or a crash interrupted.
  """

  def __init__(self, section: str, path: str):
    self.section = section
    self.path = path

  def _write(self, obj: dict) -> None:
    with open(self.path, "a", encoding="utf-8") as f:
      f.write(json.dumps(jsonable(obj)) + "\n")

  def row(self, check: str, result: str, numbers: dict, seconds: float) -> None:
    assert result in RESULTS, result
    self._write(
      {
        "row": dict(
          section=self.section,
          check=check,
          result=result,
          numbers=numbers,
          seconds=round(seconds, 3),
        )
      }
    )

  def run(self, check: str, fn: Callable[[], Any]) -> bool:
    """Runs fn() as one row; True when it passed.

    fn returns the row's numbers (a pass) or (result, numbers); raising SkipCheck makes a
    "skip" row and any other exception a "fail" row with its one-line message (the traceback
    goes to the log).
    """
    self._write({"start": check, "t": time.time()})
    t0 = time.perf_counter()
    try:
      out = fn()
      result, numbers = out if isinstance(out, tuple) else ("pass", out)
    except SkipCheck as e:
      result, numbers = "skip", {"reason": str(e)}
    except Exception as e:  # pylint: disable=broad-except
      traceback.print_exc()
      message = cli.one_line(f"{type(e).__name__}: {e}")
      result, numbers = "fail", {"error": message[:400]}
    self.row(check, result, numbers or {}, time.perf_counter() - t0)
    print(f"[{self.section}] {check}: {result}", flush=True)
    return result == "pass"


def parallel(thunks: Sequence[Callable[[], Any]]) -> list[Any]:
  """Runs thunks in threads (XLA compiles release the GIL), returning results or exceptions."""

  def guarded(fn):
    try:
      return fn()
    except Exception as e:  # pylint: disable=broad-except
      traceback.print_exc()
      return e

  workers = max(1, min(len(thunks), os.cpu_count() or 1))
  with concurrent.futures.ThreadPoolExecutor(workers) as pool:
    return list(pool.map(guarded, thunks))


def _rel_err(got: Any, want: Any) -> tuple[float, float, int]:
  """(‖got − want‖ / ‖want‖, max |got − want|, NaN count of got), in float64."""
  got = np.asarray(jnp.asarray(got, jnp.float32), np.float64)
  want = np.asarray(jnp.asarray(want, jnp.float32), np.float64)
  nans = int(np.isnan(got).sum())
  diff = got - want
  return (
    float(np.linalg.norm(diff) / max(np.linalg.norm(want), 1e-30)),
    float(np.abs(diff).max()),
    nans,
  )


def full_precision() -> contextlib.AbstractContextManager:
  """float32 matmuls in full float32 (GPUs default to TF32). XLA:CPU computes them so at any
  setting; there the context would only change the compiled programs' cache keys."""
  if jax.default_backend() == "cpu":
    return contextlib.nullcontext()
  return jax.default_matmul_precision("highest")


# --------------------------------------------------------------------------------------------------
# 1. environment
# --------------------------------------------------------------------------------------------------

DISTRIBUTIONS = (
  "jax",
  "jaxlib",
  "jax-cuda13-plugin",
  "jax-cuda12-plugin",
  "flax",
  "optax",
  "orbax-checkpoint",
  "numpy",
  "triton",
)


def _pallas_default_lowering() -> str:
  """The GPU lowering a pallas_call without compiler_params gets in this JAX: Mosaic GPU by
  default in JAX 0.10 (option jax_pallas_use_mosaic_gpu); always Triton in 0.11, which dropped
  the option (Mosaic GPU kernels are written with plgpu.kernel there)."""
  try:
    return "mosaic_gpu" if jax.config.jax_pallas_use_mosaic_gpu else "triton"
  except AttributeError:
    return "triton"


def section_environment(rec: Recorder, sizes: Sizes, cpu: bool) -> None:
  del sizes
  import importlib.metadata  # pylint: disable=import-outside-toplevel

  def versions():
    out = {"python": platform.python_version()}
    for name in DISTRIBUTIONS:
      try:
        out[name] = importlib.metadata.version(name)
      except importlib.metadata.PackageNotFoundError:
        pass
    return out

  def backend():
    devices = jax.devices()
    d = devices[0]
    numbers = dict(
      backend=jax.default_backend(),
      devices=len(devices),
      kind=d.device_kind,
      compute_capability=getattr(d, "compute_capability", None),
      pallas_gpu_lowering=_pallas_default_lowering(),
      matmul_precision=str(jax.config.jax_default_matmul_precision),
    )
    if jax.default_backend() == "cpu" and not cpu:
      numbers["error"] = "no accelerator: pass --cpu for the CPU smoke run"
      return "fail", numbers
    return numbers

  def memory():
    stats = jax.devices()[0].memory_stats()
    if not stats:
      raise SkipCheck(f"memory_stats() is {stats!r} on {jax.default_backend()}")
    keys = ("bytes_limit", "bytes_in_use", "peak_bytes_in_use", "bytes_reservable_limit")
    out = {f"{k.replace('bytes_', '')}_gib": stats[k] / 2**30 for k in keys if k in stats}
    out["preallocate"] = os.environ.get("XLA_PYTHON_CLIENT_PREALLOCATE", "default")
    return out

  rec.run("versions", versions)
  rec.run("backend", backend)
  rec.run("memory", memory)


# --------------------------------------------------------------------------------------------------
# Engines and greedy agreement (the pallas and lossless sections)
# --------------------------------------------------------------------------------------------------


def engine_config(batch: int, new_tokens: int) -> jaxspec.EngineConfig:
  """One prompt bucket (PROMPT_CAP) and one max_len for every method of a run."""
  max_len = -(-(PROMPT_CAP + new_tokens + MAX_LOOKAHEAD + 1) // 64) * 64
  return jaxspec.EngineConfig(
    max_len=max_len, batch_size=batch, use_eos=False, min_prompt_bucket=PROMPT_CAP
  )


def make_drafter(method: str, target: jaxspec.TargetModel) -> Optional[jaxspec.Drafter]:
  asset = {"draft_model": "draft"}.get(method, method)
  draft_dir = registry.bundled_dir(asset) if method in ("draft_model", "dflash", "eagle3") else None
  if method in ("draft_model", "dflash", "eagle3") and draft_dir is None:
    raise SkipCheck(f"no bundled {asset} drafter in jaxspec/assets")
  return registry.make_drafter(method, target, draft_dir=draft_dir)


def make_engine(label: str, target: jaxspec.TargetModel, cfg: jaxspec.EngineConfig):
  method, budget = METHOD_SPECS[label]
  tree = dict(verify="tree", tree_budget=budget) if budget else {}
  return jaxspec.SpecEngine(target, make_drafter(method, target), dataclasses.replace(cfg, **tree))


def agreement(
  reference: list[list[int]], got: list[list[int]], gaps: list[np.ndarray], tie: float, stats: Any
) -> tuple[str, dict]:
  """Greedy outputs against plain decoding's: equal before each sequence's first near-tie
  (near_ties.greedy_agreement, the comparison the tests make)."""
  comparable = [near_ties.first_near_tie(gap, tie) for gap in gaps]
  result = near_ties.greedy_agreement(reference, got, comparable)
  numbers = dict(
    sequences=result.sequences,
    tokens=result.tokens,
    exact=f"{result.exact}/{result.sequences}",
    first_diff=list(result.first_diff),
    compared=result.compared / max(result.tokens, 1),
    accept_len=stats.acceptance_length,
  )
  return ("pass" if result.ok and result.compared > 0 else "fail"), numbers


# --------------------------------------------------------------------------------------------------
# 2. pallas kernels
# --------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _lowering(name: str) -> Iterator[None]:
  """Pins the GPU Pallas lowering ("triton" or "mosaic_gpu"); "interpret" changes nothing."""
  if name == "interpret":
    yield
    return
  flag = "jax_pallas_use_mosaic_gpu"
  try:
    old = getattr(jax.config, flag)
  except AttributeError:  # JAX 0.11+: pallas_call always lowers to Triton on GPUs
    if name == "mosaic_gpu":
      raise SkipCheck(f"JAX {jax.__version__} lowers pallas_call to Triton only") from None
    yield
    return
  jax.config.update(flag, name == "mosaic_gpu")
  try:
    yield
  finally:
    jax.config.update(flag, old)


def _tree_masks(rng: np.random.Generator, batch: int, t: int) -> np.ndarray:
  """bool [B, T, T] ancestor-or-self masks of random trees (node i's parent in [0, i))."""
  masks = np.zeros((batch, t, t), bool)
  for b in range(batch):
    for i in range(t):
      if i:
        masks[b, i] = masks[b, rng.integers(0, i)]
      masks[b, i, i] = True
  return masks


def _fp8(x: jax.Array, rng: np.random.Generator) -> tuple[jax.Array, jax.Array]:
  """x ≈ x8.astype(f32) * scale[..., None], per-(slot, head) scales (as the FP8 KV cache)."""
  amax = jnp.max(jnp.abs(x), axis=-1)
  scale = amax / 448.0 * jnp.asarray(rng.uniform(1.0, 2.0, size=amax.shape), jnp.float32)
  return (x / scale[..., None]).astype(jnp.float8_e4m3fn), scale.astype(jnp.float32)


def _attention_inputs(case: KernelCase, seed: int = 0) -> tuple[dict, dict]:
  """(kernel arguments, reference arguments): the kernel's cache holds NaN past each block,
  the reference reads the same values (upcast to float32) with those slots clean."""
  rng = np.random.default_rng(seed)
  b, t, s = case.batch, case.block, case.cache_len
  lead = () if case.layers is None else (case.layers,)
  q = jnp.asarray(rng.normal(size=(b, t, case.heads, case.head_dim)), jnp.float32)
  kv_shape = lead + (b, s, case.kv_heads, case.head_dim)
  k = jnp.asarray(rng.normal(size=kv_shape), jnp.float32)
  v = jnp.asarray(rng.normal(size=kv_shape), jnp.float32)
  starts = [s - t] if b == 1 else [0] + [int(x) for x in rng.integers(1, s - t + 1, b - 1)]
  start = jnp.asarray(starts, jnp.int32)
  mask = jnp.asarray(_tree_masks(rng, b, t)) if case.tree else None
  extra: dict = {}
  if case.layers is not None:
    extra["layer"] = jnp.int32(case.layers - 1)
  scales: dict = {}
  if case.dtype == "fp8":
    k, k_scale = _fp8(k, rng)
    v, v_scale = _fp8(v, rng)
    scales = dict(k_scale=k_scale, v_scale=v_scale)
  elif case.dtype == "bfloat16":
    q, k, v = (x.astype(jnp.bfloat16) for x in (q, k, v))
  live = jnp.arange(s)[:, None, None] < (start + t)[:, None, None, None]  # [B, S, 1, 1]
  poison = lambda x: jnp.where(live, x, jnp.asarray(jnp.nan, x.dtype))
  kernel = dict(q=q, k=poison(k), v=poison(v), start=start, block_mask=mask, **extra, **scales)
  up = lambda x: x if case.dtype == "fp8" else x.astype(jnp.float32)
  reference = dict(
    q=q.astype(jnp.float32), k=up(k), v=up(v), start=start, block_mask=mask, **extra, **scales
  )
  return kernel, reference


def _check_tree_attention(rec: Recorder, sizes: Sizes, cpu: bool) -> None:
  # pylint: disable=import-outside-toplevel
  from pallas_kernels.tree_attention import tree_attention_pallas, tree_attention_reference

  reference = jax.jit(tree_attention_reference)
  for case in sizes.kernel_cases:
    kernel_args, ref_args = _attention_inputs(case)
    with jax.default_matmul_precision("highest"):
      want = reference(**ref_args)
    tol = sizes.kernel_tolerance[case.dtype]
    timed = False
    for lowering in sizes.lowerings:
      run = functools.partial(
        tree_attention_pallas,
        block_k=case.block_k,
        interpret=cpu,
        num_splits=case.num_splits,
        **kernel_args,
      )

      def check(run=run, lowering=lowering):
        nonlocal timed
        with _lowering(lowering):
          got = run()
          err, max_abs, nans = _rel_err(got, want)
          numbers = dict(rel_err=err, max_abs=max_abs, nan=nans, tol=tol)
          ok = nans == 0 and err <= tol
          if ok and sizes.time_kernels and not timed:
            timed = True
            numbers["kernel_us"] = 1e6 * roofline.median_seconds(run, 20)
            numbers["xla_us"] = 1e6 * roofline.median_seconds(lambda: reference(**kernel_args), 20)
        return ("pass" if ok else "fail"), numbers

      rec.run(f"tree_attention/{case.name}/{case.dtype}/{lowering}", check)


def _gmm_inputs(case: GmmCase, seed: int = 0) -> tuple[jax.Array, ...]:
  """x [rows, K], MXFP4 values/scales of [E, K, N] weights (real scales: quantized normal
  weights), and group sizes drawn at random with every third expert empty."""
  from jaxspec.quant.formats import mxfp4_quantize  # pylint: disable=import-outside-toplevel

  rng = np.random.default_rng(seed)
  kx, kw = jax.random.split(jax.random.PRNGKey(seed))  # drawn on the device: GBs of weights
  x = jax.random.normal(kx, (case.rows, case.k), jnp.float32).astype(case.dtype)
  w = 0.02 * jax.random.normal(kw, (case.experts, case.k, case.n), jnp.float32)
  values, scales = jax.jit(functools.partial(mxfp4_quantize, axis=-2))(w)
  del w
  weights = rng.random(case.experts) * (np.arange(case.experts) % 3 != 0)
  sizes = np.floor(weights / weights.sum() * case.rows).astype(np.int32)
  sizes[np.argmax(weights)] += case.rows - sizes.sum()
  return x, values, scales, jnp.asarray(sizes)


def _check_mxfp4_gmm(rec: Recorder, sizes: Sizes, cpu: bool) -> None:
  """The GPU (Triton) kernel against the XLA path (dequantize + ragged_dot); on the device also
  its time against the XLA path and the packed weight bytes per second it streams."""
  # pylint: disable=import-outside-toplevel
  from pallas_kernels.mxfp4_gmm import mxfp4_gmm_gpu, mxfp4_gmm_reference

  reference = jax.jit(mxfp4_gmm_reference)
  for case in sizes.gmm_cases:
    x, values, scales, group_sizes = _gmm_inputs(case)
    run = functools.partial(mxfp4_gmm_gpu, x, values, scales, group_sizes, interpret=cpu)

    def check(case=case, run=run, x=x, values=values, scales=scales, gs=group_sizes):
      with jax.default_matmul_precision("highest"):
        want = reference(x.astype(jnp.float32), values, scales, gs)
      got = run()
      err, max_abs, nans = _rel_err(got, want)
      tol = sizes.kernel_tolerance[case.dtype]
      numbers = dict(rel_err=err, max_abs=max_abs, nan=nans, tol=tol)
      ok = nans == 0 and err <= tol
      if ok and sizes.time_kernels:
        kernel_s = roofline.median_seconds(run, 20)
        numbers["kernel_us"] = 1e6 * kernel_s
        numbers["xla_us"] = 1e6 * roofline.median_seconds(
          lambda: reference(x, values, scales, gs), 20
        )
        used = int(np.count_nonzero(np.asarray(gs)))  # experts whose weights are read
        packed = used * case.n * case.k * 17 // 32  # 4.25 bits per weight
        numbers["packed_gb_s"] = packed / kernel_s / 1e9
      return ("pass" if ok else "fail"), numbers

    rec.run(f"mxfp4_gmm/{case.name}/{case.dtype}/{'interpret' if cpu else 'triton'}", check)


# (name, B, T, H, Dk = Dv, chunk, block_v, q/k/v dtype) of the chunked gated delta rule: a
# Qwen3-Next linear layer's prefill (32 value heads of 128) on the device, tiny ones on CPU.
DEVICE_GDN_CASES = (
  ("prefill_t4096", 1, 4096, 32, 128, 64, 64, "bfloat16"),
  ("prefill_t1000_b2", 2, 1000, 32, 128, 64, 64, "float32"),
)
CPU_GDN_CASES = (("t40", 1, 40, 2, 16, 16, 16, "float32"),)


def _check_gated_delta(rec: Recorder, sizes: Sizes, cpu: bool) -> None:
  """The chunked gated-delta-rule kernel (Triton) against `gated_deltanet.chunked` (XLA), from
  a nonzero initial state; on the device also both times."""
  # pylint: disable=import-outside-toplevel
  from jaxspec.models import gated_deltanet as gdn
  from pallas_kernels.gated_delta import gated_delta_pallas

  reference = jax.jit(gdn.chunked, static_argnames="chunk_size")
  for name, b, t, h, d, chunk, block_v, dtype in CPU_GDN_CASES if cpu else DEVICE_GDN_CASES:
    keys = jax.random.split(jax.random.PRNGKey(0), 6)
    normal = lambda key, *shape: jax.random.normal(key, shape, jnp.float32)
    q = (gdn.l2norm(normal(keys[0], b, t, h, d)) * d**-0.5).astype(dtype)
    k = gdn.l2norm(normal(keys[1], b, t, h, d)).astype(dtype)
    v = normal(keys[2], b, t, h, d).astype(dtype)
    g = -jax.random.uniform(keys[3], (b, t, h), jnp.float32, 0.01, 1.0)
    beta = jax.nn.sigmoid(normal(keys[4], b, t, h))
    s0 = 0.1 * normal(keys[5], b, h, d, d)
    args = (q, k, v, g, beta, s0)
    run = functools.partial(
      gated_delta_pallas, *args, chunk_size=chunk, block_v=block_v, interpret=cpu
    )

    def check(args=args, run=run, chunk=chunk, dtype=dtype):
      with full_precision():
        want = reference(*args, chunk_size=chunk)
      got = run()
      err_o, max_o, nan_o = _rel_err(got[0], want[0])
      err_s, max_s, nan_s = _rel_err(got[1], want[1])
      tol = sizes.kernel_tolerance[dtype]
      numbers = {"rel_err_out": err_o, "rel_err_state": err_s, "max_abs": max(max_o, max_s)}
      numbers.update(nan=nan_o + nan_s, tol=tol)
      ok = nan_o + nan_s == 0 and max(err_o, err_s) <= tol
      if ok and sizes.time_kernels:
        numbers["kernel_us"] = 1e6 * roofline.median_seconds(run, 20)
        numbers["xla_us"] = 1e6 * roofline.median_seconds(
          lambda: reference(*args, chunk_size=chunk), 20
        )
      return ("pass" if ok else "fail"), numbers

    rec.run(f"gated_delta/{name}/{dtype}/{'interpret' if cpu else 'triton'}", check)


KERNEL_CHECKS = {
  "tree_attention": _check_tree_attention,
  "mxfp4_gmm": _check_mxfp4_gmm,
  "gated_delta": _check_gated_delta,
  "qmatmul": lambda rec, sizes, cpu: rec.row(
    "qmatmul", "skip", {"reason": "checked and timed in the qmatmul section"}, 0.0
  ),
}


def bundled_target(**changes: Any) -> jaxspec.TargetModel:
  path = registry.bundled_dir("target")
  if path is None:
    raise SkipCheck("no bundled target in jaxspec/assets/target")
  target = jaxspec.load_model(path, scan_layers=False)  # decoding's layout
  return target.with_options(**changes) if changes else target


def prompt_ids(target: jaxspec.TargetModel, n: int) -> list[list[int]]:
  """n validation-split function openings (simple code prompts where the split has too few),
  encoded and cut to PROMPT_CAP tokens."""
  texts: list[str] = []
  try:
    from jaxspec.train import data  # pylint: disable=import-outside-toplevel

    texts = data.function_prompts("validation", n=n, seed=0)
  except Exception:  # pylint: disable=broad-except  # no corpus on this machine
    traceback.print_exc()
  texts += list(FALLBACK_PROMPTS) * n
  return [target.tokenizer.encode(t)[:PROMPT_CAP] for t in texts[:n]]


def _model_path(rec: Recorder, sizes: Sizes, lowering: str) -> bool:
  """Bundled target, attention_impl pallas vs xla: a prefill (device runs only), then a
  23-token tree block on the same cache."""
  tol = sizes.kernel_tolerance["float32"]

  def check():
    with _lowering(lowering):
      models = {impl: bundled_target(attention_impl=impl) for impl in ("xla", "pallas")}
      prompt = prompt_ids(models["xla"], 1)[0]
      rng = np.random.default_rng(1)
      t = 23
      mask = jnp.asarray(_tree_masks(rng, 1, t))
      block = jnp.asarray(rng.integers(3, models["xla"].vocab_size, (1, t)), jnp.int32)
      ids, zero = jnp.asarray([prompt], jnp.int32), jnp.zeros((1,), jnp.int32)
      start = jnp.asarray([len(prompt)], jnp.int32)
      positions = start[:, None] + jnp.sum(mask, -1, dtype=jnp.int32) - 1  # tree depths
      logits: dict = {"prefill": {}, "verify": {}}
      impls = ("xla", "pallas") if sizes.model_prefill else ("xla",)
      for impl in impls:
        m = models[impl]
        pre = target_lib.forward(m.config, m.params, ids, zero, m.init_state(1, 128))
        logits["prefill"][impl] = pre.logits
        if impl == "xla":
          state = pre.state.commit(start)
      for impl, m in models.items():
        copy = jax.tree_util.tree_map(jnp.copy, state)  # each forward donates its state
        ver = target_lib.forward(
          m.config, m.params, block, start, copy, positions=positions, block_mask=mask
        )
        logits["verify"][impl] = ver.logits
      numbers: dict = {"tol": tol}
      ok = True
      for part, got in logits.items():
        if "pallas" not in got:
          continue
        err, _, nans = _rel_err(got["pallas"], got["xla"])
        agree = np.mean(np.argmax(got["pallas"], -1) == np.argmax(got["xla"], -1))
        numbers.update({f"{part}_rel_err": err, f"{part}_argmax_agree": float(agree)})
        ok = ok and nans == 0 and err <= tol
      return ("pass" if ok else "fail"), numbers

  name = "prefill+verify" if sizes.model_prefill else "verify"
  return rec.run(f"model_path/{name}/{lowering}", check)


def _model_generate(rec: Recorder, sizes: Sizes, lowering: str) -> None:
  """DFlash + DDTree decoding through the Pallas attention against plain XLA decoding."""

  def check():
    with _lowering(lowering):
      xla = bundled_target(attention_impl="xla")
      pallas = bundled_target(attention_impl="pallas")
      prompts = prompt_ids(xla, sizes.prompts)
      cfg = engine_config(len(prompts), sizes.new_tokens)
      plain = jaxspec.SpecEngine(xla, None, cfg).generate(prompts, sizes.new_tokens)
      method, budget = METHOD_SPECS["dflash-ddtree22"]
      spec_cfg = dataclasses.replace(cfg, verify="tree", tree_budget=budget)
      spec = jaxspec.SpecEngine(pallas, make_drafter(method, pallas), spec_cfg).generate(
        prompts, sizes.new_tokens
      )
      gaps = near_ties.top2_gaps(xla, prompts, plain.tokens, cfg.max_len)
      return agreement(plain.tokens, spec.tokens, gaps, TIE_GAP["float32"], spec.stats)

  rec.run(f"model_path/ddtree_generate/{lowering}", check)


def section_pallas(rec: Recorder, sizes: Sizes, cpu: bool) -> None:
  import pkgutil  # pylint: disable=import-outside-toplevel

  import pallas_kernels  # pylint: disable=import-outside-toplevel

  warnings.filterwarnings("ignore", message=".*Triton.*deprecated.*")
  kernels = sorted(m.name for m in pkgutil.iter_modules(pallas_kernels.__path__) if m.ispkg)
  for name in kernels:
    if name in KERNEL_CHECKS:
      KERNEL_CHECKS[name](rec, sizes, cpu)
    else:
      rec.run(
        name,
        lambda name=name: (
          "fail",
          {"error": f"no check for pallas_kernels/{name}: add one to {__name__}"},
        ),
      )
  for lowering in sizes.lowerings:
    if _model_path(rec, sizes, lowering) and sizes.model_generate:
      _model_generate(rec, sizes, lowering)


