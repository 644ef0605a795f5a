"""`SpecEngine` on a (data=2, expert=2, tensor=2) mesh of 8 virtual CPU devices vs one device.

One fresh interpreter (tests/virtual_devices.py) builds each engine twice, on one device and on
the mesh, and reports: greedy outputs and statistics (equal up to the first near-tie,
tests/near_ties.py), where the KV caches' shards lie (batch on `data`, KV heads on `tensor`),
whether every state leaf has the layout `SpecEngine.state_shardings` gives it after prefill,
after a step and after slot inserts, whether the state was donated, and compilation counts.
The key cases (DDTree with DFlash, chains with EAGLE-3 and MTP, slots) run in CI; the other
verification × drafter pairs and an FP8 cache are slow-marked.
"""

from __future__ import annotations

import textwrap
from typing import ClassVar

import flax.struct
import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec

from jaxspec import sharding
from jaxspec import state as state_lib
from jaxspec.config import ModelConfig
from jaxspec.errors import ConfigError
from jaxspec.models import target as target_lib
from jaxspec.models.target import TargetModel
from jaxspec.quant.formats import QTensor, quantize_weight
from jaxspec.speculative.engine import SpecEngine
from jaxspec.speculative.engine_config import EngineConfig
from tests import virtual_devices

SCRIPT = textwrap.dedent(r"""
    import dataclasses, json, sys, time
    CLOCK = time.process_time()
    import jax, numpy as np
    from jaxspec import sharding as sh
    from jaxspec.config import ModelConfig
    from jaxspec.drafters.eagle3 import Eagle3Drafter
    from jaxspec.drafters.mtp import MTPDrafter
    from jaxspec.models import target as target_lib
    from jaxspec.models.target import TargetModel
    from jaxspec.speculative.engine import SpecEngine
    from jaxspec.speculative.engine_config import EngineConfig
    from jaxspec.speculative.placement import place_on_mesh
    from tests import near_ties
    from tests.drafter_models import prompts, random_params, small_dflash

    assert len(jax.devices()) == 8, jax.devices()
    cases, twins = sys.argv[1].split(","), sys.argv[2].split(",")
    # A GLM4-MoE (a dense layer, then MoE: 4 experts over expert=2, 2 KV heads over tensor=2)
    # with an MTP layer, sharp random weights (few near-ties).
    cfg = ModelConfig(architecture="Glm4MoeForCausalLM", vocab_size=64, hidden_size=32,
                      num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                      intermediate_size=48, num_experts=4, num_experts_per_tok=2,
                      moe_intermediate_size=16, router="sigmoid", n_shared_experts=1,
                      layer_is_moe=(False, True), num_mtp_layers=1, partial_rotary_factor=0.5)
    cfg = cfg.with_options(scan_layers=False)  # decoding's layout: the engine keeps it as placed
    target = TargetModel(cfg, random_params(target_lib.param_shapes(cfg), 3))
    mesh = sh.make_mesh({"data": 2, "expert": 2, "tensor": 2})
    placed, _ = place_on_mesh(target, None, mesh)  # what a restore onto the mesh gives
    NEW, MAX_LEN = 12, 48
    chain = EngineConfig(max_len=MAX_LEN, batch_size=2, use_eos=False)
    tree = dataclasses.replace(chain, verify="tree", tree_budget=6)
    ps = prompts(2, cfg.vocab_size)
    ps2 = prompts(2, cfg.vocab_size, seed=5)  # the same prompt bucket
    # Greedy speculative decoding is lossless: any one-device engine's output (the first twin's)
    # is every case's answer.
    report, reference = {}, None

    def drafter(kind, t):
        if kind == "plain":
            return None
        if kind == "dflash":
            return small_dflash(t, target_layer_ids=(0, 1), num_layers=1)
        if kind == "eagle3":
            return Eagle3Drafter.random(t, target_layer_ids=(0, 1, 1), stddev=0.2, seed=2)
        return MTPDrafter.from_target(t, gamma=2)

    def greedy(reference, got, prompt_list):
        try:
            near_ties.assert_greedy_match(target, prompt_list, reference, got)
            return "ok"
        except AssertionError as e:
            return str(e)

    def wrong_layout(engine, state, batch=None):
        # Leaves whose sharding is not the one state_axes + the rules give them.
        want = jax.tree_util.tree_leaves(engine.state_shardings(batch))
        got = jax.tree_util.tree_flatten_with_path(state)[0]
        assert len(want) == len(got)
        return [jax.tree_util.keystr(p) for (p, x), s in zip(got, want)
                if not x.sharding.is_equivalent_to(s, x.ndim)]

    def shards(x):
        return dict(shape=list(x.shape), local=list(x.addressable_shards[0].data.shape),
                    spec=str(x.sharding.spec))

    def drafter_kv(state):
        d = state.drafter_state
        if d == ():
            return None  # plain decoding
        if hasattr(d, "ctx_k"):
            return d.ctx_k  # DFlash context K
        if hasattr(d, "kv"):
            return d.kv.k  # EAGLE-3
        return d.cache.segments[0].k  # MTP

    leaves = jax.tree_util.tree_leaves
    engines = {}
    for case in cases:
        if case == "slots":
            continue
        kind, verify, *fmt = case.split("-")
        base = tree if verify == "tree" else chain
        if fmt:
            base = dataclasses.replace(base, kv_format=fmt[0])
        # DFlash starts from host weights (the engine places them), the others from a target
        # already on the mesh, which must not move.
        src = target if kind == "dflash" else placed
        eng = SpecEngine(src, drafter(kind, src), base, mesh=mesh)
        engines[case] = eng
        out = eng.generate(ps, max_new_tokens=NEW)
        r = dict(acceptance=[out.stats.acceptance_length])
        if case in twins:  # the same engine on one device: the same steps, the same statistics
            ref = SpecEngine(target, drafter(kind, target), base).generate(ps, max_new_tokens=NEW)
            reference = reference or ref.tokens
            r["twin"] = True
            r["same_tokens"] = ref.tokens == out.tokens
            r["passes"] = [ref.stats.target_passes, out.stats.target_passes]
            r["acceptance"].insert(0, ref.stats.acceptance_length)
            r["greedy"] = greedy(ref.tokens, out.tokens, ps)
        else:
            r["greedy"] = greedy(reference, out.tokens, ps)
        state = eng.init_state(ps2, max_new_tokens=NEW)
        r["prefill_wrong"] = wrong_layout(eng, state)
        r["target_kv"] = [shards(s.k) for s in state.target_state.segments]
        kv = drafter_kv(state)
        r["drafter_kv"] = None if kv is None else shards(kv)
        r["tokens"] = shards(state.tokens)
        stepped = eng.run(state, 1)
        r["donated"] = bool(state.tokens.is_deleted())
        r["step_wrong"] = wrong_layout(eng, stepped)
        eng.run(stepped)
        r["compiles"] = eng.compile_counts()
        if src is placed:
            pairs = zip(leaves(placed.params), leaves(eng.target.params))
            r["kept_placed"] = all(a is b for a, b in pairs)
        r["shares_embed"] = eng.drafter is None or (
            eng.drafter.params["embed"] is eng.target.params["embed"])
        r["expert_kernel"] = shards(eng.target.params["layers_1"]["0"]["mlp"]["down_proj"])
        r["cpu_s"] = time.process_time() - CLOCK
        report[case] = r

    if "slots" in cases:  # prefill_row / insert / run / evict on the mesh
        eng = engines["dflash-tree"]
        state = eng.empty_state()
        row = eng.prefill_row(ps[1], max_new_tokens=NEW)
        s = dict(row_wrong=wrong_layout(eng, row, 1), row_tokens=shards(row.tokens))
        state = eng.insert(state, 0, row)
        s["insert_wrong"] = wrong_layout(eng, state)
        state = eng.run(state)
        first = eng.compile_counts()
        state = eng.evict(state, 0)
        state = eng.insert(state, 1, eng.prefill_row(ps[0], max_new_tokens=NEW))
        state = eng.run(state)
        s["run_wrong"] = wrong_layout(eng, state)
        toks, seq, plen = (np.asarray(x) for x in (state.tokens, state.seq_len, state.prompt_len))
        got = [toks[r, plen[r]:seq[r]].tolist() for r in (1, 0)]  # requests ps[0], ps[1]
        s["greedy"] = greedy(reference, got, ps)
        s["compiles"] = [first, eng.compile_counts()]
        s["cpu_s"] = time.process_time() - CLOCK
        report["slots"] = s
    print(json.dumps(report))
""")

