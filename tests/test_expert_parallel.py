"""The expert-parallel MoE backend (jaxspec/models/expert_parallel.py) on 8 virtual CPU devices.

One fresh interpreter (tests/virtual_devices.py) checks, against the dense oracle
(moe.experts_dense on one device):
  * both exchanges (replicate, all_to_all), tokens replicated over the expert group or split
    over it (data-parallel attention rules), on (data, expert, tensor) meshes 2×2×2, 1×8×1,
    1×4×2 and 2×4×1, for decode (1 token), tree-verify (16) and prefill (40) blocks;
  * float and MXFP4 experts, gate/up and gpt-oss's fused, biased gate_up; routing that leaves
    most experts (and whole devices) without tokens;
  * the ragged exchange, with ragged_all_to_all emulated from all_gather (XLA:CPU lacks it);
  * the documented overflow rule of a capacity factor: exactly the pairs beyond a buffer's
    capacity are dropped, and their count is reported;
  * a whole target (GLM4-MoE) on a 2×2×2 mesh traced under use_mesh: logits of every EP
    backend equal one device's.
"""

from __future__ import annotations

import textwrap

import pytest

from tests import virtual_devices

SCRIPT = textwrap.dedent(r"""
    import functools, json
    import jax, jax.numpy as jnp, numpy as np
    from jaxspec import sharding as sh
    from jaxspec.models import moe, expert_parallel as ep
    from jaxspec.quant.formats import quantize_weight
    from tests import engine_models

    rng = np.random.default_rng(0)
    arr = lambda *s: jnp.asarray(rng.normal(size=s).astype(np.float32) * 0.3)
    E, H, I, K = 8, 64, 64, 3
    run_local = functools.partial(moe.local_experts, "auto")
    SPLIT_RULES = (("batch", ("data", "expert")),) + tuple(
        r for r in sh.DEFAULT_RULES if r[0] != "batch")

    def experts_of(kind):
      if kind == "fused":  # gpt-oss: fused interleaved gate_up with biases, clamped SwiGLU
        return moe.Experts((arr(E, H, 2 * I),), (arr(E, 2 * I),), arr(E, I, H), arr(E, H),
                           functools.partial(moe.clamped_swiglu, limit=7.0, alpha=1.702))
      ex = moe.Experts((arr(E, H, I), arr(E, H, I)), None, arr(E, I, H), None, moe.swiglu)
      return ex
    def quantized(ex):
      q = lambda w: quantize_weight(w, "mxfp4", (-2,))
      return ex._replace(ins=tuple(q(m) for m in ex.ins), down=q(ex.down))

    def routing(n, skew=False):
      logits = arr(n, E)
      if skew:  # every token's experts among {0, 1, 2}: devices 2.. of an 8-way group get none
        logits = logits.at[:, 3:].add(-100.0)
      w, ids = jax.lax.top_k(jax.nn.softmax(logits), K)
      return w, ids.astype(jnp.int32)

    def run(mesh, rules, backend, x, w, ids, ex, factor=0.0, ragged=None):
      arrays = (ex.ins, ex.in_biases, ex.down, ex.down_bias)
      def f(x, w, ids, arrays):
        ins, ib, down, db = arrays
        e2 = ex._replace(ins=ins, in_biases=ib, down=down, down_bias=db)
        return ep.experts_ep(x, w, ids, e2, run_local, mesh=sh.active_mesh(), rules=rules,
                             backend=backend, capacity_factor=factor, ragged_all_to_all=ragged)
      with sh.use_mesh(mesh, rules):
        y, d = jax.jit(f)(x, w, ids, arrays)
      return np.asarray(y), int(d)

    def err(a, b):
      return float(np.max(np.abs(a - b)) / (np.max(np.abs(b)) + 1e-30))

    def emulated_ragged(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes,
                        *, axis_name):
      # jax.lax.ragged_all_to_all's documented semantics from all_gather: chunk j of sender s
      # (rows input_offsets[j] .. + send_sizes[j]) lands at output_offsets[j] of receiver j.
      me = jax.lax.axis_index(axis_name)
      ops = jax.lax.all_gather(operand, axis_name)
      ino = jax.lax.all_gather(input_offsets, axis_name)
      sz = jax.lax.all_gather(send_sizes, axis_name)
      outo = jax.lax.all_gather(output_offsets, axis_name)
      rows = jnp.arange(output.shape[0])
      for s in range(ops.shape[0]):
        start, size, src = outo[s, me], sz[s, me], ino[s, me]
        inside = (rows >= start) & (rows < start + size)
        got = ops[s][jnp.clip(rows - start + src, 0, operand.shape[0] - 1)]
        output = jnp.where(inside.reshape((-1,) + (1,) * (output.ndim - 1)), got, output)
      return output

    results = {"layer": [], "overflow": None, "model": {}}
    meshes = {"2x2x2": (2, 2, 2), "1x8x1": (1, 8, 1), "1x4x2": (1, 4, 2), "2x4x1": (2, 4, 1)}
    cases = [
        # mesh, split, backend, tokens, kind, mxfp4, skew, ragged
        ("2x2x2", False, "ep_replicate", 1, "plain", False, False, False),
        ("2x2x2", False, "ep_all_to_all", 16, "plain", False, False, False),
        ("2x2x2", True, "ep_all_to_all", 40, "plain", True, False, False),
        ("2x2x2", True, "ep_replicate", 16, "fused", False, False, False),
        ("1x8x1", False, "ep_all_to_all", 16, "plain", False, True, False),
        ("1x8x1", False, "ep_replicate", 3, "fused", True, True, False),
        ("1x8x1", True, "ep_all_to_all", 40, "fused", False, False, True),
        ("1x4x2", False, "ep_all_to_all", 40, "fused", True, False, False),
        ("1x4x2", True, "ep", 16, "plain", False, True, True),
        ("2x4x1", False, "ep", 1, "plain", True, False, False),
        ("2x4x1", False, "ep_all_to_all", 16, "plain", False, False, True),
    ]
    for name, split, backend, n, kind, mx, skew, ragged in cases:
      mesh = sh.make_mesh(dict(zip(("data", "expert", "tensor"), meshes[name])))
      ex = experts_of(kind)
      if mx:
        ex = quantized(ex)
      x = arr(n, H)
      w, ids = routing(n, skew)
      ref = np.asarray(moe.experts_dense(x, w, ids, ex))
      y, dropped = run(mesh, SPLIT_RULES if split else None, backend, x, w, ids, ex,
                       ragged=emulated_ragged if ragged else None)
      results["layer"].append(dict(case=[name, split, backend, n, kind, mx, skew, ragged],
                                   err=err(y, ref), dropped=dropped))

    # Overflow: 1x4x2, tokens replicated, capacity factor 0.5; device r dispatches rows
    # [r*m, (r+1)*m) and each (source, destination) buffer keeps its first C pairs.
    mesh = sh.make_mesh({"data": 1, "expert": 4, "tensor": 2})
    n, e, local = 24, 4, E // 4
    ex = experts_of("plain")
    x = arr(n, H)
    w, ids = routing(n, skew=True)
    m = n // e
    cap = ep.capacity(m, K, local, e, 0.5)
    keep = np.ones((n, K), bool)
    ids_np = np.asarray(ids)
    for src in range(e):
      used = {}
      for row in range(src * m, (src + 1) * m):
        for slot in range(K):
          d = ids_np[row, slot] // local
          used[d] = used.get(d, 0) + 1
          keep[row, slot] = used[d] <= cap
    ref = np.asarray(moe.experts_dense(x, jnp.where(keep, w, 0.0), ids, ex))
    full = np.asarray(moe.experts_dense(x, w, ids, ex))
    y, dropped = run(mesh, None, "ep_all_to_all", x, w, ids, ex, factor=0.5)
    results["overflow"] = dict(err=err(y, ref), err_vs_full=err(y, full), dropped=dropped,
                               expected=int((~keep).sum()), capacity=cap)

    # A whole target on a 2x2x2 mesh, traced under use_mesh (so "auto" runs expert-parallel),
    # float and quantized (MXFP4 experts, FP8 attention: the default policy).
    import jaxspec
    from jaxspec.models import target as target_lib
    cfg = engine_models.random_target().config.replace(
        num_experts=8, num_experts_per_tok=3, hidden_size=64, head_dim=16,
        intermediate_size=128, moe_intermediate_size=64)
    model = engine_models._scaled(target_lib.TargetModel.random(cfg, seed=5), 2.0)
    tokens = np.random.default_rng(1).integers(0, cfg.vocab_size, (4, 12)).astype(np.int32)
    mesh = sh.make_mesh({"data": 2, "expert": 2, "tensor": 2})
    def expert_shard(params):  # one device's piece of the routed experts' down projection
      for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        name = jax.tree_util.keystr(path)
        if name.endswith("['down_proj']") or "['down_proj'].values" in name:
          return list(leaf.addressable_shards[0].data.shape)
    for label, m, backends in (("float", model, ("auto", "ep_replicate", "ep_all_to_all")),
                               ("mxfp4", jaxspec.quantize(model), ("auto",))):
      one = np.asarray(m.with_options(moe_backend="dense").logits(tokens))
      params = sh.shard_tree(m.params, target_lib.params_logical_axes(cfg, m.params), mesh)
      for backend in backends:
        fwd = jax.jit(functools.partial(target_lib.forward, cfg.with_options(moe_backend=backend)))
        with sh.use_mesh(mesh):
          out = np.asarray(fwd(params, tokens).logits)
          hlo = fwd.lower(params, tokens).as_text()
        results["model"][f"{label}/{backend}"] = dict(
            err=err(out, one), all_to_all=hlo.count("all_to_all") + hlo.count("all-to-all"),
            local_expert_shape=expert_shard(params))

    print(json.dumps(results))
""")


