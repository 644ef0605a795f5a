"""Gemma 4 targets (Gemma4ForCausalLM) and the Gemma 4 MTP assistant drafter
(Gemma4AssistantForCausalLM) against transformers on small random configurations.

"shared": sliding ×2, full, sliding ×2, full with the last two layers KV-shared (they read
layers 3 and 2), per-layer inputs, full layers 16 wide with one KV head and values equal to
keys, proportional RoPE on half the full heads' pairs, double-wide MLPs in the shared layers,
soft-capped logits, window 4. "plain": no sharing, per-layer inputs or k_eq_v, default RoPE on
the full layers. The assistant has two layers (sliding, full), is 24 wide and uses the
ordered-embedding head (8 clusters, 3 kept).
"""

from __future__ import annotations

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from safetensors.numpy import load_file, save_file

import jaxspec
from jaxspec import sampling
from jaxspec.drafters import gemma4_assistant as ga
from jaxspec.drafters.base import ProposeContext
from jaxspec.errors import ConfigError
from jaxspec.io.architectures import config_from_hf, config_to_hf
from jaxspec.models import target as target_lib
from jaxspec.speculative.engine import SpecEngine
from jaxspec.speculative.engine_config import EngineConfig
from jaxspec.state import DecodingState, SharedKV, SlidingKV

from tests import drafter_models, hf_models, near_ties

SLIDING, FULL = "sliding_attention", "full_attention"
VOCAB = 96
_BASE = dict(
  vocab_size=VOCAB,
  hidden_size=32,
  intermediate_size=48,
  num_attention_heads=4,
  num_key_value_heads=2,
  head_dim=8,
  global_head_dim=16,
  sliding_window=4,
  final_logit_softcapping=5.0,
)
CONFIGS = {
  "shared": dict(
    _BASE,
    num_hidden_layers=6,
    layer_types=[SLIDING, SLIDING, FULL, SLIDING, SLIDING, FULL],
    num_global_key_value_heads=1,
    attention_k_eq_v=True,
    num_kv_shared_layers=2,
    hidden_size_per_layer_input=8,
    vocab_size_per_layer_input=VOCAB,
    use_double_wide_mlp=True,
    rope_parameters={
      SLIDING: {"rope_type": "default", "rope_theta": 100.0},
      FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.5, "rope_theta": 1e4},
    },
  ),
  "plain": dict(
    _BASE,
    num_hidden_layers=3,
    layer_types=[SLIDING, FULL, FULL],
    hidden_size_per_layer_input=0,
    rope_parameters={
      SLIDING: {"rope_type": "default", "rope_theta": 50.0},
      FULL: {"rope_type": "default", "rope_theta": 1e3},
    },
  ),
  "moe": dict(
    _BASE,
    num_hidden_layers=3,
    layer_types=[SLIDING, SLIDING, FULL],
    hidden_size_per_layer_input=0,
    enable_moe_block=True,
    num_experts=4,
    top_k_experts=2,
    moe_intermediate_size=32,
  ),
}
ASSISTANT = dict(
  backbone_hidden_size=32,
  use_ordered_embeddings=True,
  num_centroids=8,
  centroid_intermediate_top_k=3,
)
ASSISTANT_TEXT = dict(
  vocab_size=VOCAB,
  hidden_size=24,
  intermediate_size=40,
  num_hidden_layers=2,
  num_attention_heads=4,
  num_key_value_heads=2,
  head_dim=8,
  global_head_dim=16,
  num_global_key_value_heads=1,
  attention_k_eq_v=True,
  hidden_size_per_layer_input=0,
  vocab_size_per_layer_input=0,
  sliding_window=4,
  layer_types=[SLIDING, FULL],
  rope_parameters=CONFIGS["shared"]["rope_parameters"],
)