# CI: DDTree with DFlash (against the same engine on one device, step for step), chains with
# EAGLE-3 and MTP (against that one-device output: greedy decoding is lossless), slots. Slow:
# every verification × drafter pair against its one-device twin, and an FP8 cache.
KEY = ("dflash-tree", "eagle3-chain", "mtp-chain", "slots")
KEY_TWINS = ("dflash-tree",)
SLOW = ("dflash-chain", "eagle3-tree", "mtp-tree", "eagle3-chain", "mtp-chain", "mtp-chain-fp8")
SLOW += ("plain-chain",)


def _check_case(r: dict, case: str) -> None:
  assert r["greedy"] == "ok", (case, r["greedy"])
  if r.get("twin") and r["same_tokens"]:  # no near-tie: the same drafts accepted, step for step
    assert r["passes"][0] == r["passes"][1], (case, r["passes"])
  assert r["prefill_wrong"] == [] and r["step_wrong"] == [], (case, r)
  for kv in r["target_kv"]:  # [layers, batch, length, kv_heads, head_dim]: a quarter per device
    assert kv["shape"][1:] == [2, 48, 2, 8] and kv["local"][1:] == [1, 48, 1, 8], (case, kv)
    assert kv["spec"] == "P(None, 'data', None, 'tensor')", (case, kv)
  d = r["drafter_kv"]  # the drafter's K/V: batch over data, KV heads over tensor
  if d is not None:
    assert d["local"][1] * 2 == d["shape"][1] and d["local"][3] * 2 == d["shape"][3], (case, d)
  assert r["tokens"]["local"] == [1, 48], (case, r["tokens"])
  assert r["donated"], case
  # One program per function and bucket: two generate calls, init_state, run(1), run().
  compiles = dict(prefill=1, loop=1, insert=0, insert_rows=0, evict=0, set_page_table=0)
  assert r["compiles"] == compiles, (case, r)
  assert r["shares_embed"], case  # the drafter holds the target's placed embedding, no copy
  assert r.get("kept_placed", True), case  # a target already on the mesh is not moved
  # down_proj [1 layer, 4 experts, 16, 32]: experts over expert, their width over tensor.
  assert r["expert_kernel"]["local"] == [2, 8, 32], (case, r["expert_kernel"])


