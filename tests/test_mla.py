"""Multi-head Latent Attention targets (DeepSeek-V3 / Kimi-K2): parity with transformers, the
absorbed decode form against the expanded one, the latent cache's formats and size, greedy
and sampled speculative decoding (MTP, DFlash chain, DFlash + DDTree) on an MLA target, and
serving a DSA target from paged latents with the prefix cache."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.config import ModelConfig
from jaxspec.drafters.eagle3 import Eagle3Drafter
from jaxspec.drafters.mtp import MTPDrafter
from jaxspec.errors import ConfigError
from jaxspec.io.hf import load_model
from jaxspec.models import target as target_lib
from jaxspec.models.target import TargetModel
from jaxspec.serve import SamplingOptions, Scheduler
from jaxspec.speculative.engine import SpecEngine
from jaxspec.speculative.engine_config import EngineConfig
from jaxspec.speculative.request import SamplingArgs
from jaxspec.state import LATENT_FORMATS, DecodingState, LatentKV
from tests import hf_models, near_ties
from tests.drafter_models import (
  GreedyCheck,
  exact_sequence_probs,
  random_params,
  sampled_pvalue,
  small_dflash,
)

NAMES = sorted(hf_models.MLA_CONFIGS)


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
  """name → (HF model, jaxspec model loaded from its saved checkpoint)."""
  out = {}
  for name in NAMES:
    hf = hf_models.build_any(name)
    d = str(tmp_path_factory.mktemp(name))
    hf.save_pretrained(d)
    out[name] = (hf, load_model(d))
  return out


def _ids(vocab: int, shape=(2, 13), seed: int = 0) -> np.ndarray:
  return np.random.default_rng(seed).integers(0, vocab, shape)


@pytest.mark.parametrize("name", NAMES)
def test_logits_match_transformers(pairs, name):
  hf, model = pairs[name]
  ids = _ids(model.config.vocab_size)
  near_ties.assert_logits_match(
    model, ids, model.logits(jnp.asarray(ids)), hf_models.hf_logits(hf, ids), atol=1e-4
  )


def _cached_logits(model: TargetModel, ids: np.ndarray, blocks, kv_format="float") -> np.ndarray:
  """Logits of `ids` computed block by block through a decoding state (the absorbed form)."""
  b, n = ids.shape
  state = DecodingState.create(model.config, b, 32, kv_format)
  out, pos = [], 0
  for t in blocks:
    start = jnp.full((b,), pos, jnp.int32)
    res = target_lib.forward(model.config, model.params, jnp.asarray(ids[:, pos : pos + t]), start, state)
    state = res.state.commit(jnp.full((b,), t, jnp.int32))
    out.append(np.asarray(res.logits))
    pos += t
  assert pos == n
  return np.concatenate(out, axis=1)


@pytest.mark.parametrize("name", NAMES)
def test_absorbed_cache_equals_expanded(pairs, name):
  """Prefill, one-token decodes and a verify block over the latent cache (absorbed form) give
  the full-sequence (expanded) logits."""
  _, model = pairs[name]
  ids = _ids(model.config.vocab_size, (2, 12), seed=1)
  expanded = np.asarray(model.logits(jnp.asarray(ids)))
  cached = _cached_logits(model, ids, (5, 1, 1, 4, 1))
  np.testing.assert_allclose(cached, expanded, atol=1e-5, rtol=0)


def _prefilled(model: TargetModel, ids: np.ndarray, kv_format: str) -> DecodingState:
  b, t = ids.shape
  state = DecodingState.create(model.config, b, 32, kv_format)
  start = jnp.zeros((b,), jnp.int32)
  res = target_lib.forward(model.config, model.params, jnp.asarray(ids), start, state)
  return res.state.commit(jnp.full((b,), t, jnp.int32))


@pytest.mark.parametrize("fmt, bound, drift", [("fp8", 1 / 14, 0.3), ("q4_0", 1 / 7.9, 1.0)])
def test_quantized_latent_caches(pairs, fmt, bound, drift):
  """FP8 / Q4_0 latent caches hold each stored vector within the format's rounding (a fraction
  of its largest value: E4M3's 3 mantissa bits, Q4_0 up to amax/8 where the
  clipped side of a block rounds to 7d), and decode from them
  stays close to float (logits of a random MoE also move where routing flips)."""
  _, model = pairs["deepseek_v3_qlora_grouped_yarn"]
  ids = _ids(model.config.vocab_size, (2, 12), seed=2)
  exact = np.stack([s.values() for s in _prefilled(model, ids, "float").segments[0:1]])
  stored = np.stack([s.values() for s in _prefilled(model, ids, fmt).segments[0:1]])
  live = exact[..., :12, :]
  err = np.abs(stored[..., :12, :] - live)
  amax = np.abs(live).max(-1, keepdims=True)
  assert (err <= bound * amax + 1e-6).all() and err.max() > 0
  expanded = np.asarray(model.logits(jnp.asarray(ids)))
  got = _cached_logits(model, ids, (6, 1, 5), fmt)
  assert np.median(np.abs(got - expanded).max(-1)) < drift


def test_latent_cache_bytes_per_token_and_layer():
  """(kv_lora_rank + qk_rope_head_dim) × bytes of the format, whatever the number of heads."""
  cfg = _mla_config(num_heads=8, kv_lora_rank=64, qk_rope_head_dim=32)  # 96 values
  for fmt, per_value in (("float", 4.0), ("fp8", 1 + 4 / 96), ("q4_0", 18 / 32)):
    state = DecodingState.create(cfg, 2, 16, fmt)
    nbytes = sum(x.nbytes for x in jax.tree_util.tree_leaves(state.segments))
    per_token_layer = nbytes / (2 * 16 * cfg.num_layers)
    assert per_token_layer == pytest.approx(96 * per_value), fmt
    assert isinstance(state.segments[0], LATENT_FORMATS[fmt])
  gqa = cfg.replace(
    architecture="Glm4MoeForCausalLM", kv_lora_rank=0, q_lora_rank=0, qk_nope_head_dim=0,
    qk_rope_head_dim=0, v_head_dim=0, rope_interleave=False,
  )
  full = DecodingState.create(gqa, 2, 16)
  assert sum(x.nbytes for x in jax.tree_util.tree_leaves(full.segments)) == (2 * 8 * 40) * 4 * (2 * 16 * cfg.num_layers)  # K+V per head


def test_greedy_decoding_is_transformers_full_forward_argmax(pairs):
  """Cached greedy decoding (grouped routing, YaRN) of a prompt holding token 0 is the argmax of
  transformers' uncached forward over prompt + output (see near_ties for why not `generate`)."""
  hf, model = pairs["deepseek_v3_qlora_grouped_yarn"]
  ids = _ids(model.config.vocab_size, (1, 14), seed=7)
  assert 0 in ids
  engine = SpecEngine(model, None, EngineConfig(max_len=32, batch_size=1, use_eos=False))
  got = engine.generate([ids[0].tolist()], max_new_tokens=10).tokens[0]
  near_ties.assert_greedy_is_full_forward_argmax(hf, ids[0], got, model)
  broken = list(got)
  broken[3] = int(np.argmin(hf_models.hf_logits(hf, np.asarray([list(ids[0]) + got[:3]]))[0, -1]))
  with pytest.raises(AssertionError, match="token 3"):
    near_ties.assert_greedy_is_full_forward_argmax(hf, ids[0], broken, model)