def _perturb_buffers(model: torch.nn.Module, seed: int) -> None:
  """Layer scalars ≠ 1, a random token ordering and router scales around 1: an ignored buffer
  or scale changes the output."""
  gen = torch.Generator().manual_seed(seed)
  with torch.no_grad():
    for name, p in model.named_parameters():
      if name.endswith(("router.scale", "router.per_expert_scale")):
        p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=gen))
    for name, b in model.named_buffers():
      if name.endswith("layer_scalar"):
        b.copy_(0.5 + torch.rand(b.shape, generator=gen))
      elif name.endswith("token_ordering"):
        b.copy_(torch.randperm(b.shape[0], generator=gen))


def _build(name: str, seed: int = 0, **changes):
  config = {**CONFIGS[name], **changes}
  model = hf_models.build_hf_model_from("Gemma4TextConfig", "Gemma4ForCausalLM", config, seed)
  _perturb_buffers(model, seed + 7)
  return model


def _build_assistant(seed: int = 3, text_changes=None, **changes):
  text = transformers.Gemma4TextConfig(**{**ASSISTANT_TEXT, **(text_changes or {})})
  config = transformers.Gemma4AssistantConfig(text_config=text, **{**ASSISTANT, **changes})
  torch.manual_seed(seed)
  model = hf_models.perturbed(transformers.Gemma4AssistantForCausalLM(config), seed + 1)
  _perturb_buffers(model, seed + 2)
  return model


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  """name → (HF model, checkpoint dir); "assistant" → (HF assistant, its dir)."""
  out = {}
  for name in CONFIGS:
    d = str(tmp_path_factory.mktemp(f"gemma4_{name}"))
    model = _build(name)
    model.save_pretrained(d)
    out[name] = (model, d)
  d = str(tmp_path_factory.mktemp("gemma4_assistant"))
  assistant = _build_assistant()
  assistant.save_pretrained(d)
  out["assistant"] = (assistant, d)
  return out


@pytest.fixture(scope="module")
def pair(saved):
  """(target, assistant drafter γ = 3) in decoding's layout."""
  target = jaxspec.load_model(saved["shared"][1])
  return target, jaxspec.load_drafter(saved["assistant"][1], target, gamma=3)


def _ids(shape=(2, 11), seed: int = 0) -> np.ndarray:
  return np.random.default_rng(seed).integers(0, VOCAB, shape)


# -- the target ------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_logits_match_transformers(saved, name):
  hf, d = saved[name]
  ids = _ids()
  want = hf_models.hf_logits(hf, ids)
  for scan in (True, False):
    model = jaxspec.load_model(d, scan_layers=scan)
    near_ties.assert_logits_match(model, ids, np.asarray(model.logits(ids)), want, atol=1e-4)


def test_config_reads_transformers_and_hub_keys_and_round_trips(saved):
  _, d = saved["shared"]
  with open(os.path.join(d, "config.json")) as f:
    native = json.load(f)
  c = config_from_hf(native)
  assert c.layer_windows == (4, 4, 0, 4, 4, 0)
  assert (c.head_dim, c.global_head_dim, c.global_num_kv_heads) == (8, 16, 1)
  assert c.rope_scaling == (("partial_rotary_factor", 0.5), ("rope_type", "proportional"))
  assert c.segments() == ((0, 2, False), (2, 1, False), (3, 1, False), (4, 1, False), (5, 1, False))
  assert [c.kv_source(i) for i in (4, 5)] == [3, 2]
  assert config_from_hf(config_to_hf(c)) == c
  # The hub's spelling: global_head_dim / num_global_key_value_heads, no per_layer_config.
  hub = {k: v for k, v in native.items() if k != "per_layer_config"}
  hub.update(global_head_dim=16, num_global_key_value_heads=1)
  assert config_from_hf(hub) == c
  # A multimodal wrapper's config reads its text_config.
  wrapped = {"architectures": ["Gemma4ForConditionalGeneration"], "text_config": native}
  assert config_from_hf(wrapped) == c


