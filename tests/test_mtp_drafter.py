"""The MTP drafter: greedy equality, exact sampled distribution, cache bookkeeping, errors; MTP
layers as DeepSeek and GLM publish them (their own embedding and head copies)."""

from __future__ import annotations

import dataclasses
import logging
import shutil
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import jaxspec
from jaxspec.config import ModelConfig
from jaxspec.drafters.mtp import MTPDrafter
from jaxspec.io import hf as hf_io
from jaxspec.io import safetensors_files
from jaxspec.models import target as target_lib
from jaxspec.models.target import TargetModel
from jaxspec.speculative.engine import SpecEngine
from jaxspec.speculative.engine_config import EngineConfig
from jaxspec.state import DecodingState

from tests.drafter_models import (
  random_params,
  small_target,
  prompts,
  exact_sequence_probs,
  sampled_pvalue,
  GreedyCheck,
)


# ------------------------------------------------------------------------------------------------
# MTP
# ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def target():
  return small_target(num_mtp_layers=1)


@pytest.fixture(scope="module")
def greedy(target):
  return GreedyCheck(target, MTPDrafter.from_target(target, gamma=3))


@pytest.mark.parametrize("batch", [1, 2])
def test_greedy_speculation_equals_plain(greedy, batch):
  greedy.check(batch)


def test_tree_verification_greedy_equals_plain(greedy):
  greedy.check(2, tree_budget=6)


def test_greedy_with_a_moe_target_and_moe_mtp_block():
  """The bundled target's shape: GLM-4 MoE with partial RoPE and a routed-expert MTP block."""
  cfg = ModelConfig(
    architecture="Glm4MoeForCausalLM",
    vocab_size=64,
    hidden_size=32,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    intermediate_size=48,
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=16,
    router="sigmoid",
    n_shared_experts=1,
    layer_is_moe=(False, True),
    partial_rotary_factor=0.5,
    num_mtp_layers=1,
  )
  target = TargetModel(cfg, random_params(target_lib.param_shapes(cfg), 0))
  GreedyCheck(target, MTPDrafter.from_target(target, gamma=2)).check(2)


def test_cache_holds_exact_entries_after_steps(target, greedy):
  """After a generation, the MTP cache below the root equals a fresh recomputation."""
  eng = greedy.spec
  state = eng.init_state(prompts(2, 64), max_new_tokens=20)
  state = eng._loop(eng.target.params, eng.drafter_params, state)  # pylint: disable=protected-access
  tokens, seq = jnp.asarray(state.tokens), np.asarray(state.seq_len)
  length = int(seq.max())
  zeros = jnp.zeros((2,), jnp.int32)
  full = target_lib.forward(target.config, target.params, tokens[:, :length])
  fresh = DecodingState.create(target.config, 2, length, segment_layers=(1,))
  _, _, mstate = target_lib.apply_mtp(
    target.config, target.params, 0, tokens[:, 1 : length + 1], full.hidden, zeros, fresh
  )
  ck = mstate.segments[0].k
  for b in range(2):
    n = int(seq[b]) - 1  # root slot; cache entries below n - 1 are committed
    got = np.asarray(state.drafter_state.cache.segments[0].k[0, b, : n - 1])
    np.testing.assert_allclose(got, np.asarray(ck[0, b, : n - 1]), atol=2e-4, rtol=2e-4)
    np.testing.assert_allclose(
      np.asarray(state.drafter_state.last_hidden[b]),
      np.asarray(full.hidden[b, n - 1]),
      atol=2e-4,
      rtol=2e-4,
    )


@dataclasses.dataclass(frozen=True)
class _ArgmaxButReportsQ(MTPDrafter):
  """A broken drafter: drafts the argmax but reports the warped q (what a bug would look like)."""

  def propose(self, params, state, ctx):
    prop, state = super().propose(params, state, ctx)
    return prop.replace(tokens=jnp.argmax(prop.probs, axis=-1).astype(jnp.int32)), state


def test_sampled_sequences_follow_the_target_distribution():
  target = small_target(vocab=6, num_mtp_layers=1, seed=3, factor=2.0)
  prompt, length = [1, 4, 2], 3
  outcomes, probs = exact_sequence_probs(target, prompt, length)
  cfg = EngineConfig(max_len=16, batch_size=512, use_eos=False, min_prompt_bucket=4)
  good = SpecEngine(target, MTPDrafter.from_target(target, gamma=2), cfg)
  assert sampled_pvalue(good, prompt, length, 12, outcomes, probs) > 1e-4
  base = MTPDrafter.from_target(target, gamma=2)
  bad = SpecEngine(target, _ArgmaxButReportsQ(gamma=2, params=base.params, config=base.config), cfg)
  assert sampled_pvalue(bad, prompt, length, 12, outcomes, probs) < 1e-6


def test_clear_errors(target):
  plain = TargetModel(target.config.replace(num_mtp_layers=0), {})
  with pytest.raises(jaxspec.ConfigError, match="no MTP layers"):
    MTPDrafter.from_target(plain)
  with pytest.raises(ValueError, match="gamma"):
    MTPDrafter.from_target(target, gamma=0)
  drafter = jaxspec.make_drafter("mtp", target, gamma=2)
  assert isinstance(drafter, MTPDrafter) and drafter.gamma == 2


# ------------------------------------------------------------------------------------------------
# MTP layers as DeepSeek-V3 / GLM publish them: each holds embed_tokens and shared_head.head
# ------------------------------------------------------------------------------------------------

