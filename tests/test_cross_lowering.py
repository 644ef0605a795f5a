"""The whole engine step lowered for TPU and CUDA on this CPU-only machine (no compile).

Each test builds a tiny engine, traces its on-device loop (`SpecEngine._loop`: draft → verify →
accept → commit under `lax.while_loop`) as it would be traced on the accelerator, and lowers it
with `lowering_platforms=(platform,)`. A lowering error fails the test, so a construct one
platform cannot lower (a CPU-only custom call, a Pallas kernel written for another backend) is
caught here rather than on a lent device.

"As on the accelerator": the library picks some implementations by `jax.default_backend()` at
trace time (Pallas interpret mode on CPU, the MoE backend for "auto"); `_as_device` makes it
answer the lowering platform's backend while tracing, so the kernels' real lowerings run.
"""

from __future__ import annotations

import contextlib
import re
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxspec
from jaxspec.config import ModelConfig
from jaxspec.drafters.draft_model import DraftModelDrafter
from jaxspec.io.architectures import config_from_hf
from jaxspec.models.target import TargetModel, param_shapes
from jaxspec.speculative.engine import EngineConfig, SpecEngine

PLATFORMS = ("tpu", "cuda")
KINDS = ("plain", "chain", "tree")
KV_FORMATS = ("float", "fp8", "q4_0")
_BACKEND = {"tpu": "tpu", "cuda": "gpu"}

# Custom-call targets of the Pallas backends: Mosaic TPU; Triton and Mosaic GPU.
TPU_KERNEL = "tpu_custom_call"
TRITON_KERNEL = "__gpu$xla.gpu.triton"
MOSAIC_GPU_KERNEL = "mosaic_gpu"
# What a step may call out to per platform (a prefix each); anything else, e.g. the CPU FFI
# matmul (`jaxspec_cpu_*`) or a LAPACK call, cannot run there.
ALLOWED_CALLS = {
  "tpu": (TPU_KERNEL, "Sharding", "SPMDFullToShardShape", "SPMDShardToFullShape"),
  "cuda": (TRITON_KERNEL, MOSAIC_GPU_KERNEL, "Sharding", "SPMDFullToShardShape",
           "SPMDShardToFullShape"),
}


def _random(config: ModelConfig, seed: int) -> TargetModel:
  """Random weights drawn on the host from the parameter shapes (no init program compiles)."""
  rng = np.random.default_rng(seed)
  shapes = param_shapes(config)
  params = jax.tree_util.tree_map(
    lambda s: (0.1 * rng.standard_normal(s.shape)).astype(s.dtype), shapes
  )
  return TargetModel(config, params)


def _dense_config(**changes) -> ModelConfig:
  base = dict(
    architecture="Qwen3ForCausalLM",
    vocab_size=64,
    hidden_size=32,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=32,  # Q4_0 KV needs a multiple of 32
    intermediate_size=32,
  )
  base.update(changes)
  return ModelConfig(**base).with_options(scan_layers=False)


@pytest.fixture(scope="module")
def dense() -> TargetModel:
  return _random(_dense_config(), seed=0)


@pytest.fixture(scope="module")
def draft() -> TargetModel:
  return _random(
    _dense_config(hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16,
                  intermediate_size=16),
    seed=1,
  )


@pytest.fixture(scope="module")
def mla() -> TargetModel:
  """DeepSeek-V3-style MLA: the latent cache (kv_lora_rank + rope = 32 values a token)."""
  cfg = ModelConfig(
    architecture="DeepseekV3ForCausalLM",
    vocab_size=64,
    hidden_size=32,
    num_layers=1,
    num_heads=4,
    num_kv_heads=4,
    head_dim=16,
    intermediate_size=32,
    q_lora_rank=16,
    kv_lora_rank=24,
    qk_nope_head_dim=8,
    qk_rope_head_dim=8,
    v_head_dim=8,
    rope_interleave=True,
  )
  return _random(cfg.with_options(scan_layers=False), seed=0)


@pytest.fixture(scope="module")
def hybrid() -> TargetModel:
  """Qwen3.5-style hybrid: a Gated DeltaNet layer (recurrent state) and an attention layer."""
  cfg = config_from_hf({
    "architectures": ["Qwen3_5ForCausalLM"],
    "vocab_size": 64,
    "hidden_size": 32,
    "intermediate_size": 32,
    "num_hidden_layers": 2,
    "layer_types": ["linear_attention", "full_attention"],
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 8,
    "linear_value_head_dim": 8,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
  })
  return _random(cfg.with_options(scan_layers=False), seed=0)