def test_expert_parallel_equals_dense_oracle():
  out = virtual_devices.run_json(SCRIPT)
  for case in out["layer"]:
    assert case["err"] < 1e-5, case
    assert case["dropped"] == 0, case
  over = out["overflow"]
  assert over["expected"] > 0, over  # the case really overflows
  assert over["dropped"] == over["expected"], over
  assert over["err"] < 1e-5, over
  assert over["err_vs_full"] > 1e-3, over  # and dropping changed the output
  for backend, r in out["model"].items():
    assert r["err"] < 1e-5, (backend, r)
    assert r["local_expert_shape"][1] == 4, r  # [layers, experts, ...]: 8 experts over 2 devices
  assert out["model"]["float/ep_all_to_all"]["all_to_all"] > 0
  assert out["model"]["float/ep_replicate"]["all_to_all"] == 0


MLA_SCRIPT = textwrap.dedent(r"""
    import json
    import jax, numpy as np
    from jaxspec import sharding as sh
    from jaxspec.config import ModelConfig
    from jaxspec.models import target as target_lib
    from jaxspec.models.target import TargetModel
    from jaxspec.speculative.engine import SpecEngine
    from jaxspec.speculative.engine_config import EngineConfig
    from tests import near_ties
    from tests.drafter_models import prompts, random_params

    assert len(jax.devices()) == 8, jax.devices()
    # A DeepSeek-V3 (q low-rank, a dense layer, then MoE: 4 routed experts over expert=2, 4
    # heads over tensor=2, one shared latent per token whose kv_lora axis stays whole).
    cfg = ModelConfig(
        architecture="DeepseekV3ForCausalLM", vocab_size=64, hidden_size=32, num_layers=2,
        num_heads=4, num_kv_heads=4, head_dim=16, intermediate_size=48, num_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=16, router="sigmoid", n_group=2,
        topk_group=1, norm_topk_prob=True, n_shared_experts=1, layer_is_moe=(False, True),
        q_lora_rank=16, kv_lora_rank=24, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8,
        rope_interleave=True, num_mtp_layers=0, tie_word_embeddings=False,
    ).with_options(scan_layers=False)
    target = TargetModel(cfg, random_params(target_lib.param_shapes(cfg), 3))
    mesh = sh.make_mesh({"data": 2, "expert": 2, "tensor": 2})
    ec = EngineConfig(max_len=40, batch_size=2, use_eos=False)
    ps = prompts(2, cfg.vocab_size)
    one = SpecEngine(target, None, ec).generate(ps, max_new_tokens=10).tokens
    eng = SpecEngine(target, None, ec, mesh=mesh)
    got = eng.generate(ps, max_new_tokens=10).tokens
    try:
        near_ties.assert_greedy_match(target, ps, one, got)
        greedy = "ok"
    except AssertionError as e:
        greedy = str(e)
    # Where the latent cache's shards lie: batch over data, the latent vector whole.
    c = eng.init_state(ps, max_new_tokens=10).target_state.segments[0].c
    print(json.dumps(dict(greedy=greedy, latent_shape=list(c.shape), spec=str(c.sharding.spec),
                          local=list(c.addressable_shards[0].data.shape))))
""")


@pytest.mark.slow  # ~42 s on 2 CPU cores: two engines compiled
def test_mla_target_on_an_expert_parallel_mesh_decodes_as_one_device():
  """A DeepSeek-V3 target (MLA + routed experts) on a (data=2, expert=2, tensor=2) mesh:
  greedy decoding equals one device's (up to near-ties)."""
  out = virtual_devices.run_json(MLA_SCRIPT)
  assert out["greedy"] == "ok", out
  layers, batch, length, latent = out["latent_shape"]
  assert out["local"] == [layers, batch // 2, length, latent], out  # kv_lora unsplit
