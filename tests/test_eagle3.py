"""EAGLE-3: chain logits against an explicit recomputation and the training unroll, losslessness,
reduced vocabularies, checkpoints."""

from __future__ import annotations

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import jaxspec
from jaxspec.drafters import eagle3 as eagle3_lib
from jaxspec.drafters.base import PrefillContext, ProposeContext
from jaxspec.drafters.eagle3 import Eagle3Drafter
from jaxspec.models import target as target_lib
from jaxspec import sampling
from jaxspec.speculative.engine import SpecEngine
from jaxspec.speculative.engine_config import EngineConfig
from jaxspec.state import FloatKV

from tests.drafter_models import rms as _rms, rope as _rope
from tests.drafter_models import (
  GreedyCheck,
  exact_sequence_probs,
  prompts,
  sampled_pvalue,
  small_target,
)

GAMMA = 3


@pytest.fixture(scope="module")
def target():
  return small_target(num_layers=4)


@pytest.fixture(scope="module")
def drafter(target):
  vocab = np.random.default_rng(0).choice(64, 40, replace=False)
  return Eagle3Drafter.random(
    target, draft_vocab=vocab, target_layer_ids=(0, 2, 3), stddev=0.2, gamma=GAMMA, seed=2
  )


@pytest.fixture(scope="module")
def greedy(target, drafter):
  return GreedyCheck(target, drafter)


def reference_chain(drafter, target, taps, tokens, drafts, inv_freq=None):
  """EAGLE-3 inference written out: context entries (f_i, t_{i+1}) for i < n−1, then the chain
  from (f_{n−1}, root) feeding back its own hidden. Returns target-vocab log-probs [γ, V].
  `inv_freq`: a scaled RoPE's frequencies (default: the plain RoPE of rope_theta)."""
  c = drafter.config
  p = jax.tree_util.tree_map(lambda a: np.asarray(a, np.float64), drafter.params["draft"])
  m = p["midlayer"]
  a = m["self_attn"]
  embed = np.asarray(target.params["embed"], np.float64)
  n = taps.shape[1]
  f = np.concatenate(list(taps), -1) @ p["fc"]["kernel"]
  d2t = np.asarray(drafter.params["d2t"])
  target_ids = np.arange(c.draft_vocab_size) + d2t
  groups = c.num_heads // c.num_kv_heads

  def attn_in(tok, hid):
    return np.concatenate(
      [_rms(embed[tok], m["input_layernorm"]["scale"]), _rms(hid, m["hidden_norm"]["scale"])], -1
    )

  ctx_in = attn_in(np.asarray(tokens[1:n]), f[: n - 1])  # entries 0..n−2
  keys = _rope(
    np.einsum("th,hnd->tnd", ctx_in, a["k_proj"]["kernel"]),
    np.arange(n - 1),
    c.rope_theta,
    inv_freq,
  )
  vals = np.einsum("th,hnd->tnd", ctx_in, a["v_proj"]["kernel"])
  hid, tok = f[n - 1], tokens[n]
  out = []
  for j in range(len(drafts)):
    x = attn_in(np.asarray([tok]), hid[None])
    pos = np.asarray([n - 1 + j])
    keys = np.concatenate(
      [keys, _rope(np.einsum("th,hnd->tnd", x, a["k_proj"]["kernel"]), pos, c.rope_theta, inv_freq)]
    )
    vals = np.concatenate([vals, np.einsum("th,hnd->tnd", x, a["v_proj"]["kernel"])])
    q = _rope(np.einsum("th,hnd->tnd", x, a["q_proj"]["kernel"]), pos, c.rope_theta, inv_freq)
    k, v = np.repeat(keys, groups, 1), np.repeat(vals, groups, 1)
    s = np.einsum("qnd,knd->nqk", q, k) / np.sqrt(c.head_dim)
    w = np.exp(s - s.max(-1, keepdims=True))
    w /= w.sum(-1, keepdims=True)
    h = hid[None] + np.einsum("qnd,ndh->qh", np.einsum("nqk,knd->qnd", w, v), a["o_proj"]["kernel"])
    hm = _rms(h, m["post_attention_layernorm"]["scale"])
    g = hm @ m["mlp"]["gate_proj"]["kernel"]
    h = (
      h
      + ((g / (1 + np.exp(-g))) * (hm @ m["mlp"]["up_proj"]["kernel"]))
      @ m["mlp"]["down_proj"]["kernel"]
    )
    logits = _rms(h, p["norm"]["scale"]) @ p["lm_head"]["kernel"]
    lp = logits[0] - logits.max() - np.log(np.sum(np.exp(logits[0] - logits.max())))
    full = np.full((c.vocab_size,), -np.inf)
    full[target_ids] = lp
    out.append(full)
    hid, tok = h[0], drafts[j]
  return np.stack(out)