@pytest.fixture(scope="module")
def moe_mxfp4() -> TargetModel:
  """A MoE target with MXFP4 experts on the ragged backend and the Pallas grouped matmul."""
  cfg = ModelConfig(
    architecture="Qwen3MoeForCausalLM",
    vocab_size=64,
    hidden_size=32,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=32,
    intermediate_size=32,
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
  ).with_options(scan_layers=False, moe_backend="ragged", gmm_impl="pallas")
  return jaxspec.quantize(_random(cfg, seed=0), (("experts", "mxfp4"),))


def _engine(target: TargetModel, draft: TargetModel, kind: str, kv_format: str) -> SpecEngine:
  drafter = None if kind == "plain" else DraftModelDrafter.from_model(draft, gamma=3)
  config = EngineConfig(
    max_len=32,
    batch_size=2,
    min_prompt_bucket=4,
    kv_format=kv_format,
    verify="tree" if kind == "tree" else "chain",
    tree_budget=4,
  )
  return SpecEngine(target, drafter, config)


@contextlib.contextmanager
def _as_device(platform: str):
  """Traces as on `platform`: jax.default_backend() answers its backend, and no trace cached
  for another platform is reused."""
  jax.clear_caches()
  try:
    with mock.patch.object(jax, "default_backend", lambda: _BACKEND[platform]):
      yield
  finally:
    jax.clear_caches()


def lower_step(engine: SpecEngine, platform: str) -> str:
  """The engine's stepping loop lowered for `platform`, as StableHLO text."""
  state = engine._abstract_state(engine.config.batch_size)  # pylint: disable=protected-access
  args = (engine.target.params, engine.drafter_params, state, jnp.int32(1))
  with _as_device(platform):
    traced = engine._loop.trace(*args)  # pylint: disable=protected-access
    return traced.lower(lowering_platforms=(platform,)).as_text()


def custom_calls(text: str) -> set[str]:
  return set(re.findall(r"custom_call @([\w$.]+)", text)) | set(
    re.findall(r'call_target_name = "([^"]+)"', text)
  )


def check_step(text: str, platform: str) -> set[str]:
  """Checks what every lowered step must show; returns its custom-call targets."""
  assert "stablehlo.while" in text  # the on-device loop
  # The state is donated: its buffers alias the outputs (no copy of the caches per call).
  assert "tf.aliasing_output" in text
  calls = custom_calls(text)
  assert not any(c.startswith("jaxspec_cpu_") for c in calls), calls
  foreign = {c for c in calls if not c.startswith(ALLOWED_CALLS[platform])}
  assert not foreign, f"custom calls {platform} cannot run: {sorted(foreign)}"
  return calls


def check_kv_storage(text: str, kv_format: str) -> None:
  """The cache format reached the step: FP8 stores E4M3, Q4_0 packed bytes."""
  if kv_format == "fp8":
    assert "f8E4M3FN" in text
  elif kv_format == "q4_0":
    assert "xui8>" in text
  else:
    assert "f8E4M3FN" not in text


def _dense_cases():
  """kind × kv_format; the tree step with a quantized cache (each part covered elsewhere) is
  slow-marked."""
  for kind in KINDS:
    for fmt in KV_FORMATS:
      marks = pytest.mark.slow if kind == "tree" and fmt != "float" else ()
      yield pytest.param(kind, fmt, marks=marks)


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("kind,kv_format", list(_dense_cases()))
def test_dense_step(dense, draft, kind, kv_format, platform):
  text = lower_step(_engine(dense, draft, kind, kv_format), platform)
  assert not check_step(text, platform)  # the XLA path: no kernel
  check_kv_storage(text, kv_format)


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("kv_format", KV_FORMATS)
def test_mla_latent_step(mla, draft, kv_format, platform):
  text = lower_step(_engine(mla, draft, "chain", kv_format), platform)
  assert not check_step(text, platform)
  check_kv_storage(text, kv_format)


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("kind", ["chain", pytest.param("tree", marks=pytest.mark.slow)])
def test_hybrid_gated_deltanet_step(hybrid, draft, kind, platform):
  text = lower_step(_engine(hybrid, draft, kind, "float"), platform)
  assert not check_step(text, platform)


@pytest.fixture(scope="module")
def quantized(dense) -> dict[str, TargetModel]:
  """The dense target with attention and MLP weights in FP8 / MXFP4 (`jaxspec.quantize`)."""
  return {f: jaxspec.quantize(dense, (("attention", f), ("mlp", f))) for f in ("fp8", "mxfp4")}


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])
def test_quantized_linear_layers_step(quantized, draft, fmt, platform):
  """Attention and MLP weights in `fmt`: dequantize-then-dot today, pallas_kernels/qmatmul
  later; either way the stored bytes enter the step and nothing CPU-only is called."""
  target = quantized[fmt]
  text = lower_step(_engine(target, draft, "chain", "float"), platform)
  calls = check_step(text, platform)
  main = text[text.index("func.func public @main") :].split("\n", 1)[0]
  assert ("f8E4M3FN" if fmt == "fp8" else "xui8>") in main  # weights enter as stored
  del calls  # a kernel (Pallas qmatmul) or none: both fine


