"""The target model sharded over an 8-device CPU mesh (data × expert × tensor).

XLA's device count is fixed when the backend starts, and the rest of the test session already
runs on one CPU device, so the 8-device checks run in a fresh interpreter with
--xla_force_host_platform_device_count=8 and report back as JSON.
"""

from __future__ import annotations

import textwrap

import pytest

from tests import virtual_devices

SCRIPT = textwrap.dedent(r"""
    import json, sys, tempfile
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import PartitionSpec as P
    from jaxspec import sharding as sh
    from jaxspec.config import ModelConfig
    from jaxspec.io import checkpoint
    from jaxspec.models import target as target_lib

    assert len(jax.devices()) == 8, jax.devices()
    cfg = ModelConfig(architecture="Glm4MoeForCausalLM", vocab_size=96, hidden_size=32,
                      num_layers=3, num_heads=4, num_kv_heads=2, head_dim=16,
                      intermediate_size=64, num_experts=4, num_experts_per_tok=2,
                      moe_intermediate_size=16, router="sigmoid", n_shared_experts=1,
                      layer_is_moe=(False, True, True), num_mtp_layers=1,
                      partial_rotary_factor=0.5)
    model = target_lib.TargetModel.random(cfg, seed=3)
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, (4, 10)).astype(np.int32)
    ref = np.asarray(model.logits(ids))

    mesh = sh.make_mesh({"data": 2, "expert": 2, "tensor": 2})
    logical = target_lib.logical_axes(cfg)
    params = sh.shard_tree(model.params, logical, mesh)
    specs = {
        "expert_gate": params["layers_1"]["mlp"]["gate_proj"].sharding.spec,
        "q_proj": params["layers_0"]["self_attn"]["q_proj"]["kernel"].sharding.spec,
        "k_proj": params["layers_1"]["self_attn"]["k_proj"]["kernel"].sharding.spec,
        "o_proj": params["layers_0"]["self_attn"]["o_proj"]["kernel"].sharding.spec,
        "embed": params["embed"].sharding.spec,
        "mtp_expert_down": params["mtp_0"]["block"]["mlp"]["down_proj"].sharding.spec,
    }
    sharded_model = target_lib.TargetModel(cfg, params)
    tokens = jax.device_put(jnp.asarray(ids), jax.sharding.NamedSharding(mesh, P("data", None)))
    out = np.asarray(sharded_model.logits(tokens))
    # The expert-parallel layout must not be silently gathered onto one device.
    local = params["layers_1"]["mlp"]["gate_proj"].addressable_shards[0].data.shape

    # orbax: save from this mesh, restore onto another mesh and onto one device.
    d = tempfile.mkdtemp()
    checkpoint.save(sharded_model, d)
    mesh2 = sh.make_mesh({"data": 1, "expert": 4, "tensor": 2})
    restored = checkpoint.restore(d, mesh=mesh2)
    single = checkpoint.restore(d)
    same = jax.tree_util.tree_all(jax.tree_util.tree_map(
        lambda a, b, c: bool(np.array_equal(np.asarray(a), np.asarray(b)) and
                             np.array_equal(np.asarray(a), np.asarray(c))),
        model.params, restored.params, single.params))
    restored_spec = restored.params["layers_1"]["mlp"]["gate_proj"].sharding.spec
    restored_local = restored.params["layers_1"]["mlp"]["gate_proj"].addressable_shards[0].data.shape
    # Compared up to the first routing near-tie of each sequence (tests/near_ties.py).
    from tests import near_ties
    stable = near_ties.stable_positions(model, ids)
    print(json.dumps(dict(
        max_diff=float(np.abs(out - ref)[stable].max()),
        excluded=float(1.0 - stable.mean()),
        specs={k: str(v) for k, v in specs.items()},
        local_expert_shape=list(local),
        restored_exact=bool(same),
        restored_spec=str(restored_spec),
        restored_local=list(restored_local),
    )))
""")


@pytest.fixture(scope="module")
def result():
  return virtual_devices.run_json(SCRIPT)


def test_sharded_forward_equals_single_device(result):
  assert result["max_diff"] < 1e-5
  assert result["excluded"] <= 0.25


def test_parameters_carry_expected_shardings(result):
  specs = result["specs"]
  assert specs["expert_gate"] == "P(None, 'expert', None, 'tensor')"
  assert specs["q_proj"] == "P(None, None, 'tensor', None)"
  assert specs["k_proj"] == "P(None, None, 'tensor', None)"
  assert specs["o_proj"] == "P(None, 'tensor', None, None)"
  assert specs["embed"] == "P('tensor', None)"
  assert specs["mtp_expert_down"] == "P('expert', 'tensor', None)"
  # 4 experts over expert=2 and moe width 16 over tensor=2: each device holds 2 × 32 × 8.
  assert result["local_expert_shape"] == [2, 2, 32, 8]


def test_orbax_restores_exactly_onto_another_mesh(result):
  assert result["restored_exact"]
  assert result["restored_spec"] == "P(None, 'expert', None, 'tensor')"
  assert result["restored_local"] == [2, 1, 32, 8]