def test_config_errors_name_the_field():
  with pytest.raises(ConfigError, match="head_dim"):
    _mla_config(head_dim=20)
  with pytest.raises(ConfigError, match="num_key_value_heads"):
    _mla_config(num_kv_heads=2)
  with pytest.raises(ConfigError, match="MLA"):
    _mla_config(architecture="Glm4MoeForCausalLM")
  with pytest.raises(ConfigError, match="multiple of 32"):
    DecodingState.create(_mla_config(kv_lora_rank=20), 1, 8, "q4_0")
  with pytest.raises(ConfigError, match="MLA targets only"):
    LatentKV.create(_gqa_config(), 1, 1, 8)


# ------------------------------------------------------------------------------------------------
# Small random MLA configurations (jaxspec's own, no transformers)
# ------------------------------------------------------------------------------------------------


def _mla_config(**changes) -> ModelConfig:
  base = dict(
    architecture="DeepseekV3ForCausalLM",
    vocab_size=64,
    hidden_size=32,
    num_layers=3,
    num_heads=4,
    num_kv_heads=4,
    head_dim=16,
    intermediate_size=48,
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=16,
    router="sigmoid",
    n_group=2,
    topk_group=1,
    norm_topk_prob=True,
    n_shared_experts=1,
    layer_is_moe=(False, True, True),
    q_lora_rank=16,
    kv_lora_rank=24,
    qk_nope_head_dim=8,
    qk_rope_head_dim=8,
    v_head_dim=8,
    rope_interleave=True,
    num_mtp_layers=1,
  )
  base.update(changes)
  if "num_heads" in changes and "num_kv_heads" not in changes:
    base["num_kv_heads"] = changes["num_heads"]
  if "qk_rope_head_dim" in changes and "head_dim" not in changes:
    base["head_dim"] = base["qk_nope_head_dim"] + changes["qk_rope_head_dim"]
  return ModelConfig(**base).with_options(scan_layers=False)