@pytest.mark.parametrize(
  "change, match",
  [
    (dict(num_experts=None, enable_moe_block=True), "num_experts"),
    (dict(use_bidirectional_attention="all"), "use_bidirectional_attention"),
    (dict(hidden_activation="relu"), "hidden_activation"),
    (dict(per_layer_config={"0": {"head_dim": 16}}), "per_layer_config"),
    (dict(per_layer_config={"2": {"sliding_window": 3}, "5": {}}), "per_layer_config"),
    (dict(global_head_dim=32), "global_head_dim and per_layer_config disagree"),
    (dict(rope_parameters={FULL: {"rope_type": "yarn", "factor": 2.0}}), "yarn"),
    (dict(num_kv_shared_layers=6), "num_kv_shared_layers"),
  ],
)
def test_unsupported_or_conflicting_keys_are_refused_by_name(saved, change, match):
  _, d = saved["shared"]
  with open(os.path.join(d, "config.json")) as f:
    hf = {**json.load(f), **change}
  with pytest.raises(ConfigError, match=match):
    config_from_hf(hf)


def test_the_logits_depend_on_the_gemma_pieces(saved):
  """Broken variants fail the reference: full layers turned by the default RoPE, and KV-shared
  layers computing their own K/V-less attention over the wrong layer (the other type's)."""
  hf, d = saved["shared"]
  model = jaxspec.load_model(d, scan_layers=True)
  ids = _ids(seed=2)
  want = hf_models.hf_logits(hf, ids)
  wrong_rope = model.with_config(rope_scaling=())
  assert np.abs(np.asarray(wrong_rope.logits(ids)) - want).max() > 1e-3
  no_cap = model.with_config(final_logit_softcapping=0.0)
  assert np.abs(np.asarray(no_cap.logits(ids)) - want).max() > 1e-3


def test_moe_block_round_trips_quantizes_and_depends_on_its_scales(saved, tmp_path):
  """The MoE block beside the MLP: exported in transformers' fused expert layout and read back
  by transformers; the default policy quantizes its experts (its scales stay float); a model
  ignoring the per-expert scales is off."""
  hf, d = saved["moe"]
  model = jaxspec.load_model(d, scan_layers=True)
  ids = _ids(seed=8)
  want = hf_models.hf_logits(hf, ids)
  out = str(tmp_path / "moe")
  jaxspec.save_hf(model, out)
  back = transformers.AutoModelForCausalLM.from_pretrained(out).float().eval()
  np.testing.assert_allclose(hf_models.hf_logits(back, ids), want, atol=1e-5)
  moe = model.params["layers_0"]["moe"]
  unscaled = jax.tree_util.tree_map(lambda x: x, model.params)
  unscaled["layers_0"]["moe"] = {**moe, "per_expert_scale": jnp.ones_like(moe["per_expert_scale"])}
  off = np.asarray(target_lib.TargetModel(model.config, unscaled).logits(ids))
  assert np.abs(off - want).max() > 1e-3
  q = jaxspec.quantize(model)
  qmoe = q.params["layers_0"]["moe"]
  assert qmoe["gate_up_proj"].format == "mxfp4" and qmoe["down_proj"].format == "mxfp4"
  for name in ("router_scale", "per_expert_scale"):
    assert not isinstance(qmoe[name], jaxspec.quant.QTensor), name
  assert np.isfinite(np.asarray(q.logits(ids))).all()


def test_checkpoint_round_trip_and_multimodal_layout(saved, tmp_path):
  hf, d = saved["shared"]
  model = jaxspec.load_model(d, scan_layers=True)
  out = str(tmp_path / "resaved")
  jaxspec.save_hf(model, out)
  back = transformers.AutoModelForCausalLM.from_pretrained(out).float().eval()
  ids = _ids(seed=5)
  want = hf_models.hf_logits(hf, ids)
  np.testing.assert_allclose(hf_models.hf_logits(back, ids), want, atol=1e-5)
  # The text model of a Gemma4ForConditionalGeneration checkpoint: model.language_model.*,
  # beside towers that are left out with a warning.
  wrapped = tmp_path / "wrapped"
  wrapped.mkdir()
  tensors = {}
  for f in os.listdir(d):
    if f.endswith(".safetensors"):
      tensors.update(load_file(os.path.join(d, f)))
  tensors = {n.replace("model.", "model.language_model.", 1): t for n, t in tensors.items()}
  tensors["model.vision_tower.patch.weight"] = np.zeros((2, 2), np.float32)
  save_file(tensors, str(wrapped / "model.safetensors"))
  with open(os.path.join(d, "config.json")) as f:
    text = json.load(f)
  with open(wrapped / "config.json", "w") as f:
    json.dump({"architectures": ["Gemma4ForConditionalGeneration"], "text_config": text}, f)
  with pytest.warns(UserWarning, match="vision"):
    inner = jaxspec.load_model(str(wrapped), scan_layers=True)
  np.testing.assert_allclose(np.asarray(inner.logits(ids)), np.asarray(model.logits(ids)))


