"""DFlash: logits against an explicit recomputation and transformers, losslessness, checkpoints."""

from __future__ import annotations

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import jaxspec
from jaxspec.drafters.base import PrefillContext
from jaxspec.drafters.dflash import DFlashDrafter
from jaxspec.models import target as target_lib
from jaxspec.speculative.engine import SpecEngine
from jaxspec.speculative.engine_config import EngineConfig

from tests.drafter_models import (
  dflash_reference_logits,
  GreedyCheck,
  exact_sequence_probs,
  prompts,
  sampled_pvalue,
  small_dflash,
  small_target,
  transformers_dflash,
)

MASK = 2


@pytest.fixture(scope="module")
def target():
  return small_target(num_layers=3)


@pytest.fixture(scope="module")
def drafter(target):
  return small_dflash(target)


@pytest.fixture(scope="module")
def greedy(target, drafter):
  return GreedyCheck(target, drafter)


# ------------------------------------------------------------------------------------------------
# An explicit float64 re-computation: plain attention over [context; block]
# ------------------------------------------------------------------------------------------------


def reference_logits(drafter, target, taps, block, start, windows, keep=0):
  """taps [n_taps, n, H] (positions 0..n−1), block [T] at start..: logits [T, V] (float64).
  windows: per layer, each query sees context positions less than W behind it; keep: the block
  sees only the `keep` most recent context positions (the context ring)."""
  n, t = taps.shape[1], len(block)
  qpos = start + np.arange(t)
  visible = []
  for window in windows:
    vis = np.ones((t, n + t), bool)
    if window:
      vis[:, :n] = (qpos[:, None] - np.arange(n)[None]) < window
    if keep:
      vis[:, :n] &= np.arange(n)[None] >= n - keep
    visible.append(vis)
  return dflash_reference_logits(drafter, target, taps, block, qpos, visible)


def _check_final_state(target, drafter, engine, windows, keep=0):
  """Generates, then compares the drafter's block logits with the explicit re-computation."""
  state = engine.init_state(prompts(2, 64), max_new_tokens=21)
  state = engine._loop(engine.target.params, drafter.params, state)  # pylint: disable=protected-access
  tokens, seq = np.asarray(state.tokens), np.asarray(state.seq_len)
  # The whole buffer: one compilation; causal, so the tail is harmless.
  full = target_lib.forward(target.config, target.params, jnp.asarray(tokens), taps=drafter.taps)
  start = jnp.asarray(seq - 1)
  block = np.concatenate(
    [tokens[np.arange(2), seq - 1][:, None], np.full((2, drafter.gamma), MASK)], axis=1
  )
  got = np.asarray(
    drafter.block_logits(drafter.params, state.drafter_state, jnp.asarray(block), start)
  )
  for b in range(2):
    n = int(seq[b]) - 1
    want = reference_logits(
      drafter, target, np.asarray(full.taps[:, b, :n], np.float64), block[b], n, windows, keep
    )
    np.testing.assert_allclose(got[b], want, atol=2e-4, rtol=2e-4)


@pytest.mark.parametrize("batch", [1, 2])
def test_greedy_speculation_equals_plain(greedy, batch):
  greedy.check(batch)


def test_tree_verification_greedy_equals_plain(greedy):
  """DDTree verification: the accepted path, not the drafter's chain, reaches commit."""
  greedy.check(2, tree_budget=6)


def test_logits_equal_explicit_recomputation(target, drafter, greedy):
  """After a whole generation (prefill + commits), the stored context K/V give the logits of
  plain non-causal attention over [all committed context; block]."""
  _check_final_state(target, drafter, greedy.spec, windows=(0, 0))


def test_sliding_windows_and_context_ring(target, drafter, greedy):
  """A 6-slot ring of context features (wrapped many times: every block sees the last 6) and
  a 5-wide layer window."""
  windowed = dataclasses.replace(
    drafter, config=drafter.config.replace(layer_windows=(0, 5)), context_window=6
  )
  cfg = EngineConfig(max_len=80, batch_size=2, use_eos=False)
  engine = SpecEngine(target, windowed, cfg)
  assert windowed.init_state(None, 2, 80).ctx_k.shape[2] == 6
  ps = prompts(2, 64)
  assert (
    engine.generate(ps, max_new_tokens=24).tokens
    == greedy.plain.generate(ps, max_new_tokens=24).tokens
  )
  _check_final_state(target, windowed, engine, windows=(0, 5), keep=6)


def test_matches_transformers_dflash_model(target, drafter):
  """transformers' DFlash-architecture model (MuseGlimmerAssistant) on the same weights."""
  _check_against_transformers(target, drafter)