def _finite_close(got, want):
  assert np.array_equal(np.isfinite(got), np.isfinite(want))
  np.testing.assert_allclose(got[np.isfinite(want)], want[np.isfinite(want)], atol=2e-4, rtol=2e-4)


def _propose_after_prefill(target, drafter, toks):
  n = len(toks) - 1  # toks[n] is the root
  out = target_lib.forward(
    target.config, target.params, jnp.asarray(toks[None, :n]), taps=drafter.taps
  )
  buf = jnp.asarray(np.pad(toks, (0, 16))[None])
  st = drafter.init_state(drafter.params, 1, 32)
  st = drafter.prefill(
    drafter.params, st, PrefillContext(buf, jnp.array([n]), out.taps, out.hidden)
  )
  prop, _ = drafter.propose(
    drafter.params,
    st,
    ProposeContext(
      buf, jnp.array([n + 1]), sampling.make_sampling_params(1), jax.random.PRNGKey(0)
    ),
  )
  return out, prop


def test_chain_equals_explicit_recomputation_and_training_unroll(target, drafter):
  toks = np.asarray(prompts(1, 64)[0] + [7], np.int32)
  n = len(toks) - 1
  out, prop = _propose_after_prefill(target, drafter, toks)
  drafts = np.asarray(prop.tokens[0])
  got = np.asarray(prop.logprobs[0])
  want = reference_chain(drafter, target, np.asarray(out.taps[:, 0], np.float64), toks, drafts)
  _finite_close(got, want)
  assert np.array_equal(drafts, want.argmax(-1))
  # The training-time test over the sequence prefix + root + drafts sees, at position n − 1,
  # exactly what the chain saw.
  seq = np.concatenate([toks, drafts]).astype(np.int32)
  full = target_lib.forward(target.config, target.params, jnp.asarray(seq[None]), taps=drafter.taps)
  ttt = np.asarray(
    drafter.ttt_logits(drafter.params, jnp.asarray(seq[None]), full.taps, steps=GAMMA)
  )
  lp = jax.nn.log_softmax(jnp.asarray(ttt[:, 0, n - 1]), axis=-1)
  _finite_close(np.asarray(drafter.to_target_vocab(drafter.params, lp, -jnp.inf)), got)


@pytest.mark.parametrize("batch", [1, 2])
def test_greedy_speculation_equals_plain(greedy, batch):
  greedy.check(batch)


def test_tree_verification_greedy_equals_plain(greedy):
  """DDTree verification: the accepted path, not the drafter's chain, reaches commit."""
  greedy.check(2, tree_budget=6)


def test_cache_holds_exact_entries_after_generation(target, drafter, greedy):
  eng = greedy.spec
  state = eng.init_state(prompts(2, 64), max_new_tokens=20)
  state = eng._loop(eng.target.params, drafter.params, state)  # pylint: disable=protected-access
  tokens, seq = jnp.asarray(state.tokens), np.asarray(state.seq_len)
  length = tokens.shape[1] - 1
  zeros = jnp.zeros((2,), jnp.int32)
  full = target_lib.forward(target.config, target.params, tokens[:, :length], taps=drafter.taps)
  feats = drafter.fuse(drafter.params, full.taps)
  fresh = FloatKV.create(drafter.config.body(), 1, 2, length)
  _, _, kv = drafter.forward(drafter.params, tokens[:, 1 : length + 1], feats, zeros, fresh)
  for b in range(2):
    n = int(seq[b]) - 1
    np.testing.assert_allclose(
      np.asarray(state.drafter_state.kv.k[0, b, : n - 1]),
      np.asarray(kv.k[0, b, : n - 1]),
      atol=2e-4,
      rtol=2e-4,
    )
    np.testing.assert_allclose(
      np.asarray(state.drafter_state.last_feature[b]),
      np.asarray(feats[b, n - 1]),
      atol=2e-4,
      rtol=2e-4,
    )


