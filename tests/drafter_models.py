"""Helpers shared by the feature-drafter tests (MTP, DFlash, EAGLE-3, drafter losses).

Small random targets with sharp logits, an exact sequence-distribution check for sampled
output, a greedy-equality harness, and float64 numpy RMSNorm/RoPE for explicit
re-computations.
"""

from __future__ import annotations

import dataclasses
import itertools

import jax
import jax.numpy as jnp
import numpy as np
from scipy import stats as scipy_stats

from jaxspec.config import ModelConfig
from jaxspec.models import target as target_lib
from jaxspec.models.target import TargetModel
from jaxspec.speculative.engine import SpecEngine
from jaxspec.speculative.engine_config import EngineConfig
from tests import near_ties


def rms(x, w, eps=1e-6):
  """float64 RMSNorm."""
  return w * x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps)


def rope(x, pos, theta, inv_freq=None):
  """float64 rotate-half RoPE over the whole head; x [T, H, D], pos [T]; `inv_freq` [D / 2]
  replaces the default frequencies (a scaled RoPE's, from transformers)."""
  d = x.shape[-1]
  if inv_freq is None:
    inv_freq = 1.0 / theta ** (np.arange(0, d, 2) / d)
  f = np.asarray(pos, np.float64)[:, None] * np.asarray(inv_freq, np.float64)
  emb = np.concatenate([f, f], -1)
  cos, sin = np.cos(emb)[:, None], np.sin(emb)[:, None]
  return x * cos + np.concatenate([-x[..., d // 2 :], x[..., : d // 2]], -1) * sin


def random_params(shapes, seed: int, factor: float = 4.0):
  """Normal(0.02 × factor) matrices, unit norm scales: numpy draws, no init compilation."""
  rng = np.random.default_rng(seed)

  def make(path, x):
    if "scale" in jax.tree_util.keystr(path):
      return jnp.ones(x.shape, x.dtype)
    return jnp.asarray(rng.normal(0.0, 0.02 * factor, x.shape), x.dtype)

  return jax.tree_util.tree_map_with_path(make, shapes)


def small_target(
  vocab: int = 64,
  num_layers: int = 2,
  num_mtp_layers: int = 0,
  seed: int = 0,
  factor: float = 4.0,
  tie: bool = False,
) -> TargetModel:
  """A random Qwen3 target with sharp logits (scaled-up weights)."""
  cfg = ModelConfig(
    architecture="Qwen3ForCausalLM",
    vocab_size=vocab,
    hidden_size=32,
    num_layers=num_layers,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    intermediate_size=48,
    num_mtp_layers=num_mtp_layers,
    tie_word_embeddings=tie,
  )
  return TargetModel(cfg, random_params(target_lib.param_shapes(cfg), seed, factor))


def small_dflash(target: TargetModel, **overrides):
  """The small DFlash drafter the tests share: 2 layers, block 4, taps (0, 2), mask id 2 (for
  `small_target(num_layers=3)`); keyword arguments override any setting."""
  from jaxspec.drafters.dflash import DFlashDrafter  # pylint: disable=import-outside-toplevel

  settings = dict(
    mask_token_id=2, num_layers=2, block_size=4, target_layer_ids=(0, 2), stddev=0.2, seed=1
  )
  return DFlashDrafter.random(target, **{**settings, **overrides})


def prompts(batch: int, vocab: int, seed: int = 0) -> list[list[int]]:
  rng = np.random.default_rng(seed)
  lens = [5, 11, 3, 8][:batch]
  return [list(rng.integers(3, vocab, n // 2 + 1)) * 2 for n in lens]


def exact_sequence_probs(target: TargetModel, prompt: list[int], length: int) -> tuple:
  """All continuations of `length` tokens and their exact probabilities at temperature 1."""
  vocab = target.config.vocab_size
  outcomes = list(itertools.product(range(vocab), repeat=length))
  seqs = np.asarray([prompt + list(o) for o in outcomes], np.int32)
  logits = np.asarray(target.logits(seqs[:, :-1]), np.float64)
  logp = (
    logits
    - np.log(np.sum(np.exp(logits - logits.max(-1, keepdims=True)), -1, keepdims=True))
    - logits.max(-1, keepdims=True)
  )
  m = len(prompt)
  probs = np.ones(len(outcomes))
  for k in range(length):
    probs *= np.exp(logp[np.arange(len(outcomes)), m - 1 + k, seqs[:, m + k]])
  return outcomes, probs


def sampled_pvalue(
  engine: SpecEngine, prompt: list[int], length: int, calls: int, outcomes, probs
) -> float:
  """Chi-square p-value of engine samples (T=1) against exact probabilities (pooled bins)."""
  batch = engine.config.batch_size
  index = {o: i for i, o in enumerate(outcomes)}
  counts = np.zeros(len(outcomes))
  for s in range(calls):
    out = engine.generate([prompt] * batch, max_new_tokens=length, temperature=1.0, seed=s)
    for t in out.tokens:
      counts[index[tuple(t)]] += 1
  n = counts.sum()
  expected = probs * n
  big = expected >= 5
  obs = np.append(counts[big], counts[~big].sum())
  exp = np.append(expected[big], expected[~big].sum())
  if exp[-1] == 0:
    obs, exp = obs[:-1], exp[:-1]
  return float(scipy_stats.chisquare(obs, exp * obs.sum() / exp.sum()).pvalue)


class GreedyCheck:
  """Plain and speculative engines (batch 2 by default) for one target: greedy outputs must
  agree."""

  def __init__(self, target: TargetModel, drafter, max_len: int = 80, batch_size: int = 2):
    self.target = target
    self.drafter = drafter
    self.cfg = EngineConfig(max_len=max_len, batch_size=batch_size, use_eos=False)
    self.plain = SpecEngine(target, None, self.cfg)
    self.spec = SpecEngine(target, drafter, self.cfg)

  def check(self, batch: int, new: int = 24, tree_budget: int = 0):
    """Greedy outputs agree (chain verification, or DDTree with `tree_budget` nodes)."""
    ps = prompts(batch, self.target.config.vocab_size)
    plain = self.plain.generate(ps, max_new_tokens=new)
    engine = self.spec
    if tree_budget:
      engine = SpecEngine(
        self.target,
        self.drafter,
        dataclasses.replace(self.cfg, verify="tree", tree_budget=tree_budget),
      )
    spec = engine.generate(ps, max_new_tokens=new)
    near_ties.assert_greedy_match(self.target, ps, plain.tokens, spec.tokens)
    assert all(len(t) == new for t in spec.tokens)
    return plain, spec


def dflash_reference_logits(drafter, target, taps, block, qpos, visible):
  """float64 DFlash forward by plain masked attention over [context; block].

  taps [n_taps, n, H] are the target features of context positions 0..n−1; block [t] tokens at
  RoPE positions qpos [t]; visible [t, n + t] says which keys each block query sees.
  Returns logits [t, V].
  """
  c = drafter.config
  p = jax.tree_util.tree_map(lambda a: np.asarray(a, np.float64), drafter.params["draft"])
  n = taps.shape[1]
  ctx = rms(np.concatenate(list(taps), axis=-1) @ p["fc"]["kernel"], p["hidden_norm"]["scale"])
  x = np.asarray(target.params["embed"], np.float64)[block]
  kpos = np.concatenate([np.arange(n), qpos])
  groups = c.num_heads // c.num_kv_heads
  for i in range(c.num_layers):
    lp = p[f"layers_{i}"]
    a = lp["self_attn"]
    hn = rms(x, lp["input_layernorm"]["scale"])
    kv_in = np.concatenate([ctx, hn])
    q = rope(
      rms(np.einsum("th,hnd->tnd", hn, a["q_proj"]["kernel"]), a["q_norm"]["scale"]),
      qpos,
      c.rope_theta,
    )
    k = rope(
      rms(np.einsum("th,hnd->tnd", kv_in, a["k_proj"]["kernel"]), a["k_norm"]["scale"]),
      kpos,
      c.rope_theta,
    )
    v = np.einsum("th,hnd->tnd", kv_in, a["v_proj"]["kernel"])
    k, v = np.repeat(k, groups, axis=1), np.repeat(v, groups, axis=1)
    scores = np.einsum("qnd,knd->nqk", q, k) / np.sqrt(c.head_dim)
    vis = visible[i] if isinstance(visible, (list, tuple)) else visible
    scores = np.where(vis[None], scores, -1e30)
    w = np.exp(scores - scores.max(-1, keepdims=True))
    w /= w.sum(-1, keepdims=True)
    x = x + np.einsum("qnd,ndh->qh", np.einsum("nqk,knd->qnd", w, v), a["o_proj"]["kernel"])
    m = lp["mlp"]
    hm = rms(x, lp["post_attention_layernorm"]["scale"])
    g = hm @ m["gate_proj"]["kernel"]
    x = x + ((g / (1 + np.exp(-g))) * (hm @ m["up_proj"]["kernel"])) @ m["down_proj"]["kernel"]
  return rms(x, p["norm"]["scale"]) @ np.asarray(target.params["lm_head"]["kernel"], np.float64)


def hf_rope_parameters(theta: float, scaling: tuple) -> dict:
  """transformers' rope_parameters for a RoPE base and a normalized jaxspec scaling."""
  extra = {k: v for k, v in scaling if v is not None and k != "max_position_embeddings"}
  return {"rope_type": "default", **extra, "rope_theta": theta}


def transformers_dflash(drafter):
  """transformers' DFlash-architecture model (MuseGlimmerAssistant) holding `drafter`'s
  weights in float32, or None when the installed transformers has no such model."""
  import torch  # pylint: disable=import-outside-toplevel
  import transformers  # pylint: disable=import-outside-toplevel

  from jaxspec.drafters.dflash import dflash_tensors  # pylint: disable=import-outside-toplevel

  if not hasattr(transformers, "MuseGlimmerAssistantModel"):
    return None
  c = drafter.config
  hf_cfg = transformers.MuseGlimmerAssistantConfig(
    hidden_size=c.hidden_size,
    intermediate_size=c.intermediate_size,
    num_hidden_layers=c.num_layers,
    num_attention_heads=c.num_heads,
    num_key_value_heads=c.num_kv_heads,
    head_dim=c.head_dim,
    rms_norm_eps=c.rms_norm_eps,
    rope_parameters=hf_rope_parameters(c.rope_theta, c.rope_scaling),
    layer_types=["full_attention"] * c.num_layers,
    block_size=c.block_size,
    mask_token_id=c.mask_token_id,
    target_layer_ids=list(c.target_layer_ids),
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
  )
  model = transformers.MuseGlimmerAssistantModel(hf_cfg).float().eval()
  rename = {
    "fc.weight": "encoder.fc.weight",
    "hidden_norm.weight": "encoder.output_norm_enc.weight",
  }
  state = {
    rename.get(k, k): torch.from_numpy(np.array(v, np.float32))
    for k, v in dflash_tensors(drafter).items()
  }
  model.load_state_dict(state, strict=True)
  return model