def _check_against_transformers(target, drafter):
  torch = pytest.importorskip("torch")
  pytest.importorskip("transformers")
  model = transformers_dflash(drafter)
  if model is None:
    pytest.skip("this transformers has no DFlash-architecture model")
  toks = np.asarray(prompts(1, 64)[0], np.int32)
  n = len(toks)
  out = target_lib.forward(target.config, target.params, jnp.asarray(toks[None]), taps=drafter.taps)
  block = np.array([toks[-1]] + [MASK] * drafter.gamma)
  with torch.no_grad():
    ctx = torch.from_numpy(np.concatenate(list(np.asarray(out.taps[:, 0])), -1)[None])
    emb = torch.from_numpy(np.asarray(target.params["embed"])[block][None])
    pos = torch.arange(n + len(block))[None]
    h = model(noise_embeds=emb, context_hidden_states=ctx, position_ids=pos).last_hidden_state
  want = h[0].numpy() @ np.asarray(target.params["lm_head"]["kernel"])
  st = drafter.init_state(drafter.params, 1, 32)
  st = drafter.prefill(
    drafter.params,
    st,
    PrefillContext(jnp.asarray(toks[None]), jnp.array([n]), out.taps, out.hidden),
  )
  got = drafter.block_logits(drafter.params, st, jnp.asarray(block[None]), jnp.array([n]))
  np.testing.assert_allclose(np.asarray(got[0]), want, atol=2e-4, rtol=2e-4)


@pytest.mark.parametrize("sample_drafts", [True, False])
def test_sampled_sequences_follow_the_target_distribution(sample_drafts):
  target = small_target(vocab=6, num_layers=2, seed=3, factor=2.0)
  prompt, length = [1, 4, 2], 3
  outcomes, probs = exact_sequence_probs(target, prompt, length)
  drafter = DFlashDrafter.random(
    target,
    mask_token_id=MASK,
    num_layers=1,
    block_size=3,
    target_layer_ids=(0, 1),
    stddev=0.3,
    sample_drafts=sample_drafts,
  )
  cfg = EngineConfig(max_len=16, batch_size=512, use_eos=False, min_prompt_bucket=4)
  assert (
    sampled_pvalue(SpecEngine(target, drafter, cfg), prompt, length, 12, outcomes, probs) > 1e-4
  )


# ------------------------------------------------------------------------------------------------
# Checkpoints in the published layout
# ------------------------------------------------------------------------------------------------


def _published(drafter, dtype=np.float32) -> tuple[dict, dict]:
  """The drafter's weights written out by hand under z-lab's names (independent of the
  library's tensor map), with a config.json like the released ones."""
  c = drafter.config
  p = jax.tree_util.tree_map(np.asarray, drafter.params["draft"])
  t = {
    "fc.weight": p["fc"]["kernel"].T,
    "hidden_norm.weight": p["hidden_norm"]["scale"],
    "norm.weight": p["norm"]["scale"],
  }
  for i in range(c.num_layers):
    lp, pre = p[f"layers_{i}"], f"layers.{i}."
    a = lp["self_attn"]
    t[pre + "input_layernorm.weight"] = lp["input_layernorm"]["scale"]
    t[pre + "post_attention_layernorm.weight"] = lp["post_attention_layernorm"]["scale"]
    for name in ("q_proj", "k_proj", "v_proj"):
      t[pre + f"self_attn.{name}.weight"] = a[name]["kernel"].reshape(c.hidden_size, -1).T
    t[pre + "self_attn.o_proj.weight"] = a["o_proj"]["kernel"].reshape(-1, c.hidden_size).T
    t[pre + "self_attn.q_norm.weight"] = a["q_norm"]["scale"]
    t[pre + "self_attn.k_norm.weight"] = a["k_norm"]["scale"]
    for name in ("gate_proj", "up_proj", "down_proj"):
      t[pre + f"mlp.{name}.weight"] = lp["mlp"][name]["kernel"].T
  t = {k: np.ascontiguousarray(v).astype(dtype) for k, v in t.items()}
  config = {
    "architectures": ["DFlashDraftModel"],
    "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
    "attention_bias": False,
    "attention_dropout": 0.0,
    "block_size": c.block_size,
    "bos_token_id": 151643,
    "dflash_config": {"mask_token_id": MASK, "target_layer_ids": list(c.target_layer_ids)},
    "dtype": "bfloat16" if dtype != np.float32 else "float32",
    "eos_token_id": 151645,
    "head_dim": c.head_dim,
    "hidden_act": "silu",
    "hidden_size": c.hidden_size,
    "initializer_range": 0.02,
    "intermediate_size": c.intermediate_size,
    "layer_types": ["full_attention"] * c.num_layers,
    "max_position_embeddings": 40960,
    "max_window_layers": c.num_layers,
    "model_type": "qwen3",
    "num_attention_heads": c.num_heads,
    "num_hidden_layers": c.num_layers,
    "num_key_value_heads": c.num_kv_heads,
    "num_target_layers": 3,
    "rms_norm_eps": 1e-6,
    "rope_scaling": None,
    "rope_theta": c.rope_theta,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": c.vocab_size,
  }
  return t, config