@pytest.fixture(scope="module")
def key_report():
  return virtual_devices.run_json(SCRIPT, ",".join(KEY), ",".join(KEY_TWINS))


def test_engine_on_mesh_equals_one_device(key_report):
  for case in KEY[:-1]:
    _check_case(key_report[case], case)
  assert key_report["dflash-tree"]["twin"]
  assert key_report["dflash-tree"]["acceptance"][1] > 1.0  # tree paths longer than the root
  assert "kept_placed" in key_report["mtp-chain"]


def test_slots_on_mesh(key_report):
  s = key_report["slots"]
  assert s["greedy"] == "ok", s["greedy"]
  assert s["row_wrong"] == [] and s["insert_wrong"] == [] and s["run_wrong"] == [], s
  assert s["row_tokens"]["local"] == [1, 48]  # one row: the batch is not split
  first, second = s["compiles"]
  assert first == second, s["compiles"]  # a second request compiles nothing
  want = dict(prefill=2, loop=1, insert=1, insert_rows=0, evict=1, set_page_table=0)
  assert second == want, second


@pytest.mark.slow
def test_every_verifier_and_drafter_on_mesh_equals_its_twin():
  report = virtual_devices.run_json(SCRIPT, ",".join(SLOW), ",".join(SLOW))
  for case in SLOW:
    _check_case(report[case], case)
    assert report[case]["twin"]