def _gqa_config() -> ModelConfig:
  return ModelConfig(
    architecture="Qwen3ForCausalLM", vocab_size=16, hidden_size=8, num_layers=1, num_heads=2,
    num_kv_heads=1, head_dim=4, intermediate_size=8,
  )


# ------------------------------------------------------------------------------------------------
# DeepSeek Sparse Attention (GLM-5, DeepSeek-V3.2) and speculative decoding
# ------------------------------------------------------------------------------------------------


def test_dsa_choice_matters(pairs):
  """The parity above is not dense attention in disguise: the same weights with every key kept
  (index_topk past the context) move the logits of queries that see more than index_topk keys,
  and only those."""
  hf, model = pairs["glm5_dsa_shared"]
  ids = _ids(model.config.vocab_size)
  dense = TargetModel(model.config.replace(index_topk=10**6), model.params)
  diff = np.abs(np.asarray(dense.logits(jnp.asarray(ids))) - hf_models.hf_logits(hf, ids)).max(-1)
  topk = model.config.index_topk
  assert diff[:, :topk].max() < 1e-4  # a query sees ≤ topk keys: the same
  assert diff[:, topk:].max() > 1e-2


def _dsa_config(**changes) -> ModelConfig:
  dsa = dict(
    architecture="GlmMoeDsaForCausalLM",
    index_n_heads=4,
    index_head_dim=16,
    index_topk=6,  # prompts and decoding run past it
    indexer_types=("full", "shared", "full"),
    indexer_rope_interleave=True,
  )
  return _mla_config(**{**dsa, **changes})


# Greedy speculative decoding on an MLA target and a DSA target (GLM-5 with a shared-indexer
# layer, index_topk 6 < the contexts), batch 1 and 4. CI runs two cases (one compile each);
# the others are slow-marked.
IN_CI = {("dsa", "mtp", 4), ("dsa", "ddtree", 4)}  # (a DSA target is an MLA target too)
CASES = [
  pytest.param(kind, drafter, batch, marks=() if (kind, drafter, batch) in IN_CI else pytest.mark.slow)
  for kind in ("mla", "dsa")
  for drafter in ("mtp", "chain", "ddtree")
  for batch in (1, 4)
] + [pytest.param(kind, "eagle3", 4, marks=pytest.mark.slow) for kind in ("mla", "dsa")]


@pytest.fixture(scope="module")
def spec_checks():
  """(target kind, drafter) → a GreedyCheck of batch 4, built on first use."""
  targets, checks = {}, {}

  def get(kind: str, drafter: str) -> GreedyCheck:
    if kind not in targets:
      cfg = _mla_config() if kind == "mla" else _dsa_config()
      targets[kind] = TargetModel(cfg, random_params(target_lib.param_shapes(cfg), 3))
    key = (kind, drafter if drafter in ("mtp", "eagle3") else "dflash")
    if key not in checks:
      t = targets[kind]
      if drafter == "mtp":
        d = MTPDrafter.from_target(t, gamma=3)
      elif drafter == "eagle3":
        d = Eagle3Drafter.random(t, target_layer_ids=(0, 1, 2), stddev=0.2, seed=2)
      else:
        d = small_dflash(t)
      checks[key] = GreedyCheck(t, d, 48, batch_size=4)
    return checks[key]

  return get


