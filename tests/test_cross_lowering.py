"""The whole engine step lowered for TPU and CUDA on this CPU-only machine (no compile).

Each test builds a tiny engine, traces its on-device loop (`SpecEngine._loop`: draft → verify →
accept → commit under `lax.while_loop`) as it would be traced on the accelerator, and lowers it
with `lowering_platforms=(platform,)`. A lowering error fails the test, so a construct one
platform cannot lower (a CPU-only custom call, a Pallas kernel written for another backend) is
caught here rather than on a lent device.

The platform is chosen inside the program: the model's Pallas options pick kernel or reference
with `jax.lax.platform_dependent` (jaxspec/models/platform.py), so one trace made on this host
lowers to each platform's kernels, and nothing here pretends to be another backend.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxspec
from jaxspec.config import ModelConfig
from jaxspec.drafters.draft_model import DraftModelDrafter
from jaxspec.io.architectures import config_from_hf
from jaxspec.models.target import TargetModel, param_shapes
from jaxspec.speculative.engine import SpecEngine
from jaxspec.speculative.engine_config import EngineConfig

PLATFORMS = ("tpu", "cuda")
KINDS = ("plain", "chain", "tree")
KV_FORMATS = ("float", "fp8", "q4_0")

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


def trace_step(engine: SpecEngine) -> jax.stages.Traced:
  """The engine's stepping loop traced on this host (for any platform)."""
  state = engine._shapes.abstract(engine.config.batch_size)  # pylint: disable=protected-access
  args = (engine.target.params, engine.drafter_params, state, jnp.int32(1))
  return engine._loop.trace(*args)  # pylint: disable=protected-access


def lower_step(engine: SpecEngine, platform: str) -> str:
  """The engine's stepping loop lowered for `platform`, as StableHLO text."""
  return trace_step(engine).lower(lowering_platforms=(platform,)).as_text()


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


@pytest.mark.parametrize("platform", PLATFORMS)
def test_moe_mxfp4_pallas_gmm_step(moe_mxfp4, draft, platform):
  """gmm_impl="pallas": the Mosaic TPU kernel on TPU, the Triton one on CUDA."""
  text = lower_step(_engine(moe_mxfp4, draft, "chain", "float"), platform)
  calls = check_step(text, platform)
  assert {"tpu": TPU_KERNEL, "cuda": TRITON_KERNEL}[platform] in calls
  main = text[text.index("func.func public @main") :].split("\n", 1)[0]
  assert "xui8>" in main  # the experts enter as MXFP4 bytes


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("kind,kv_format", [("tree", "float"), ("chain", "fp8")])
def test_pallas_attention_step(dense, draft, kind, kv_format, platform):
  """attention_impl="pallas": the Triton kernel on CUDA (pinned by its compiler params, not
  JAX 0.10's default Mosaic GPU); on TPU, which has no kernel, the XLA path."""
  target = dense.with_options(attention_impl="pallas")
  text = lower_step(_engine(target, draft, kind, kv_format), platform)
  calls = check_step(text, platform)
  if platform == "cuda":
    assert TRITON_KERNEL in calls, calls
  else:
    assert not calls
  check_kv_storage(text, kv_format)


def test_one_trace_lowers_for_every_platform(moe_mxfp4, draft):
  """Pallas attention and the MXFP4 grouped matmul in one step, traced once: each lowering
  keeps its platform's branch (CPU: interpret mode, no kernel call)."""
  target = moe_mxfp4.with_options(attention_impl="pallas")
  traced = trace_step(_engine(target, draft, "chain", "float"))
  text = {p: traced.lower(lowering_platforms=(p,)).as_text() for p in ("cpu", *PLATFORMS)}
  assert check_step(text["tpu"], "tpu") == {TPU_KERNEL}
  assert check_step(text["cuda"], "cuda") == {TRITON_KERNEL}
  assert not custom_calls(text["cpu"]) & {TPU_KERNEL, TRITON_KERNEL, MOSAIC_GPU_KERNEL}


def test_a_cpu_only_custom_call_fails_the_check():
  """The check itself: a step calling a `jaxspec_cpu_` target is refused."""
  text = 'stablehlo.while\ntf.aliasing_output\nstablehlo.custom_call @jaxspec_cpu_qmatmul(%0)'
  with pytest.raises(AssertionError):
    check_step(text, "cuda")
  with pytest.raises(AssertionError):
    check_step(text.replace("jaxspec_cpu_qmatmul", "lapack_sgesdd_ffi"), "tpu")


def test_a_kernel_refusing_its_operands_fails_only_its_platform():
  """kernel_or_reference: a GPU kernel that rejects the operands when traced (not in interpret
  mode) leaves the CPU and TPU lowerings alone and fails the CUDA one with its error."""
  from jaxspec.models.platform import kernel_or_reference  # pylint: disable=import-outside-toplevel

  def kernel(x, interpret):
    if not interpret:
      raise ValueError("width 4: the Triton kernel needs a power of two >= 16")
    return x + 1.0

  step = lambda x: kernel_or_reference(lambda i: kernel(x, i), lambda: x * 2.0)
  traced = jax.jit(step).trace(jnp.ones((4,)))
  tpu = traced.lower(lowering_platforms=("tpu",)).as_text()
  assert "stablehlo.multiply" in tpu and "stablehlo.add" not in tpu  # the reference
  cpu = traced.lower(lowering_platforms=("cpu",)).as_text()
  assert "stablehlo.add" in cpu and "stablehlo.multiply" not in cpu  # the interpret branch
  with pytest.raises(ValueError, match="needs a power of two"):
    traced.lower(lowering_platforms=("cuda",))