# --- one device: construction checks that need no mesh of 8 ----------------------------------


def _tiny() -> TargetModel:
  cfg = ModelConfig(
    architecture="Qwen3ForCausalLM",
    vocab_size=32,
    hidden_size=16,
    num_layers=1,
    num_heads=2,
    num_kv_heads=1,
    head_dim=8,
    intermediate_size=32,
    tie_word_embeddings=False,
  )
  shapes = target_lib.param_shapes(cfg)
  return TargetModel(cfg, jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), shapes))


def test_quantized_weights_are_placed_and_rules_without_a_mesh_refused():
  target = _tiny()
  with pytest.raises(ConfigError, match="without a mesh"):
    SpecEngine(target, None, EngineConfig(max_len=8), rules=sharding.DEFAULT_RULES)
  params = dict(target.params)
  kernel = params["lm_head"]["kernel"]
  params["lm_head"] = {"kernel": quantize_weight(kernel, "fp8", (-2,))}
  mesh = sharding.make_mesh({})
  engine = SpecEngine(TargetModel(target.config, params), None, EngineConfig(max_len=8), mesh=mesh)
  placed = engine.target.params["lm_head"]["kernel"]
  assert isinstance(placed, QTensor) and placed.format == "fp8"  # values and scales kept packed
  for arr in (placed.values, placed.scales):
    assert sharding.is_placed(arr, jax.sharding.NamedSharding(mesh, PartitionSpec()))


def test_state_constraints_pass_empty_containers():
  """A drafter-less engine's drafter_state is (): constraining the state must keep it so."""
  axes = {"none": (), "x": PartitionSpec("batch", None)}
  mesh = sharding.make_mesh({})
  with sharding.use_mesh(mesh):  # one device: the rules and a mesh active
    out = jax.jit(lambda t: sharding.with_logical_constraints(t, axes))(
      {"none": (), "x": jnp.zeros((2, 3))}
    )
  assert out["none"] == () and out["x"].shape == (2, 3)
  shardings = sharding.shardings_for({"none": (), "x": jnp.zeros((2, 3))}, axes, mesh)
  assert len(jax.tree_util.tree_leaves(shardings)) == 1  # the empty container has no sharding


@flax.struct.dataclass
class _Named:
  """A state struct whose table puts `batch` on the wrong axis of k [L, B, S, K, D]."""

  k: jax.Array
  AXES: ClassVar[dict] = {"k": ("batch", "layers", "length", "kv_heads", "head_dim")}


def test_state_axes_tables_are_checked_against_the_batch_axis():
  cfg = _tiny().config
  one, two = (jax.eval_shape(lambda b=b: state_lib.DecodingState.create(cfg, b, 8)) for b in (1, 2))
  axes = state_lib.logical_axes(one, two)
  assert axes.segments[0].k == PartitionSpec(*state_lib.KV_AXES)
  assert axes.lengths == PartitionSpec("batch")
  assert state_lib.logical_axes(one) == axes  # every leaf is named: no 2-row state needed
  # A leaf no table names gets `batch` where the 1- and 2-row shapes differ.
  assert state_lib.logical_axes({"x": one.segments[0].k}, {"x": two.segments[0].k}) == {
    "x": PartitionSpec(None, "batch", None, None, None)
  }
  # A table that puts `batch` on the wrong axis is refused, not silently used.
  with pytest.raises(ConfigError, match="batch axis"):
    state_lib.logical_axes(_Named(one.segments[0].k), _Named(two.segments[0].k))
  # Without a 2-row state, a leaf no table names has no axes: an error, not a guess.
  with pytest.raises(ConfigError, match="no logical axes"):
    state_lib.logical_axes({"x": one.lengths})