def test_cached_greedy_decoding_is_transformers_full_forward_argmax(saved):
  """Rings for the sliding layers, nothing stored for the KV-shared ones; a prompt 3.5 windows
  long that holds token 0 (an ordinary token: transformers' `generate` with pad_token_id=0
  and no mask drops it, see near_ties). The oracle is transformers' uncached forward."""
  hf, d = saved["shared"]
  model = jaxspec.load_model(d)
  prompt = _ids((1, 14), seed=7)
  assert 0 in prompt
  new = 12  # 26 positions: the window of 4 slides over prompt and output
  engine = SpecEngine(model, None, EngineConfig(max_len=48, batch_size=1, use_eos=False))
  kinds = [type(s) for s in engine.empty_state().target_state.segments]
  assert kinds[3:] == [SharedKV, SharedKV] and SlidingKV in kinds
  got = engine.generate([prompt[0].tolist()], max_new_tokens=new, temperature=0.0)
  assert len(got.tokens[0]) == new
  near_ties.assert_greedy_is_full_forward_argmax(hf, prompt[0], got.tokens[0], model)


# -- the assistant ---------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _OneShort(ga.Gemma4AssistantDrafter):
  """A broken assistant: it reads the target's cache one position short."""

  def kv_end(self, slot):
    return slot - 1


def _hf_draft_logprobs(hf, assistant, ids: np.ndarray, root: int, gamma: int) -> list:
  """transformers' assistant loop (its candidate generator's) over the target's shared K/V of
  the prompt: per-step log-probabilities, following the argmax."""
  p = ids.shape[1]
  with torch.no_grad():
    out = hf(torch.as_tensor(ids), output_hidden_states=True, return_shared_kv_states=True)
    kv, h = dict(out.shared_kv_states), out.hidden_states[-1][:, -1:]
    tok, steps = torch.tensor([[root]]), []
    for _ in range(gamma):
      o = assistant(
        inputs_embeds=torch.cat([hf.model.embed_tokens(tok), h], -1),
        position_ids=torch.tensor([[p]]),
        shared_kv_states=kv,
        attention_mask=torch.ones(1, p + 1, dtype=torch.long),
      )
      steps.append(torch.log_softmax(o.logits[0, -1].float(), -1).numpy())
      tok, h = o.logits.argmax(-1), o.last_hidden_state
  return steps


def _draft_logprobs(target, drafter, ids: np.ndarray, root: int) -> np.ndarray:
  p = ids.shape[1]
  state = DecodingState.create(target.config, 1, 32)
  out = target_lib.apply_decoder(
    target.config, target.params, jnp.asarray(ids), jnp.zeros((1,), jnp.int32), state
  )
  tokens = jnp.zeros((1, 32), jnp.int32).at[0, :p].set(jnp.asarray(ids[0])).at[0, p].set(root)
  ds = drafter.init_state(drafter.params, 1, 32).replace(last_hidden=out.hidden[:, -1])
  ctx = ProposeContext(
    tokens,
    jnp.asarray([p + 1]),
    sampling.make_sampling_params(1, temperature=1.0),
    jax.random.PRNGKey(0),
    out.state.with_lengths(jnp.asarray([p])),
  )
  tree = drafter.for_tree()
  proposal, _ = tree.propose(tree.params, ds, ctx)
  return np.asarray(proposal.logprobs[0])


