"""Hybrid targets (Qwen3-Next, Qwen3.5, Qwen3.5-MoE: Gated DeltaNet + gated full attention)
against transformers 5.24 (CPU, float32) on small random configurations, and their decoding
state (state.LinearState) under plain and chain-speculative decoding (tree verification:
tests/test_hybrid_tree.py)."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy
import torch
import transformers

import jaxspec
from jaxspec.drafters.base import Drafter, Proposal, ProposeContext
from jaxspec.drafters.draft_model import DraftModelDrafter
from jaxspec.errors import ConfigError
from jaxspec.io import hf as hf_io
from jaxspec.models import target as target_lib
from jaxspec.speculative.engine import EngineConfig, SpecEngine
from jaxspec.state import DecodingState, LinearState
from tests import engine_models, hf_models, near_ties

NAMES = sorted(hf_models.HYBRID_CONFIGS)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  return hf_models.save_all(tmp_path_factory, NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_logits_match_transformers(saved, name):
  """Full forward (chunked delta rule in chunks of 8: 19 tokens cross two chunk borders)."""
  hf_model, path = saved[name]
  model = jaxspec.load_model(path, linear_chunk=8)
  ids = np.random.default_rng(0).integers(0, model.config.vocab_size, (2, 19))
  ours = np.asarray(model.logits(ids))
  ref = hf_models.hf_logits(hf_model, ids)
  near_ties.assert_logits_match(model, ids, ours, ref, atol=1e-4)


def test_config_reading_and_export_roundtrip(saved, tmp_path):
  """Layer patterns and MoE layouts read from config.json; save_hf writes checkpoints that
  transformers loads to the same logits."""
  kinds = {}
  for name in NAMES:
    hf_model, path = saved[name]
    model = jaxspec.load_model(path)
    c = model.config
    kinds[name] = [
      ("L" if c.is_linear(i) else "F") + ("m" if m else "d") for i, m in enumerate(c.layer_is_moe)
    ]
    out = tmp_path / name
    hf_io.save_hf(model, str(out))
    back = getattr(transformers, type(hf_model).__name__).from_pretrained(str(out)).float().eval()
    ids = np.random.default_rng(1).integers(0, c.vocab_size, (1, 7))
    np.testing.assert_allclose(
      hf_models.hf_logits(back, ids), hf_models.hf_logits(hf_model, ids), atol=1e-5
    )
    assert jaxspec.load_model(str(out)).config == c
  # Published Qwen3.5 checkpoints carry an MTP module (mtp.*) that transformers skips: so do we.
  tensors = safetensors.numpy.load_file(str(out / "model.safetensors"))
  tensors["mtp.fc.weight"] = np.zeros((2, 2), np.float32)
  safetensors.numpy.save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
  with pytest.warns(UserWarning, match="mtp.fc.weight"):
    jaxspec.load_model(str(out))
  assert kinds == {
    "qwen3_5_dense_3to1_tied": ["Ld", "Ld", "Ld", "Fd"],
    "qwen3_5_dense_full_first": ["Fd", "Ld", "Ld", "Fd", "Ld"],
    "qwen3next_moe_mlponly": ["Lm", "Fd", "Lm", "Fm"],
    "qwen3_5moe_3to1": ["Lm", "Lm", "Lm", "Fm"],
  }


@pytest.mark.slow  # ~40 s on 2 busy cores; test_chain_speculation_equals_plain covers commits
def test_blocks_and_partial_commits_equal_full_forward(saved):
  """Blocks through the decoding state (each short block keeps per-position states) equal the
  full forward; so does a block of which only a prefix is committed before the next block
  resumes at the first uncommitted position (chain verification's commit)."""
  _, path = saved["qwen3_5moe_3to1"]
  model = jaxspec.load_model(path)
  b, t = 2, 13
  ids = np.random.default_rng(3).integers(0, model.config.vocab_size, (b, t))
  full = np.asarray(model.logits(ids))
  blocks = engine_models.blockwise_logits(model, ids, (4, 1, 3, 1, 4))
  near_ties.assert_logits_match(model, ids, blocks, full, atol=1e-4)

  state = model.init_state(b, 32)
  fwd = lambda toks, start, st: target_lib.forward(
    model.config, model.params, jnp.asarray(toks), jnp.asarray(start, jnp.int32), st
  )
  out = fwd(ids[:, :5], [0, 0], state)
  near_ties.assert_logits_match(model, ids, np.asarray(out.logits), full[:, :5], 1e-4, slice(0, 5))
  # Commit 5 + 2 tokens of a 6-token block in row 0 and 5 + 4 in row 1, then resume.
  out = fwd(ids[:, 5:11], [5, 5], out.state.commit(jnp.array([5, 5])))
  state = out.state.commit(jnp.array([2, 4]))
  rest = np.stack([ids[0, 7:11], ids[1, 9:13]])
  out = fwd(rest, [7, 9], state)
  logits = np.asarray(out.logits)
  near_ties.assert_logits_match(model, ids[:1], logits[:1], full[:1, 7:11], 1e-4, slice(7, 11))
  near_ties.assert_logits_match(model, ids[1:], logits[1:], full[1:, 9:13], 1e-4, slice(9, 13))


def test_linear_state_bytes_do_not_grow_with_context():
  config = jaxspec.ModelConfig.from_hf(
    {
      "architectures": ["Qwen3_5ForCausalLM"],
      **hf_models.HYBRID_CONFIGS["qwen3_5_dense_3to1_tied"][2],
      "rope_parameters": None,
    }
  )
  nbytes = lambda entry: sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(entry))
  short = jax.eval_shape(lambda: DecodingState.create(config, 1, 1024))
  long = jax.eval_shape(lambda: DecodingState.create(config, 1, 32768))
  linear = [i for i, s in enumerate(short.segments) if isinstance(s, LinearState)]
  assert linear == [0]
  assert nbytes(short.segments[0]) == nbytes(long.segments[0])
  # 3 linear layers × (conv window (K−1) × C channels + the state H × Dk × Dv), float32.
  assert nbytes(short.segments[0]) == 3 * ((4 - 1) * (2 * 2 * 8 + 4 * 6) + 4 * 8 * 6) * 4
  assert nbytes(long.segments[1]) == 32 * nbytes(short.segments[1])  # the attention KV grows


