"""Hybrid targets (Qwen3-Next, Qwen3.5, Qwen3.5-MoE: Gated DeltaNet + gated full attention)
against transformers 5.24 (CPU, float32) on small random configurations, and their decoding
state (state.LinearState) under plain and chain-speculative decoding (tree verification:
tests/test_hybrid_tree.py)."""

from __future__ import annotations

import copy
import dataclasses
import json
import shutil
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
from jaxspec.speculative.engine import SpecEngine
from jaxspec.speculative.engine_config import EngineConfig
from jaxspec.state import DecodingState, LinearState
from jaxspec.io.architectures import config_from_hf
from tests import engine_models, hf_models, near_ties

NAMES = sorted(hf_models.HYBRID_CONFIGS)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  return hf_models.save_all(tmp_path_factory, NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_logits_match_transformers(saved, name):
  """Full forward (chunked delta rule in chunks of 8: 19 tokens cross two chunk borders)."""
  hf_model, path = saved[name]
  model = jaxspec.load_model(path, options=jaxspec.RunOptions(linear_chunk=8))
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
  # An MTP module config.json does not declare (mtp_num_hidden_layers) is skipped, as
  # transformers skips every mtp.* tensor; a declared one is read (the MTP tests below).
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
  config = config_from_hf(
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
  of the per-position states; its output equals plain decoding. The engine widens
  `linear_snapshots` to its verify block (a narrower one would commit whole blocks)."""
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
  narrow = SpecEngine(model.with_options(linear_snapshots=3), drafter, cfg)
  assert narrow.target.config.options.linear_snapshots == 4
  np.testing.assert_array_equal(narrow.generate(prompts, max_new_tokens=24).tokens, spec.tokens)
  with pytest.raises(ConfigError, match="draft model with linear-attention"):
    DraftModelDrafter.from_model(model)


# MTP: Qwen3.5's `mtp.*` module ----------------------------------------------------------------

MTP_NAMES = ("qwen3_5_dense_3to1_tied", "qwen3_5moe_3to1")  # layer 3: full attention, dense / MoE


def _mtp_affine(x):
  """The MTP block's weights: the main full-attention layer 3's, mapped elementwise (so the
  same map applies to HF's in-memory layout and to the stored one, and a loader that read
  layer 3 instead of mtp.layers.0 would be caught)."""
  return 1.3 * x - 0.02


def _with_mtp_module(hf_model, path: str, seed: int):
  """Adds a published-layout MTP module (mtp.fc / pre_fc_norm_* / norm / layers.0.*) and
  `mtp_num_hidden_layers: 1` to the checkpoint at `path`; returns the float64 torch pieces."""
  file = f"{path}/model.safetensors"
  tensors = safetensors.numpy.load_file(file)
  for name in [n for n in tensors if n.startswith("model.layers.3.")]:
    tensors["mtp.layers.0." + name[len("model.layers.3.") :]] = _mtp_affine(tensors[name])
  h = hf_model.config.hidden_size
  rng = np.random.default_rng(seed)
  pieces = {
    "fc.weight": 0.2 * rng.standard_normal((h, 2 * h)),
    "pre_fc_norm_embedding.weight": 0.2 * rng.standard_normal(h),
    "pre_fc_norm_hidden.weight": 0.2 * rng.standard_normal(h),
    "norm.weight": 0.2 * rng.standard_normal(h),
  }
  tensors.update({f"mtp.{k}": v.astype(np.float32) for k, v in pieces.items()})
  safetensors.numpy.save_file(tensors, file, metadata={"format": "pt"})
  with open(f"{path}/config.json") as f:
    config = json.load(f)
  config["mtp_num_hidden_layers"] = 1
  with open(f"{path}/config.json", "w") as f:
    json.dump(config, f)
  layer = copy.deepcopy(hf_model.model.layers[3]).double()
  for module in layer.modules():  # the grouped-matmul experts take no float64: the eager loop
    if getattr(module, "config", None) is not None and hasattr(module.config, "num_experts"):
      module.config = copy.copy(module.config)
      module.config._experts_implementation = "eager"  # pylint: disable=protected-access
  with torch.no_grad():
    for p in layer.parameters():
      p.copy_(_mtp_affine(p))
  f64 = {k: torch.as_tensor(v.astype(np.float32), dtype=torch.float64) for k, v in pieces.items()}
  return layer, f64


def _mtp_reference(hf_model, layer, pieces, tokens, hidden):
  """float64: norm(layer(fc([norm_e(embed(tokens)); norm_h(hidden)]))) → LM head, with
  transformers' decoder layer, rotary embedding and zero-centred RMSNorm."""
  model = hf_model.model
  eps = hf_model.config.rms_norm_eps

  def norm(x, w):  # Qwen3.5's RMSNorm: (1 + w) · x / rms(x)
    return (1.0 + w) * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)

  with torch.no_grad():
    ids = torch.as_tensor(tokens, dtype=torch.long)
    emb = model.embed_tokens.weight.double()[ids]
    x = (
      torch.cat(
        [
          norm(emb, pieces["pre_fc_norm_embedding.weight"]),
          norm(torch.as_tensor(hidden, dtype=torch.float64), pieces["pre_fc_norm_hidden.weight"]),
        ],
        -1,
      )
      @ pieces["fc.weight"].T
    )
    positions = torch.arange(ids.shape[1])[None].expand(ids.shape[0], -1)
    cos, sin = copy.deepcopy(model.rotary_emb).double()(x, positions)
    x = layer(x, position_embeddings=(cos, sin), attention_mask=None, position_ids=positions)
    x = x[0] if isinstance(x, tuple) else x
    out = norm(x, pieces["norm.weight"])
    head = hf_model.lm_head.weight.double()
    return (out @ head.T).numpy(), out.numpy()


@pytest.fixture(scope="module")
def mtp_saved(tmp_path_factory):
  out = {}
  for seed, name in enumerate(MTP_NAMES):
    d = str(tmp_path_factory.mktemp(f"mtp_{name}"))
    hf_model = hf_models.save_hf_model(name, d)
    out[name] = (hf_model, d, *_with_mtp_module(hf_model, d, seed))
  return out


@pytest.mark.parametrize(
  "name",
  [MTP_NAMES[0], pytest.param(MTP_NAMES[1], marks=pytest.mark.slow)],  # ~5 s vs ~14 s
)
def test_mtp_module_reads_the_published_layout_and_matches_a_float64_reference(mtp_saved, name):
  hf_model, path, layer, pieces = mtp_saved[name]
  model = jaxspec.load_model(path)
  assert model.config.num_mtp_layers == 1
  rng = np.random.default_rng(3)
  tokens = rng.integers(0, model.config.vocab_size, (2, 6))
  hidden = rng.standard_normal((2, 6, model.config.hidden_size)).astype(np.float32)
  logits, next_hidden, _ = target_lib.apply_mtp(
    model.config, model.params, 0, jnp.asarray(tokens), jnp.asarray(hidden)
  )
  ref_logits, ref_hidden = _mtp_reference(hf_model, layer, pieces, tokens, hidden)
  np.testing.assert_allclose(np.asarray(logits), ref_logits, atol=1e-4, rtol=1e-4)
  # Chained on its normed output, as vLLM / SGLang run Qwen3.5's MTP.
  np.testing.assert_allclose(np.asarray(next_hidden), ref_hidden, atol=1e-4, rtol=1e-4)
  # Exported in the same layout: transformers loads it (skipping mtp.*), jaxspec reads it back.
  out = f"{path}_export"
  hf_io.save_hf(model, out)
  names = safetensors.numpy.load_file(f"{out}/model.safetensors").keys()
  assert "mtp.fc.weight" in names and "mtp.layers.0.self_attn.q_proj.weight" in names
  again = jaxspec.load_model(out)
  assert again.config.num_mtp_layers == 1
  for a, b in zip(jax.tree_util.tree_leaves(model.params), jax.tree_util.tree_leaves(again.params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  back = getattr(transformers, type(hf_model).__name__).from_pretrained(out).float().eval()
  ids = rng.integers(0, model.config.vocab_size, (1, 5))
  np.testing.assert_allclose(
    hf_models.hf_logits(back, ids), hf_models.hf_logits(hf_model, ids), atol=1e-5
  )
  # transformers re-saves the declaration without the module: it loads without MTP, warned.
  back.save_pretrained(f"{out}_hf")
  with pytest.warns(UserWarning, match="holds none of their tensors"):
    assert jaxspec.load_model(f"{out}_hf").config.num_mtp_layers == 0


@pytest.mark.slow  # ~30 s each on 2 busy cores; the MTP drafter's losslessness is CI-tested on
# GLM-4 MoE (tests/test_mtp_drafter.py) and the hybrid engine's with other drafters (above)
@pytest.mark.parametrize("name", MTP_NAMES)
def test_mtp_drafter_on_a_hybrid_target_equals_plain(mtp_saved, name):
  """Chain speculation with the checkpoint's own MTP module, 2 rows."""
  from jaxspec.drafters.mtp import MTPDrafter  # pylint: disable=import-outside-toplevel
  from tests.drafter_models import GreedyCheck  # pylint: disable=import-outside-toplevel

  target = jaxspec.load_model(mtp_saved[name][1])
  GreedyCheck(target, MTPDrafter.from_target(target, gamma=3), max_len=40).check(2, new=12)


def test_mtp_module_config_errors(mtp_saved, tmp_path):
  src = mtp_saved["qwen3_5_dense_3to1_tied"][1]
  for key, value, message in [
    ("mtp_num_hidden_layers", 2, "several layers"),
    ("mtp_use_dedicated_embeddings", True, "its own embedding"),
  ]:
    d = tmp_path / key
    shutil.copytree(src, d)
    config = json.loads((d / "config.json").read_text())
    config[key] = value
    (d / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=message):
      jaxspec.load_model(str(d))


def test_published_vision_language_layout_loads_as_its_text_model(tmp_path):
  """Qwen3.5 checkpoints are published as Qwen3_5(Moe)ForConditionalGeneration: a nested
  text_config and model.language_model.* tensors beside the vision tower's model.visual.*."""
  text = dict(hf_models.HYBRID_CONFIGS["qwen3_5moe_3to1"][2])
  tied = text.pop("tie_word_embeddings")
  vision = dict(
    depth=1,
    hidden_size=16,
    intermediate_size=32,
    num_heads=2,
    out_hidden_size=text["hidden_size"],
    patch_size=4,
    temporal_patch_size=2,
    spatial_merge_size=2,
  )
  hf_model = hf_models.build_hf_model_from(
    "Qwen3_5MoeConfig",
    "Qwen3_5MoeForConditionalGeneration",
    dict(text_config=text, vision_config=vision, tie_word_embeddings=tied),
  )
  hf_model.save_pretrained(str(tmp_path))
  with pytest.warns(UserWarning, match=r"vision-tower tensor\(s\) \(model\.visual\.\*\)"):
    model = jaxspec.load_model(str(tmp_path), options=jaxspec.RunOptions(linear_chunk=8))
  assert model.config.architecture == "Qwen3_5MoeForCausalLM"
  assert not model.config.tie_word_embeddings and model.config.num_layers == 4
  ids = np.random.default_rng(4).integers(0, model.config.vocab_size, (2, 11))
  ref = hf_models.hf_logits(hf_model, ids)  # text-only input: the VL model's text path
  near_ties.assert_logits_match(model, ids, np.asarray(model.logits(ids)), ref, atol=2e-4)