def _write(path, tensors, config):
  os.makedirs(path, exist_ok=True)
  save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
  with open(os.path.join(path, "config.json"), "w") as f:
    json.dump(config, f)


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16])
def test_import_export_round_trip_is_exact(tmp_path, target, drafter, dtype):
  tensors, config = _published(drafter, dtype)
  src, dst = str(tmp_path / "src"), str(tmp_path / "dst")
  if dtype == np.float32:
    _write(src, tensors, config)
  else:  # safetensors.numpy cannot write bfloat16; go through the flax writer
    from safetensors.flax import save_file as save_flax  # pylint: disable=import-outside-toplevel

    os.makedirs(src)
    save_flax(
      {k: jnp.asarray(v) for k, v in tensors.items()}, os.path.join(src, "model.safetensors")
    )
    with open(os.path.join(src, "config.json"), "w") as f:
      json.dump(config, f)
  loaded = jaxspec.load_drafter(src, target)
  assert isinstance(loaded, DFlashDrafter) and loaded.gamma == drafter.config.block_size - 1
  assert loaded.taps == drafter.taps and loaded.config.mask_token_id == MASK
  if dtype == np.float32:
    for a, b in zip(
      jax.tree_util.tree_leaves(loaded.params["draft"]),
      jax.tree_util.tree_leaves(drafter.params["draft"]),
    ):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  jaxspec.save_drafter(loaded, dst)
  if dtype == np.float32:
    back = load_file(os.path.join(dst, "model.safetensors"))
  else:
    from safetensors.flax import load_file as load_flax  # pylint: disable=import-outside-toplevel

    back = {k: np.asarray(v) for k, v in load_flax(os.path.join(dst, "model.safetensors")).items()}
  assert sorted(back) == sorted(tensors)
  for k, v in tensors.items():
    assert back[k].dtype == v.dtype, k
    np.testing.assert_array_equal(back[k].view(np.uint8), v.view(np.uint8), err_msg=k)
  with open(os.path.join(dst, "config.json")) as f:
    assert json.load(f) == config


def test_checkpoint_errors_are_named(tmp_path, target, drafter):
  tensors, config = _published(drafter)
  path = str(tmp_path / "ckpt")
  broken = dict(tensors)
  del broken["layers.1.self_attn.k_norm.weight"]
  _write(path, broken, config)
  with pytest.raises(jaxspec.CheckpointError, match="layers.1.self_attn.k_norm.weight"):
    jaxspec.load_drafter(path, target)
  _write(path, {**tensors, "layers.0.mlp.up_proj.weight": np.zeros((3, 3), np.float32)}, config)
  with pytest.raises(jaxspec.CheckpointError, match="shape"):
    jaxspec.load_drafter(path, target)
  _write(path, {**tensors, "embed_tokens.weight": np.zeros((64, 32), np.float32)}, config)
  with pytest.raises(jaxspec.CheckpointError, match="embed_tokens"):
    jaxspec.load_drafter(path, target)
  _write(path, tensors, {**config, "dflash_config": {"target_layer_ids": [0, 2]}})
  with pytest.raises(jaxspec.ConfigError, match="mask_token_id"):
    jaxspec.load_drafter(path, target)


def test_mismatched_targets_are_refused(target, drafter):
  c, draft = drafter.config, drafter.params["draft"]
  wide = small_target(num_layers=3).with_config(hidden_size=48)
  with pytest.raises(jaxspec.InputError, match="hidden size|features of size"):
    DFlashDrafter.for_target(wide, c, draft)
  with pytest.raises(jaxspec.InputError, match="vocabulary"):
    DFlashDrafter.for_target(target, c.replace(vocab_size=50), draft)
  with pytest.raises(jaxspec.InputError, match="taps target layers"):
    DFlashDrafter.for_target(target, c.replace(target_layer_ids=(0, 5), num_target_layers=0), draft)
  with pytest.raises(jaxspec.InputError, match="mask_token_id"):
    DFlashDrafter.for_target(target, c.replace(mask_token_id=64, vocab_size=0), draft)
  with pytest.raises(ValueError, match="context_window"):
    dataclasses.replace(drafter, context_window=2)


def test_yarn_rope_drafter_as_published_matches_transformers(tmp_path, target, drafter):
  """Kimi's DFlash drafters state YaRN in config.json (SpecForge's kimi-k2.7-code-dflash.json:
  both type keys, beta_fast / beta_slow, mscale = mscale_all_dim = 1; lengths scaled down
  here): read, applied (transformers' model with the same rope_parameters agrees) and written
  back."""
  tensors, config = _published(drafter)
  yarn = {
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "factor": 4.0,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
    "original_max_position_embeddings": 4,
    "rope_type": "yarn",
    "type": "yarn",
  }
  path = str(tmp_path / "yarn")
  _write(path, tensors, {**config, "rope_scaling": yarn})
  loaded = jaxspec.load_drafter(path, target, gamma=drafter.gamma)
  scaling = dict(loaded.config.rope_scaling)
  assert scaling["rope_type"] == "yarn" and scaling["factor"] == 4.0
  _check_against_transformers(target, loaded)
  jaxspec.save_drafter(loaded, str(tmp_path / "out"))
  back = jaxspec.load_drafter(str(tmp_path / "out"), target, gamma=drafter.gamma)
  assert back.config == loaded.config
  _write(path, tensors, {**config, "rope_scaling": {"rope_type": "longrope", "factor": 2.0}})
  with pytest.raises(jaxspec.ConfigError, match="RoPE type 'longrope'"):
    jaxspec.load_drafter(path, target)