def test_sampled_sequences_follow_the_target_distribution():
  target = small_target(vocab=6, num_layers=4, seed=3, factor=2.0)
  prompt, length = [1, 4, 2], 3
  outcomes, probs = exact_sequence_probs(target, prompt, length)
  drafter = Eagle3Drafter.random(
    target, draft_vocab=[0, 2, 3, 5], target_layer_ids=(0, 1, 3), stddev=0.3, gamma=2
  )
  cfg = EngineConfig(max_len=16, batch_size=512, use_eos=False, min_prompt_bucket=4)
  assert (
    sampled_pvalue(SpecEngine(target, drafter, cfg), prompt, length, 12, outcomes, probs) > 1e-4
  )


def test_default_taps_and_vocab_maps():
  assert eagle3_lib.default_layer_ids(32) == (1, 15, 28)
  d2t, t2d = eagle3_lib.make_vocab_maps([5, 1, 9], 12)
  assert d2t.tolist() == [1, 4, 7] and np.flatnonzero(t2d).tolist() == [1, 5, 9]
  eagle3_lib.check_vocab_maps(d2t, t2d, 12, 3)
  with pytest.raises(ValueError, match="t2d"):
    eagle3_lib.check_vocab_maps(d2t, np.roll(t2d, 1), 12, 3)


# ------------------------------------------------------------------------------------------------
# Checkpoints in the published (SpecForge / SafeAILab) layout
# ------------------------------------------------------------------------------------------------