@pytest.mark.parametrize("kind, drafter, batch", CASES)
def test_greedy_speculation_equals_plain(spec_checks, kind, drafter, batch):
  """MTP (the checkpoint's own layer; in DSA targets with its own indexer), DFlash chain,
  DFlash + DDTree (each tree node's indexer chooses among its ancestors) and EAGLE-3 (taps of
  an MLA target) equal plain decoding."""
  spec_checks(kind, drafter).check(batch, new=16, tree_budget=6 if drafter == "ddtree" else 0)


def test_paged_server_with_prefix_cache_equals_plain(spec_checks):
  """A DSA target with its MTP layer served from paged latents and indexer keys: six requests
  behind a shared 20-token opening, a pool of 8 pages of 8 for four rows (preemption happens),
  the prefix cache on. Later requests read the opening's full pages from the cache (the MTP
  layer absorbs their kept features), and every output equals plain decoding."""
  check = spec_checks("dsa", "mtp")
  config = EngineConfig(
    max_len=48, batch_size=4, use_eos=False, stream_every=2, page_size=8, kv_pages=8,
    prefix_cache=True,
  )
  engine = SpecEngine(check.target, check.drafter, config)
  rng = np.random.default_rng(4)
  opening = list(map(int, rng.integers(3, check.target.config.vocab_size, 20)))
  prompts = [opening + list(map(int, rng.integers(3, 60, 2 + i))) for i in range(6)]
  # The drafter's state after two cached pages is what a full prefill gives.
  table = np.full((4, 6), config.kv_pages, np.int32)
  table[0, :3], table[1, :5] = [0, 1, 2], [0, 1, 3, 4, 5]  # row 1 shares row 0's first two
  state = engine.set_page_table(engine.empty_state(), table)
  greedy = SamplingArgs(max_new_tokens=8, temperature=0.0)
  state = engine.insert(state, 0, engine.prefill_cached(state, prompts[0], greedy))
  cached = engine.prefill_cached(state, prompts[1], greedy, pages=[0, 1])
  full = engine.prefill_row(prompts[1], greedy)
  np.testing.assert_array_equal(cached.tokens, full.tokens)
  for got, want in zip(jax.tree.leaves(cached.drafter_state), jax.tree.leaves(full.drafter_state)):
    np.testing.assert_allclose(got, want, atol=2e-5)

  options = SamplingOptions(max_tokens=16, temperature=0.0)
  scheduler = Scheduler(engine, max_queue=8, admission_reserve=0.0)  # preemption wanted
  scheduler.start()
  try:
    scheduler.submit(prompts[0], options).result()  # its pages cached before the rest arrive
    results = [h.result()[0] for h in scheduler.submit_many([(p, options) for p in prompts[1:]])]
    metrics = scheduler.metrics()
  finally:
    scheduler.shutdown(drain=False, timeout=60)
  assert metrics["prefix_cache_hit_tokens_total"] >= 5 * 16  # two full pages per later request
  assert metrics["preemptions_total"] >= 1 and metrics["kv_pages_used"] == 0
  want = check.plain.generate(prompts[1:5], max_new_tokens=16).tokens
  want += check.plain.generate(prompts[5:], max_new_tokens=16).tokens
  near_ties.assert_greedy_match(check.target, prompts[1:], want, results)


# ------------------------------------------------------------------------------------------------
# Sampling
# ------------------------------------------------------------------------------------------------


class _ArgmaxButReportsQ(MTPDrafter):
  """A broken drafter: drafts the argmax but reports the warped q (what a bug would look like)."""

  def propose(self, params, state, ctx):
    prop, state = super().propose(params, state, ctx)
    return prop.replace(tokens=jnp.argmax(prop.probs, axis=-1).astype(jnp.int32)), state