@pytest.mark.parametrize(
  "name",
  ["qwen3_5_dense_3to1_tied", pytest.param("qwen3next_moe_mlponly", marks=pytest.mark.slow)],
)
def test_greedy_generate_matches_transformers(saved, name):
  """Two prompts of different lengths in one padded batch (prefill in chunks of 4, so padding
  must stay out of the recurrent state), then 12 greedy tokens, each equal to HF generate."""
  hf_model, path = saved[name]
  model = jaxspec.load_model(path)
  rng = np.random.default_rng(2)
  prompts = [rng.integers(0, model.config.vocab_size, n).tolist() for n in (6, 9)]
  refs = []
  for p in prompts:
    with torch.no_grad():
      out = hf_model.generate(
        torch.as_tensor([p]),
        max_new_tokens=12,
        min_new_tokens=12,
        do_sample=False,
        pad_token_id=0,
        eos_token_id=None,
      )
    refs.append(out[0, len(p) :].tolist())
  cfg = EngineConfig(max_len=32, batch_size=2, use_eos=False, prefill_chunk=4)
  res = SpecEngine(model, None, cfg).generate(prompts, max_new_tokens=12, temperature=0.0)
  near_ties.assert_greedy_match(model, prompts, refs, [list(t) for t in res.tokens])


@dataclasses.dataclass(frozen=True)
class ReplayDrafter(Drafter):
  """Drafts the continuation of known reference texts ([B, L] token buffer, prompts first),
  wrong at the positions `corrupt` [B, L] marks: acceptance lengths of every size."""

  reference: Any = None
  corrupt: Any = None
  gamma: int = 3

  def propose(self, params: Any, state: Any, ctx: ProposeContext) -> tuple[Proposal, Any]:
    del params
    ref = jnp.asarray(self.reference)
    rows = jnp.arange(ref.shape[0])[:, None]
    cols = ctx.seq_len[:, None] + jnp.arange(self.gamma)[None, :]
    draft = ref[rows, jnp.minimum(cols, ref.shape[1] - 1)]
    corrupt = jnp.asarray(self.corrupt)[rows, jnp.minimum(cols, ref.shape[1] - 1)]
    return Proposal(jnp.where(corrupt, (draft + 1) % 64, draft), None), state


def test_chain_speculation_equals_plain(saved):
  """Greedy chain verification (γ = 3, batch 3) commits accepted prefixes of every length out
  of the per-position states; its output equals plain decoding. Verify blocks wider than the
  kept states are refused."""
  _, path = saved["qwen3_5_dense_3to1_tied"]
  model = jaxspec.load_model(path)
  rng = np.random.default_rng(4)
  prompts = [rng.integers(0, 64, n).tolist() for n in (5, 8, 3)]
  cfg = EngineConfig(max_len=48, batch_size=3, use_eos=False)
  plain = SpecEngine(model, None, cfg).generate(prompts, max_new_tokens=24)
  reference = np.zeros((3, 48), np.int32)
  for i, (p, t) in enumerate(zip(prompts, plain.tokens)):
    reference[i, : len(p) + len(t)] = p + list(t)
  corrupt = np.random.default_rng(5).random(reference.shape) < 0.3
  drafter = ReplayDrafter(reference=reference, corrupt=corrupt, gamma=3)
  spec = SpecEngine(model, drafter, cfg).generate(prompts, max_new_tokens=24)
  near_ties.assert_greedy_match(model, prompts, plain.tokens, spec.tokens)
  hist = np.asarray(spec.stats.summary["accept_hist"]).reshape(-1, 4).sum(0)
  assert all(hist > 0), hist  # 0, 1, 2 and 3 drafts accepted, each at least once
  with pytest.raises(ConfigError, match="linear_snapshots"):
    SpecEngine(model.with_config(linear_snapshots=3), drafter, cfg)
  with pytest.raises(ConfigError, match="draft model with linear-attention"):
    DraftModelDrafter.from_model(model)