def test_assistant_steps_equal_transformers_given_the_target_cache(saved, pair):
  """Every draft step's log-probabilities within 1e-4 of transformers', before and past the
  window (prompts of 3 and 9 tokens, window 4); a broken assistant reading the cache one
  position short is far off."""
  hf, _ = saved["shared"]
  assistant, _ = saved["assistant"]
  target, drafter = pair
  assert drafter.config.ordered_head and drafter.gamma == 3
  for p, seed in ((3, 1), (9, 2)):
    ids, root = _ids((1, p), seed=seed), 7
    want = np.stack(_hf_draft_logprobs(hf, assistant, ids, root, 3))
    np.testing.assert_allclose(_draft_logprobs(target, drafter, ids, root), want, atol=1e-4)
  short = _OneShort(**{f.name: getattr(drafter, f.name) for f in dataclasses.fields(drafter)})
  got = _draft_logprobs(target, short, ids, root)
  assert np.abs(got[0] - want[0]).max() > 1e-3


def test_ordered_head_keeps_the_chosen_clusters_and_fills_the_rest():
  rng = np.random.default_rng(0)
  h = jnp.asarray(rng.normal(size=(2, 1, 6)), jnp.float32)
  centroids = jnp.asarray(rng.normal(size=(6, 4)), jnp.float32)
  ordering = jnp.asarray(rng.permutation(12), jnp.int32)
  table = jnp.asarray(rng.normal(size=(12, 6)), jnp.float32)
  got = np.asarray(ga.ordered_logits(h, centroids, ordering, table, 2))
  full = np.einsum("bth,vh->btv", np.asarray(h), np.asarray(table))
  scores = np.einsum("bth,hc->btc", np.asarray(h), np.asarray(centroids))
  groups = np.asarray(ordering).reshape(4, 3)
  for b in range(2):
    kept = groups[np.argsort(-scores[b, 0])[:2]].reshape(-1)
    np.testing.assert_allclose(got[b, 0, kept], full[b, 0, kept], rtol=1e-5)
    rest = np.setdiff1d(np.arange(12), kept)
    np.testing.assert_allclose(got[b, 0, rest], full[b, 0, kept].min() - 1.0, rtol=1e-5)


def test_taps_are_transformers_hidden_states(saved, pair):
  """DFlash / EAGLE-3 taps of a sliding, a full and a KV-shared layer are transformers'
  hidden_states[i + 1]; a drafter bound to the target embeds with its scale."""
  hf, _ = saved["shared"]
  target, _ = pair
  ids = _ids((1, 9), seed=6)
  taps = (1, 2, 4)
  out = target_lib.forward(target.config, target.params, jnp.asarray(ids), taps=taps)
  with torch.no_grad():
    want = hf(torch.as_tensor(ids), output_hidden_states=True).hidden_states
  for got, i in zip(np.asarray(out.taps), taps):
    np.testing.assert_allclose(got, want[i + 1].numpy(), atol=1e-4, rtol=1e-4)
  dflash = drafter_models.small_dflash(target, target_layer_ids=(1, 4))
  assert dflash.config.embed_scale == target.config.hidden_size**0.5


@pytest.fixture(scope="module")
def engines(pair):
  """Plain, assistant chain and assistant tree (budget 6) engines of 4 slots, compiled once."""
  target, drafter = pair
  cfg = EngineConfig(max_len=48, batch_size=4, use_eos=False)
  return dict(
    plain=SpecEngine(target, None, cfg),
    chain=SpecEngine(target, drafter, cfg),
    tree=SpecEngine(target, drafter, dataclasses.replace(cfg, verify="tree", tree_budget=6)),
  )


def test_speculative_decoding_is_lossless(pair, engines):
  """Greedy speculation with the assistant equals plain decoding past the window, batch 1 and
  4, chain and tree."""
  target, _ = pair
  for batch in (1, 4):
    ps = drafter_models.prompts(batch, VOCAB)
    want = engines["plain"].generate(ps, max_new_tokens=12)
    for engine in (engines["chain"], engines["tree"]):
      got = engine.generate(ps, max_new_tokens=12)
      near_ties.assert_greedy_match(target, ps, want.tokens, got.tokens)
      assert all(len(t) == 12 for t in got.tokens)