def test_sampled_sequences_follow_the_target_distribution():
  """MTP speculation at T = 1 on a DSA target (index_topk 2 < the 6-token contexts) samples
  the target's exact sequence distribution; a broken drafter fails the same test."""
  cfg = _dsa_config(vocab_size=6, index_topk=2, num_layers=2, layer_is_moe=(False, True),
                    indexer_types=("full", "shared"))
  target = TargetModel(cfg, random_params(target_lib.param_shapes(cfg), 3, factor=2.0))
  prompt, length = [1, 4, 2], 3
  outcomes, probs = exact_sequence_probs(target, prompt, length)
  engine_cfg = EngineConfig(max_len=16, batch_size=512, use_eos=False, min_prompt_bucket=4)
  good = SpecEngine(target, MTPDrafter.from_target(target, gamma=2), engine_cfg)
  assert sampled_pvalue(good, prompt, length, 12, outcomes, probs) > 1e-4
  base = MTPDrafter.from_target(target, gamma=2)
  bad = SpecEngine(
    target, _ArgmaxButReportsQ(gamma=2, params=base.params, config=base.config), engine_cfg
  )
  assert sampled_pvalue(bad, prompt, length, 12, outcomes, probs) < 1e-6


# ------------------------------------------------------------------------------------------------
# Quantizing an MLA target by policy
# ------------------------------------------------------------------------------------------------

MLA_ATTENTION = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")


def test_fp8_attention_and_mxfp4_experts_policy_on_an_mla_target(tmp_path):
  """FP8 attention (every MLA projection, kv_b_proj read through `materialize` in both forms)
  and MXFP4 experts: reported, close to float, exact through a jaxspec checkpoint."""
  from jaxspec import quant  # pylint: disable=import-outside-toplevel
  from jaxspec.io.hf import save_hf  # pylint: disable=import-outside-toplevel

  config_cls, model_cls, kwargs = hf_models.MLA_CONFIGS["deepseek_v3_qlora_grouped_yarn"]
  kwargs = dict(kwargs, moe_intermediate_size=32, num_hidden_layers=2)  # MXFP4 blocks of 32
  hf_models.build_hf_model_from(config_cls, model_cls, kwargs).save_pretrained(str(tmp_path / "f"))
  model = load_model(str(tmp_path / "f"))
  cfg = model.config
  q = quant.quantize(model, (("experts", "mxfp4"), ("attention", "fp8")))
  formats = q.quant_report.formats
  for layer in ("layers_0/0", "layers_1/0"):
    for p in MLA_ATTENTION:
      assert formats[f"{layer}/self_attn/{p}/kernel"] == "fp8", (layer, p)
  assert {formats[p] for p in formats if quant.role_of(p) == "experts"} == {"mxfp4"}
  assert q.params["layers_1"]["0"]["self_attn"]["kv_b_proj"]["kernel"].scales.shape == (4, 20)  # per head and column
  ids = _ids(cfg.vocab_size, (2, 10), seed=4)
  got, want = np.asarray(q.logits(jnp.asarray(ids))), np.asarray(model.logits(jnp.asarray(ids)))
  is_q = lambda x: isinstance(x, quant.QTensor)
  deq = dataclasses.replace(
    q,
    params=jax.tree_util.tree_map(lambda x: x.dequantize() if is_q(x) else x, q.params, is_leaf=is_q),
    quant_report=None,
  )
  np.testing.assert_allclose(got, np.asarray(deq.logits(jnp.asarray(ids))), atol=1e-5, rtol=1e-5)
  # Quantized for real, and near float (MXFP4's 4-bit experts dominate on these random weights).
  err = np.abs(got - want).max()
  assert 1e-3 < err < 0.25 * np.abs(want).max(), err
  np.testing.assert_allclose(_cached_logits(q, ids, (10,)), got, atol=1e-4, rtol=1e-4)
  save_hf(q, str(tmp_path / "q"))
  again = load_model(str(tmp_path / "q"))
  np.testing.assert_array_equal(np.asarray(again.logits(jnp.asarray(ids))), got)