# The MXFP4 grouped matmul on TPU: models/moe.py `grouped_matmul` calls mxfp4_gmm(impl="pallas"),
# the Triton-style GPU kernel, on every backend; Mosaic TPU then rejects its Triton compiler
# params (`assert isinstance(compiler_params, tpu_core.CompilerParams)`). The TPU kernel exists
# (impl="pallas_tpu", kernel_tpu.py, which lowers): the model should pick it on TPU.
_GMM_TPU = pytest.mark.xfail(
  raises=AssertionError, strict=True, reason="moe.grouped_matmul runs the GPU kernel on TPU"
)


@pytest.mark.parametrize("platform", [pytest.param("tpu", marks=_GMM_TPU), "cuda"])
def test_moe_mxfp4_pallas_gmm_step(moe_mxfp4, draft, platform):
  text = lower_step(_engine(moe_mxfp4, draft, "chain", "float"), platform)
  calls = check_step(text, platform)
  assert {"tpu": TPU_KERNEL, "cuda": TRITON_KERNEL}[platform] in calls
  main = text[text.index("func.func public @main") :].split("\n", 1)[0]
  assert "xui8>" in main  # the experts enter as MXFP4 bytes


# Pallas attention (attention_impl="pallas", pallas_kernels/tree_attention):
# - CUDA: its pallas_call passes no compiler params, so JAX 0.10 lowers it with Mosaic GPU by
#   default (jax_pallas_use_mosaic_gpu), not Triton, which fails: "NotImplementedError: Only copies transferring a number of bytes
#   divisible by the warpgroup size are supported. Got bytes=4 but warpgroup size is 128".
#   (mxfp4_gmm and gated_delta pass `pallas.triton.CompilerParams` for this reason.) Under the
#   Triton lowering it lowers: test_pallas_attention_step_triton.
# - TPU: there is no TPU kernel; the GPU kernel through Mosaic TPU fails (here, on a CPU-only
#   jaxlib, at its rank-1 block check: "ValueError: Unsupported TPU device kind: cpu").
_ATTN_CUDA = pytest.mark.xfail(
  raises=NotImplementedError,
  strict=True,
  reason="tree_attention's pallas_call lowers with Mosaic GPU (no Triton compiler params)",
)
_ATTN_TPU = pytest.mark.xfail(
  raises=ValueError, strict=True, reason="tree_attention has no TPU kernel"
)


@pytest.mark.parametrize(
  "platform", [pytest.param("tpu", marks=_ATTN_TPU), pytest.param("cuda", marks=_ATTN_CUDA)]
)
@pytest.mark.parametrize("kind,kv_format", [("tree", "float"), ("chain", "fp8")])
def test_pallas_attention_step(dense, draft, kind, kv_format, platform):
  target = dense.with_options(attention_impl="pallas")
  text = lower_step(_engine(target, draft, kind, kv_format), platform)
  calls = check_step(text, platform)
  kernels = {"tpu": (TPU_KERNEL,), "cuda": (TRITON_KERNEL, MOSAIC_GPU_KERNEL)}[platform]
  assert any(c.startswith(kernels) for c in calls), calls
  check_kv_storage(text, kv_format)


@contextlib.contextmanager
def _triton_lowering():
  """Pallas calls without compiler params lower to Triton on GPUs (JAX 0.10 defaults to Mosaic
  GPU, option jax_pallas_use_mosaic_gpu; later JAX versions always use Triton)."""
  try:
    old = jax.config.jax_pallas_use_mosaic_gpu
  except AttributeError:
    yield
    return
  jax.config.update("jax_pallas_use_mosaic_gpu", False)
  try:
    yield
  finally:
    jax.config.update("jax_pallas_use_mosaic_gpu", old)


@pytest.mark.parametrize("kind,kv_format", [("tree", "float"), ("chain", "fp8")])
def test_pallas_attention_step_triton(dense, draft, kind, kv_format):
  """Under the Triton lowering the attention kernel does lower for CUDA."""
  target = dense.with_options(attention_impl="pallas")
  with _triton_lowering():
    text = lower_step(_engine(target, draft, kind, kv_format), "cuda")
  assert TRITON_KERNEL in check_step(text, "cuda")
  check_kv_storage(text, kv_format)


def test_a_cpu_only_custom_call_fails_the_check():
  """The check itself: a step calling a `jaxspec_cpu_` target is refused."""
  text = 'stablehlo.while\ntf.aliasing_output\nstablehlo.custom_call @jaxspec_cpu_qmatmul(%0)'
  with pytest.raises(AssertionError):
    check_step(text, "cuda")
  with pytest.raises(AssertionError):
    check_step(text.replace("jaxspec_cpu_qmatmul", "lapack_sgesdd_ffi"), "tpu")