@pytest.fixture(scope="module")
def small_vocab(tmp_path_factory):
  """A pair over 8 tokens (4 clusters, 2 kept), window 64: random drafts are accepted often
  enough that acceptance lengths vary. → (HF target, HF assistant, target, target dir,
  assistant dir)."""
  vocab = dict(vocab_size=8, vocab_size_per_layer_input=8, sliding_window=64)
  hf = _build("shared", **vocab)
  assistant = _build_assistant(
    text_changes=dict(vocab_size=8, sliding_window=64), num_centroids=4,
    centroid_intermediate_top_k=2,
  )
  dirs = [str(tmp_path_factory.mktemp(n)) for n in ("gemma4_v8", "gemma4_v8_assistant")]
  hf.save_pretrained(dirs[0])
  assistant.save_pretrained(dirs[1])
  return hf, assistant, jaxspec.load_model(dirs[0]), *dirs


def _committed_kv_only(assistant) -> None:
  """transformers' assisted generation, corrected: its candidate generator hands the assistant
  the target's K/V up to the root's slot inclusive, which after a partly accepted block holds
  the first rejected draft's K/V; this cuts them to the committed positions (< the root's),
  what the assistant reads at prefill and after a fully accepted block."""
  forward = assistant.forward

  def committed(*args, **kwargs):
    end = int(kwargs["position_ids"][0, 0])
    kv = kwargs["shared_kv_states"]
    kwargs["shared_kv_states"] = {k: (a[:, :, :end], b[:, :, :end]) for k, (a, b) in kv.items()}
    return forward(*args, **kwargs)

  assistant.forward = committed


def test_target_passes_equal_transformers_assisted_generation(small_vocab):
  """Greedy, constant γ = 3, six prompts: the same tokens and the same number of target passes
  as transformers' generate(assistant_model=...) (its first pass, the prefill, not counted),
  once its candidate generator reads committed K/V only (`_committed_kv_only`)."""
  hf, assistant, target, _, assistant_dir = small_vocab
  assistant.generation_config.num_assistant_tokens = 3
  assistant.generation_config.num_assistant_tokens_schedule = "constant"
  _committed_kv_only(assistant)
  drafter = jaxspec.load_drafter(assistant_dir, target, gamma=3)
  engine = SpecEngine(target, drafter, EngineConfig(max_len=64, batch_size=1, use_eos=False))
  passes, forward, new = [], hf.forward, 24

  def counted(*args, **kwargs):
    passes[-1] += 1
    return forward(*args, **kwargs)

  hf.forward = counted
  try:
    for seed in range(6):
      prompt = np.random.default_rng(10 + seed).integers(0, 8, (1, 3 + seed))
      passes.append(-1)
      with torch.no_grad():
        want = hf.generate(
          torch.as_tensor(prompt), assistant_model=assistant, max_new_tokens=new,
          min_new_tokens=new, do_sample=False, pad_token_id=0, eos_token_id=None,
        )[0, prompt.shape[1] :]
      got = engine.generate([prompt[0].tolist()], max_new_tokens=new, temperature=0.0)
      assert list(got.tokens[0]) == want.tolist()
      assert got.stats.target_passes == passes[-1]
  finally:
    hf.forward = forward
  assert min(passes) < new - 3  # drafts were accepted


@dataclasses.dataclass(frozen=True)
class _ArgmaxButReportsQ(ga.Gemma4AssistantDrafter):
  """A broken assistant: drafts the argmax but reports the warped q."""

  def propose(self, params, state, ctx):
    prop, state = super().propose(params, state, ctx)
    return prop.replace(tokens=jnp.argmax(prop.probs, axis=-1).astype(jnp.int32)), state