def _published(drafter, with_embed=False):
  c = drafter.config
  p = jax.tree_util.tree_map(np.asarray, drafter.params["draft"])
  m = p["midlayer"]
  t = {
    "fc.weight": p["fc"]["kernel"].T,
    "norm.weight": p["norm"]["scale"],
    "lm_head.weight": p["lm_head"]["kernel"].T,
    "midlayer.hidden_norm.weight": m["hidden_norm"]["scale"],
    "midlayer.input_layernorm.weight": m["input_layernorm"]["scale"],
    "midlayer.post_attention_layernorm.weight": m["post_attention_layernorm"]["scale"],
    "midlayer.self_attn.o_proj.weight": m["self_attn"]["o_proj"]["kernel"]
    .reshape(-1, c.hidden_size)
    .T,
  }
  for name in ("q_proj", "k_proj", "v_proj"):
    t[f"midlayer.self_attn.{name}.weight"] = (
      m["self_attn"][name]["kernel"].reshape(2 * c.hidden_size, -1).T
    )
  for name in ("gate_proj", "up_proj", "down_proj"):
    t[f"midlayer.mlp.{name}.weight"] = m["mlp"][name]["kernel"].T
  if c.reduced_vocab:
    d2t = np.asarray(drafter.params["d2t"]).astype(np.int64)
    t["d2t"] = d2t
    t["t2d"] = np.zeros((c.vocab_size,), bool)
    t["t2d"][np.arange(len(d2t)) + d2t] = True
  if with_embed:
    t["embed_tokens.weight"] = (
      np.random.default_rng(5).normal(0, 0.02, (c.vocab_size, c.hidden_size)).astype(np.float32)
    )
  t = {k: np.ascontiguousarray(v) for k, v in t.items()}
  config = {
    "architectures": ["LlamaForCausalLMEagle3"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "head_dim": c.head_dim,
    "hidden_act": "silu",
    "hidden_size": c.hidden_size,
    "initializer_range": 0.02,
    "intermediate_size": c.intermediate_size,
    "max_position_embeddings": 40960,
    "model_type": "llama",
    "num_attention_heads": c.num_heads,
    "num_hidden_layers": 1,
    "num_key_value_heads": c.num_kv_heads,
    "rms_norm_eps": 1e-6,
    "rope_scaling": None,
    "rope_theta": c.rope_theta,
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
    "vocab_size": c.vocab_size,
    "draft_vocab_size": c.draft_vocab_size,
    "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(c.target_layer_ids)},
  }
  return t, config


def _write(path, tensors, config):
  os.makedirs(path, exist_ok=True)
  save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
  with open(os.path.join(path, "config.json"), "w") as f:
    json.dump(config, f)


@pytest.mark.parametrize("variant", ["reduced_vocab", "full_vocab_own_embedding"])
def test_import_export_round_trip_is_exact(tmp_path, target, drafter, variant):
  if variant == "reduced_vocab":
    tensors, config = _published(drafter)
  else:
    full = Eagle3Drafter.random(target, target_layer_ids=(0, 2, 3), seed=4)
    tensors, config = _published(full, with_embed=True)
  src, dst = str(tmp_path / "src"), str(tmp_path / "dst")
  _write(src, tensors, config)
  loaded = jaxspec.load_drafter(src, target, gamma=2)
  assert isinstance(loaded, Eagle3Drafter) and loaded.gamma == 2
  assert loaded.config.has_embedding == (variant != "reduced_vocab")
  jaxspec.save_drafter(loaded, dst)
  back = load_file(os.path.join(dst, "model.safetensors"))
  assert sorted(back) == sorted(tensors)
  for k, v in tensors.items():
    assert back[k].dtype == v.dtype, k
    np.testing.assert_array_equal(back[k], v, err_msg=k)
  with open(os.path.join(dst, "config.json")) as f:
    assert json.load(f) == config
  if variant == "reduced_vocab":
    toks = np.asarray(prompts(1, 64)[0] + [7], np.int32)
    _, a = _propose_after_prefill(target, drafter, toks)
    _, b = _propose_after_prefill(target, dataclasses.replace(loaded, gamma=GAMMA), toks)
    np.testing.assert_array_equal(np.asarray(a.logprobs), np.asarray(b.logprobs))


def test_checkpoint_and_target_errors_are_named(tmp_path, target, drafter):
  tensors, config = _published(drafter)
  path = str(tmp_path / "ckpt")
  _write(path, {k: v for k, v in tensors.items() if k != "t2d"}, config)
  with pytest.raises(jaxspec.CheckpointError, match="d2t/t2d|d2t and t2d"):
    jaxspec.load_drafter(path, target)
  bad = dict(tensors)
  bad["d2t"] = np.zeros_like(tensors["d2t"])
  _write(path, bad, config)
  with pytest.raises(jaxspec.CheckpointError, match="d2t"):
    jaxspec.load_drafter(path, target)
  _write(path, tensors, {**config, "vocab_size": 80})
  with pytest.raises((jaxspec.CheckpointError, jaxspec.InputError), match="80|shape"):
    jaxspec.load_drafter(path, target)
  _write(path, tensors, {**config, "eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 2, 9]}})
  with pytest.raises(jaxspec.InputError, match="taps target layers"):
    jaxspec.load_drafter(path, target)
  wide = target.with_config(hidden_size=48)
  with pytest.raises(jaxspec.InputError, match="hidden size|features of size"):
    Eagle3Drafter.for_target(
      wide, drafter.config, drafter.params["draft"], d2t=np.asarray(drafter.params["d2t"])
    )
  with pytest.raises(jaxspec.InputError, match="d2t"):
    Eagle3Drafter.for_target(target, drafter.config, drafter.params["draft"])


def test_layer_ids_follow_each_keys_convention(tmp_path, target, drafter):
  """eagle_config's ids name layer outputs (SpecForge, SGLang); the top-level key names layer
  inputs (vLLM): the same taps either way, and export keeps whichever keys were there."""
  tensors, config = _published(drafter)
  outputs = list(drafter.config.target_layer_ids)  # (0, 2, 3)
  inputs = [i + 1 for i in outputs]
  nested_only = {k: v for k, v in config.items() if k != "eagle_config"}
  cases = {
    "vllm": {**nested_only, "eagle_aux_hidden_state_layer_ids": inputs},
    "both": {**config, "eagle_aux_hidden_state_layer_ids": inputs},
  }
  for name, cfg in cases.items():
    src, dst = str(tmp_path / name), str(tmp_path / (name + "_out"))
    _write(src, tensors, cfg)
    loaded = jaxspec.load_drafter(src, target)
    assert loaded.taps == tuple(outputs), name
    jaxspec.save_drafter(loaded, dst)
    with open(os.path.join(dst, "config.json")) as f:
      back = json.load(f)
    assert back["eagle_aux_hidden_state_layer_ids"] == inputs, name
    assert back["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == outputs, name
  path = str(tmp_path / "bad")
  _write(path, tensors, {**config, "eagle_aux_hidden_state_layer_ids": [i + 2 for i in outputs]})
  with pytest.raises(jaxspec.ConfigError, match="name different layers"):
    jaxspec.load_drafter(path, target)
  _write(path, tensors, {**nested_only, "eagle_aux_hidden_state_layer_ids": [0, 2, 3]})
  with pytest.raises(jaxspec.ConfigError, match="embedding"):
    jaxspec.load_drafter(path, target)


# ---- heads as published for Llama-3.1 targets: llama3 RoPE, yuhuili's pytorch_model.bin -------

LLAMA3_ROPE = {
  "rope_type": "llama3",
  "factor": 8.0,
  "low_freq_factor": 1.0,
  "high_freq_factor": 4.0,
  "original_max_position_embeddings": 8,
}


def _hf_inv_freq(c, rope: dict) -> np.ndarray:
  """transformers' inverse frequencies of a scaled RoPE (the reference)."""
  from transformers import LlamaConfig  # pylint: disable=import-outside-toplevel
  from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # pylint: disable=import-outside-toplevel

  hf = LlamaConfig(
    hidden_size=c.hidden_size,
    num_attention_heads=c.num_heads,
    head_dim=c.head_dim,
    max_position_embeddings=2048,
    rope_parameters={**rope, "rope_theta": c.rope_theta},
  )
  inv, attention = ROPE_INIT_FUNCTIONS[rope["rope_type"]](hf, "cpu")
  assert attention == 1.0
  return inv.numpy().astype(np.float64)


class _CodePayload:
  """Unpickling this runs os.mkdir: what a malicious pytorch_model.bin could hold."""

  def __init__(self, marker: str):
    self.marker = marker

  def __reduce__(self):
    return (os.mkdir, (self.marker,))


def _llama31_target(seed: int = 7):
  """A tiny Llama-3.1 target (LlamaForCausalLM, llama3 RoPE) as wide as the Qwen3 `target`."""
  from jaxspec.io.architectures import config_from_hf  # pylint: disable=import-outside-toplevel
  from tests.drafter_models import random_params  # pylint: disable=import-outside-toplevel

  hf = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 64,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "max_position_embeddings": 2048,
    "rope_theta": 10000.0,
    "rope_scaling": dict(LLAMA3_ROPE),
  }
  config = config_from_hf(hf)
  return target_lib.TargetModel(config, random_params(target_lib.param_shapes(config), seed))


def test_yuhuili_pytorch_bin_with_llama3_rope_on_a_llama_target(tmp_path, drafter):
  """A head for a Llama-3.1 target in yuhuili's layout (LlamaForCausalLMEagle3 config with
  llama3 rope_scaling as SpecForge's llama3 configs state it, draft_vocab_size, d2t/t2d,
  weights in pytorch_model.bin): read weights-only, its chain equal to the written-out
  recomputation with transformers' llama3 frequencies, exported as safetensors."""
  torch = pytest.importorskip("torch")
  target = _llama31_target()
  tensors, config = _published(drafter)
  config = {**config, "rope_scaling": dict(LLAMA3_ROPE), "max_position_embeddings": 2048}
  path = tmp_path / "yuhuili"
  path.mkdir()
  torch.save(
    {k: torch.from_numpy(v.copy()) for k, v in tensors.items()}, path / "pytorch_model.bin"
  )
  (path / "config.json").write_text(json.dumps(config))
  loaded = jaxspec.load_drafter(str(path), target, gamma=GAMMA)
  assert dict(loaded.config.rope_scaling) == {**LLAMA3_ROPE}
  for name, v in (("fc", "fc.weight"), ("lm_head", "lm_head.weight")):
    np.testing.assert_array_equal(np.asarray(loaded.params["draft"][name]["kernel"]), tensors[v].T)

  toks = np.asarray(prompts(1, 64)[0] + [7], np.int32)
  out, prop = _propose_after_prefill(target, loaded, toks)
  drafts, taps = np.asarray(prop.tokens[0]), np.asarray(out.taps[:, 0], np.float64)
  inv = _hf_inv_freq(loaded.config, LLAMA3_ROPE)
  want = reference_chain(loaded, target, taps, toks, drafts, inv_freq=inv)
  _finite_close(np.asarray(prop.logprobs[0]), want)
  plain = reference_chain(loaded, target, taps, toks, drafts)
  assert not np.allclose(plain[np.isfinite(plain)], want[np.isfinite(want)], atol=1e-3)

  jaxspec.save_drafter(loaded, str(tmp_path / "out"))
  assert os.path.exists(tmp_path / "out" / "model.safetensors")
  back = jaxspec.load_drafter(str(tmp_path / "out"), target, gamma=GAMMA)
  assert back.config == loaded.config


def test_a_pickle_with_a_code_payload_is_refused(tmp_path, target, drafter):
  torch = pytest.importorskip("torch")
  tensors, config = _published(drafter)
  marker = str(tmp_path / "payload_ran")
  state = {k: torch.from_numpy(v.copy()) for k, v in tensors.items()}
  state["fc.weight"] = _CodePayload(marker)
  torch.save(state, tmp_path / "pytorch_model.bin")
  (tmp_path / "config.json").write_text(json.dumps(config))
  with pytest.raises(jaxspec.CheckpointError, match="pytorch_model.bin: refusing"):
    jaxspec.load_drafter(str(tmp_path), target)
  assert not os.path.exists(marker)