PUBLISHED_COPIES = ("model.layers.2.embed_tokens.weight", "model.layers.2.shared_head.head.weight")


def _glm_with_mtp() -> ModelConfig:
  return ModelConfig(
    architecture="Glm4MoeForCausalLM",
    vocab_size=64,
    hidden_size=32,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    intermediate_size=48,
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=16,
    router="sigmoid",
    n_shared_experts=1,
    layer_is_moe=(False, True),
    partial_rotary_factor=0.5,
    num_mtp_layers=1,
  )


@pytest.fixture(scope="module")
def published(tmp_path_factory):
  """(model, dir): a GLM target saved in the published layout, sharded with an index so that
  the MTP layer's copies sit in another file than the main embedding and head."""

  cfg = _glm_with_mtp()
  model = TargetModel(cfg, random_params(target_lib.param_shapes(cfg), 5, factor=2.0))
  d = str(tmp_path_factory.mktemp("published_mtp"))
  hf_io.save_hf(model, d, max_shard_bytes=16_000)
  assert len(jax.tree_util.tree_leaves(model.params)) > 20
  return model, d


def _mtp_logits(model: TargetModel, tokens, hidden):
  logits, _, _ = target_lib.apply_mtp(model.config, model.params, 0, tokens, hidden)
  return np.asarray(logits)


def _inputs(vocab: int):
  rng = np.random.default_rng(0)
  return jnp.asarray(rng.integers(0, vocab, (2, 6))), jnp.asarray(rng.normal(size=(2, 6, 32)))


def test_published_mtp_copies_equal_to_the_main_tensors_are_shared(published, caplog):

  model, d = published
  src = safetensors_files.TensorSource(d)
  assert set(PUBLISHED_COPIES) <= src.keys()  # written as DeepSeek / GLM publish them
  assert src.file_of[PUBLISHED_COPIES[0]] != src.file_of["model.embed_tokens.weight"]
  np.testing.assert_array_equal(src.get(PUBLISHED_COPIES[1]), src.get("lm_head.weight"))
  src.close()
  with warnings.catch_warnings(), caplog.at_level(logging.INFO, logger="jaxspec.io.hf"):
    warnings.simplefilter("error")  # accepted, not skipped with a warning
    loaded = jaxspec.load_model(d)
  assert "the main model's embedding and the main model's LM head" in caplog.text
  assert not (loaded.config.mtp_own_embed or loaded.config.mtp_own_head)
  assert set(loaded.params["mtp_0"]) == set(model.params["mtp_0"])  # held once
  tokens, hidden = _inputs(64)
  np.testing.assert_array_equal(
    _mtp_logits(loaded, tokens, hidden), _mtp_logits(model, tokens, hidden)
  )
  assert isinstance(MTPDrafter.from_target(loaded), MTPDrafter)  # the default load keeps it


def _perturb_copies(src_dir: str, dst_dir: str) -> dict:
  """A copy of the checkpoint whose MTP embedding and head differ from the main ones."""

  shutil.copytree(src_dir, dst_dir, dirs_exist_ok=True)
  src = safetensors_files.TensorSource(dst_dir)
  changed = {}
  for name in PUBLISHED_COPIES:
    path = src.file_of[name]
    tensors = load_file(path)
    rng = np.random.default_rng(len(changed))
    tensors[name] = (tensors[name] + rng.normal(0, 0.5, tensors[name].shape)).astype(
      tensors[name].dtype
    )
    changed[name] = tensors[name]
    save_file(tensors, path)
  src.close()
  return changed


def test_published_mtp_copies_that_differ_are_the_layers_own(published, tmp_path):
  """The MTP layer drafts with its own embedding and head (as vLLM loads them): its logits
  equal those of the shared-tensor model whose main embedding and head are those copies, the
  main model's logits stay the main tensors'. Read with a shared config, it is refused."""

  model, d = published
  changed = _perturb_copies(d, str(tmp_path))
  loaded = jaxspec.load_model(str(tmp_path))
  assert loaded.config.mtp_own_embed and loaded.config.mtp_own_head
  own = loaded.params["mtp_0"]
  np.testing.assert_array_equal(np.asarray(own["embed"]), changed[PUBLISHED_COPIES[0]])
  np.testing.assert_array_equal(np.asarray(own["head"]["kernel"]), changed[PUBLISHED_COPIES[1]].T)

  tokens, hidden = _inputs(64)
  swapped = dict(model.params, embed=own["embed"], lm_head={"kernel": own["head"]["kernel"]})
  want = _mtp_logits(TargetModel(model.config, swapped), tokens, hidden)
  np.testing.assert_allclose(_mtp_logits(loaded, tokens, hidden), want, atol=1e-5)
  assert not np.allclose(_mtp_logits(model, tokens, hidden), want, atol=1e-2)  # it matters
  np.testing.assert_array_equal(np.asarray(loaded.logits(tokens)), np.asarray(model.logits(tokens)))

  with pytest.raises(jaxspec.CheckpointError, match="shared_head.head.weight.*differ"):
    hf_io.load_params(str(tmp_path), model.config)

  # Exported as published (the layer's own tensors), and read back the same.
  out = str(tmp_path / "export")
  jaxspec.save_hf(loaded, out)
  back = jaxspec.load_model(out)
  assert back.config.mtp_own_embed and back.config.mtp_own_head
  np.testing.assert_array_equal(
    _mtp_logits(back, tokens, hidden), _mtp_logits(loaded, tokens, hidden)
  )