def test_sampled_sequences_follow_the_target_distribution(small_vocab):
  """T = 1, γ = 2: three-token continuations against the target's exact distribution (the
  ordered head's filled tokens included); the broken assistant fails."""
  _, _, target, _, assistant_dir = small_vocab
  drafter = jaxspec.load_drafter(assistant_dir, target, gamma=2)
  prompt, length = [1, 4, 2], 3
  outcomes, probs = drafter_models.exact_sequence_probs(target, prompt, length)
  cfg = EngineConfig(max_len=16, batch_size=512, use_eos=False, min_prompt_bucket=4)
  good = SpecEngine(target, drafter, cfg)
  assert drafter_models.sampled_pvalue(good, prompt, length, 12, outcomes, probs) > 1e-4
  fields = {f.name: getattr(drafter, f.name) for f in dataclasses.fields(drafter)}
  bad = SpecEngine(target, _ArgmaxButReportsQ(**fields), cfg)
  assert drafter_models.sampled_pvalue(bad, prompt, length, 12, outcomes, probs) < 1e-6


def test_the_planner_traces_gemma4(saved):
  """The planner counts exactly the parameters the model loads, and no state for the KV-shared
  layers."""
  from jaxspec.plan import arch  # pylint: disable=import-outside-toplevel

  _, d = saved["shared"]
  with open(os.path.join(d, "config.json")) as f:
    text = json.load(f)
  spec = arch.model_spec(text, param_dtype="float32")
  wrapped = {"architectures": ["Gemma4ForConditionalGeneration"], "text_config": text}
  assert arch.model_spec(wrapped, param_dtype="float32").num_params == spec.num_params
  model = jaxspec.load_model(d, scan_layers=True)
  assert spec.num_params == sum(np.size(x) for x in jax.tree_util.tree_leaves(model.params))
  paths = [t.path for t in spec.state(1, 64)]
  assert paths[:6] == [f"state.segments[{s}].{a}" for s in range(3) for a in "kv"]
  assert not any("segments[3]" in p or "segments[4]" in p for p in paths)


def test_the_assistant_is_found_by_method_name_and_by_kind(saved, pair):
  from launch.cli import defaults  # pylint: disable=import-outside-toplevel
  from jaxspec.drafters import registry  # pylint: disable=import-outside-toplevel

  target, _ = pair
  _, assistant_dir = saved["assistant"]
  drafter = registry.make_drafter("gemma4_assistant", target, gamma=2, draft_dir=assistant_dir)
  assert isinstance(drafter, ga.Gemma4AssistantDrafter) and drafter.gamma == 2
  method, draft_dir, _, _ = defaults.choose_method(target, True, draft_model=assistant_dir)
  assert (method, draft_dir) == ("gemma4_assistant", assistant_dir)
  with pytest.raises(jaxspec.errors.InputError, match="gemma4_assistant"):
    registry.make_drafter("dflash", target, draft_dir=assistant_dir)
  other = jaxspec.load_model(saved["plain"][1])  # full layers 16 wide with 2 KV heads, not 1
  with pytest.raises(ConfigError, match="full layers read"):
    jaxspec.load_drafter(assistant_dir, other)


def test_assistant_reads_committed_positions_mid_generation(saved, pair, engines):
  """After speculative steps (verify blocks written, some drafts rejected, the sliding runs
  rings of window + verify width that have wrapped), the assistant's next draft steps equal
  transformers' assistant over the committed text alone."""
  hf, _ = saved["shared"]
  assistant, _ = saved["assistant"]
  _, drafter = pair
  engine = engines["chain"]
  prompt = _ids((1, 6), seed=9)[0].tolist()
  state = engine.run(engine.init_state([prompt], max_new_tokens=30, temperature=0.0), 8)
  assert any(isinstance(s, SlidingKV) for s in state.target_state.segments)
  n = int(state.seq_len[0])  # committed tokens, the root last
  assert n >= 6 + 1 + 8  # past the rings' 4 + 4 slots
  tokens = np.asarray(state.tokens[0, :n])
  want = np.stack(_hf_draft_logprobs(hf, assistant, tokens[None, :-1], int(tokens[-1]), 3))
  ctx = ProposeContext(
    state.tokens,
    state.seq_len,
    sampling.make_sampling_params(4, temperature=1.0),
    jax.random.PRNGKey(0),
    state.target_state,
  )
  tree = drafter.for_tree()
  proposal, _ = tree.propose(tree.params, state.drafter_state, ctx)
  np.testing.assert_allclose(np.asarray(proposal.logprobs[0]), want, atol=1e-4)
