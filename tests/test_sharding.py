"""Tests for jaxspec.sharding: rules, divisibility fallback, meshes, placement.

Pure rule logic runs in this process. The checks that need a real 8-device
mesh run in a child process: XLA reads
``--xla_force_host_platform_device_count=8`` only when jax first initialises
its backend, and other test modules in the same pytest process have already
done so with one CPU device. A conftest.py that sets the flag for the whole
session would also work, but it would silently change the device count seen
by every other test. So this file re-runs itself as a script
(``python tests/test_sharding.py``) with the flag set, the child runs every
``_device_check_*`` function below and prints a JSON verdict per check, and
one parametrised test per check reports that verdict.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import traceback

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax.core import meta
from jax.sharding import PartitionSpec as P

import configs
from jaxspec import sharding as sh
from jaxspec.sharding import MeshConfig

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_SIZES = {"data": 2, "expert": 2, "tensor": 2}


@dataclasses.dataclass(frozen=True)
class _MeshConfig:
  """Any object with MeshConfig's fields is accepted, not only the real one."""

  data: int = 1
  expert: int = 1
  tensor: int = 1
  rules: tuple = ()


# --- In-process: rule logic ------------------------------------------------


def test_default_rules_cover_logical_axes():
  logical = [name for name, _ in sh.DEFAULT_RULES]
  assert set(logical) == set(sh.LOGICAL_AXES)
  assert dict(sh.DEFAULT_RULES) == {
    "batch": "data",
    "heads": "tensor",
    "kv_heads": "tensor",
    "mlp": "tensor",
    "expert": "expert",
    "vocab": "tensor",
    "embed": None,
    "layers": None,
    "length": None,
    "head_dim": None,
    "q_lora": None,  # MLA's low-rank widths stay whole
    "kv_lora": None,
    "pages": None,  # a paged KV pool's pages: shared by the rows, kept whole
  }
  for _, axes in sh.DEFAULT_RULES:
    assert axes is None or axes in sh.MESH_AXES


@pytest.mark.parametrize(
  "names",
  [
    ("batch", "length", "embed"),
    ("layers", "embed", "heads", "head_dim"),
    ("layers", "expert", "embed", "mlp"),
    ("vocab", "embed"),
    ("heads", "kv_heads"),  # both want 'tensor': first rule wins
    (None, "mlp"),
  ],
)
def test_rule_mapping_matches_flax(names):
  ours = sh.logical_to_spec(names, sh.DEFAULT_RULES)
  assert ours == nn.logical_to_mesh_axes(names, sh.DEFAULT_RULES)
  # With shapes that all divide, the fallback path gives the same answer.
  assert sh.logical_to_spec(names, sh.DEFAULT_RULES, shape=(8,) * len(names), mesh=_SIZES) == ours


def test_rule_mapping_examples():
  spec = sh.logical_to_spec
  assert spec(("batch", "length", "embed")) == P("data", None, None)
  assert spec(("layers", "expert", "embed", "mlp")) == P(None, "expert", None, "tensor")
  assert spec(("heads", "kv_heads")) == P("tensor", None)
  assert spec(None) == P()
  assert spec(P("vocab", "embed")) == P("tensor", None)
  assert spec(("unknown_axis",)) == P(None)


def test_divisibility_falls_back_to_replication():
  sizes = {"data": 2, "expert": 2, "tensor": 4}
  # 2 KV heads on a tensor axis of 4: replicate instead of erroring.
  assert sh.logical_to_spec(("embed", "kv_heads"), shape=(64, 2), mesh=sizes) == P(None, None)
  assert sh.logical_to_spec(("embed", "kv_heads"), shape=(64, 8), mesh=sizes) == P(None, "tensor")
  # Odd batch: replicated; 3 experts over 2 expert shards: replicated.
  assert sh.logical_to_spec(("batch", "length"), shape=(3, 16), mesh=sizes) == P(None, None)
  assert sh.logical_to_spec(("expert", "embed", "mlp"), shape=(3, 8, 16), mesh=sizes) == P(
    None, None, "tensor"
  )


def test_divisibility_with_multi_axis_rules():
  sizes = {"data": 2, "expert": 2, "tensor": 4}
  rules = (("batch", ("data", "expert")), ("heads", "tensor"))
  # 4 divides 2*2: both axes; 6 divides only 2: the prefix ('data',).
  assert sh.logical_to_spec(("batch", "heads"), rules, shape=(4, 8), mesh=sizes) == P(
    ("data", "expert"), "tensor"
  )
  assert sh.logical_to_spec(("batch", "heads"), rules, shape=(6, 8), mesh=sizes) == P(
    ("data",), "tensor"
  )
  # A later rule for the same logical name is tried when the first fails.
  rules = (("heads", "tensor"), ("heads", "data"))
  assert sh.logical_to_spec(("heads",), rules, shape=(6,), mesh=sizes) == P("data")


def test_logical_spec_errors():
  with pytest.raises(ValueError, match="more than once"):
    sh.logical_to_spec(("embed", "embed"))
  with pytest.raises(ValueError, match="rank 1"):
    sh.logical_to_spec(("embed", "mlp"), shape=(4,), mesh=_SIZES)
  with pytest.raises(ValueError, match="not have"):
    sh.logical_to_spec(("heads",), (("heads", "model"),), mesh=_SIZES)


def test_rules_from_accepts_configs_and_validates():
  assert sh.rules_from(None) == sh.DEFAULT_RULES
  assert sh.rules_from(_MeshConfig()) == sh.DEFAULT_RULES
  custom = (("batch", ("data", "expert")), ("mlp", "tensor"))
  assert sh.rules_from(_MeshConfig(rules=custom)) == custom
  assert sh.rules_from({"data": 2, "rules": [["mlp", "tensor"]]}) == (("mlp", "tensor"),)
  assert sh.rules_from(list(custom)) == custom
  assert sh.rules_from(MeshConfig(tensor=2, rules=custom)) == custom
  assert sh.rules_from(MeshConfig(tensor=2)) == sh.DEFAULT_RULES
  assert sh.rules_from(configs.get("tiny_random").mesh) == sh.DEFAULT_RULES
  with pytest.raises(ValueError, match="pair"):
    sh.rules_from((("mlp",),))
  with pytest.raises(ValueError, match="mesh axes"):
    sh.rules_from((("mlp", 3),))


def test_mesh_shape_and_errors():
  assert sh.mesh_shape({"tensor": 4}) == {"data": 1, "expert": 1, "tensor": 4}
  assert sh.mesh_shape(_MeshConfig(data=2, expert=4)) == {"data": 2, "expert": 4, "tensor": 1}
  assert sh.mesh_shape(MeshConfig(expert=2, tensor=4)) == {"data": 1, "expert": 2, "tensor": 4}
  assert sh.mesh_shape(configs.get("tiny_random").mesh) == {"data": 1, "expert": 1, "tensor": 1}
  with pytest.raises(ValueError, match="unknown mesh axes"):
    sh.mesh_shape({"tensors": 4})
  with pytest.raises(ValueError, match=">= 1"):
    sh.mesh_shape({"data": 0})
  one = jax.devices()[:1]
  with pytest.raises(ValueError, match="needs 4 devices but 1"):
    sh.make_mesh({"data": 2, "tensor": 2}, devices=one)
  with pytest.raises(ValueError, match="at most one"):
    sh.make_mesh({"data": -1, "tensor": -1}, devices=one)
  mesh = sh.make_mesh(_MeshConfig(), devices=one)
  assert mesh.axis_names == sh.MESH_AXES
  assert dict(mesh.shape) == {"data": 1, "expert": 1, "tensor": 1}


def test_constraint_is_noop_without_mesh():
  x = jnp.ones((4, 8))
  assert sh.with_logical_constraint(x, ("batch", "embed")) is x
  with nn.logical_axis_rules(sh.DEFAULT_RULES):  # rules but no mesh
    assert sh.with_logical_constraint(x, ("batch", "embed")) is x


def test_single_device_mesh_shard_tree():
  """The same calls work on a 1-device mesh (one CPU, one GPU)."""
  mesh = sh.make_mesh({}, devices=jax.devices()[:1])
  tree = {"w": np.ones((4, 6), np.float32)}
  out = sh.shard_tree(tree, {"w": ("embed", "mlp")}, mesh)
  assert out["w"].sharding.spec == P(None, "tensor")
  np.testing.assert_array_equal(out["w"], tree["w"])


# --- Child process: 8 virtual CPU devices ------------------------------------

_EMBED, _HEADS, _KV, _MLP, _EXPERTS, _VOCAB, _LAYERS = 8, 4, 1, 16, 4, 32, 3


class _Block(nn.Module):
  """One toy MoE-ish layer with logically partitioned params."""

  @nn.compact
  def __call__(self, x, _):
    init = nn.initializers.normal(0.1)
    wq = self.param("wq", nn.with_logical_partitioning(init, ("embed", "heads")), (_EMBED, _HEADS))
    # One KV head cannot be split over tensor=2: must be replicated.
    wkv = self.param(
      "wkv", nn.with_logical_partitioning(init, ("embed", "kv_heads")), (_EMBED, _KV)
    )
    experts = self.param(
      "experts",
      nn.with_logical_partitioning(init, ("expert", "embed", "mlp")),
      (_EXPERTS, _EMBED, _MLP),
    )
    h = jnp.einsum("ble,eh->blh", x, wq) + jnp.einsum("ble,ek->blk", x, wkv)
    h = sh.with_logical_constraint(h, ("batch", "length", "heads"))
    m = jnp.einsum("ble,xem->blm", x, experts)
    x = x + h.sum(-1, keepdims=True) * 0.1 + m.mean(-1, keepdims=True) * 0.1
    return sh.with_logical_constraint(x, ("batch", "length", "embed")), None


class _Toy(nn.Module):
  @nn.compact
  def __call__(self, tokens):
    emb = self.param(
      "embedding",
      nn.with_logical_partitioning(nn.initializers.normal(1.0), ("vocab", "embed")),
      (_VOCAB, _EMBED),
    )
    x = emb[tokens]
    stack = nn.scan(
      _Block,
      variable_axes={"params": 0},
      split_rngs={"params": True},
      length=_LAYERS,
      metadata_params={nn.PARTITION_NAME: "layers"},
    )
    x, _ = stack(name="layers")(x, None)
    return x @ emb.T


def _toy_init():
  model = _Toy()
  tokens = jnp.arange(4 * 6, dtype=jnp.int32).reshape(4, 6) % _VOCAB
  variables = model.init(jax.random.key(0), tokens)
  return model, tokens, variables


def _device_check_mesh_construction():
  assert jax.device_count() == 8, jax.devices()
  mesh = sh.make_mesh(_SIZES)
  assert mesh.axis_names == ("data", "expert", "tensor")
  assert dict(mesh.shape) == _SIZES
  assert sorted(d.id for d in mesh.devices.flat) == list(range(8))
  assert dict(sh.make_mesh({"data": -1, "tensor": 2}).shape) == {
    "data": 4,
    "expert": 1,
    "tensor": 2,
  }
  assert dict(sh.make_mesh(_MeshConfig(expert=8)).shape)["expert"] == 8
  try:
    sh.make_mesh({"data": 4})
  except ValueError as e:
    assert "needs 4 devices but 8" in str(e), e
  else:
    raise AssertionError("make_mesh accepted 4 axes for 8 devices")
  try:
    sh.make_mesh({"data": -1, "tensor": 3})
  except ValueError as e:
    assert "not divisible" in str(e), e
  else:
    raise AssertionError("make_mesh filled an indivisible axis")


def _device_check_scan_logical_specs():
  _, _, variables = _toy_init()
  specs = sh.logical_specs(variables)["params"]
  assert specs["embedding"] == P("vocab", "embed"), specs["embedding"]
  layers = specs["layers"]
  assert layers["wq"] == P("layers", "embed", "heads"), layers["wq"]
  assert layers["experts"] == P("layers", "expert", "embed", "mlp")
  assert meta.unbox(variables)["params"]["layers"]["wq"].shape == (_LAYERS, _EMBED, _HEADS)


def _device_check_shard_tree_placement():
  _, _, variables = _toy_init()
  mesh = sh.make_mesh(_SIZES)
  params = sh.shard_tree(variables, None, mesh)["params"]
  want = {
    "embedding": (P("tensor", None), (_VOCAB // 2, _EMBED)),
    "wq": (P(None, None, "tensor"), (_LAYERS, _EMBED, _HEADS // 2)),
    "wkv": (P(None, None, None), (_LAYERS, _EMBED, _KV)),
    "experts": (P(None, "expert", None, "tensor"), (_LAYERS, _EXPERTS // 2, _EMBED, _MLP // 2)),
  }
  got = {"embedding": params["embedding"], **params["layers"]}
  for name, (spec, shard_shape) in want.items():
    arr = got[name]
    assert isinstance(arr, jax.Array), (name, type(arr))
    assert arr.sharding.spec == spec, (name, arr.sharding.spec)
    assert len(arr.sharding.device_set) == 8, name
    assert arr.addressable_shards[0].data.shape == shard_shape, (
      name,
      arr.addressable_shards[0].data.shape,
    )
  np.testing.assert_array_equal(
    np.asarray(got["wq"]), np.asarray(meta.unbox(variables)["params"]["layers"]["wq"])
  )
  # Explicit tuple-of-names logical trees work too.
  out = sh.shard_tree(
    {"c": np.zeros((4, 6, 2, 8), np.float32)},
    {"c": ("batch", "length", "kv_heads", "head_dim")},
    mesh,
  )
  assert out["c"].sharding.spec == P("data", None, "tensor", None)


def _device_check_logical_to_sharding_tree():
  _, _, variables = _toy_init()
  mesh = sh.make_mesh(_SIZES)
  specs = sh.logical_specs(variables)
  by_name = sh.logical_to_sharding(specs, mesh)
  by_shape = sh.shardings_for(variables, None, mesh)
  a = jax.tree_util.tree_leaves(by_name)
  b = jax.tree_util.tree_leaves(by_shape)
  assert all(isinstance(s, jax.sharding.NamedSharding) for s in a + b)
  # Names alone shard wkv's kv_heads; with shapes (1 head) it is replicated.
  assert by_name["params"]["layers"]["wkv"].spec == P(None, None, "tensor")
  assert by_shape["params"]["layers"]["wkv"].spec == P(None, None, None)
  assert by_name["params"]["layers"]["wq"] == by_shape["params"]["layers"]["wq"]


def _device_check_jit_init_and_apply():
  model, tokens, variables = _toy_init()
  mesh = sh.make_mesh(_SIZES)
  abstract = jax.eval_shape(model.init, jax.random.key(0), tokens)
  shardings = sh.shardings_for(abstract, None, mesh)
  # Initialise directly into the sharded layout (no full copy on one device).
  init = jax.jit(lambda r, t: meta.unbox(model.init(r, t)), out_shardings=shardings)
  params = init(jax.random.key(0), tokens)
  assert params["params"]["layers"]["experts"].sharding.spec == P(None, "expert", None, "tensor")
  want = model.apply(meta.unbox(variables), tokens)
  with sh.use_mesh(mesh):
    batch = sh.shard_tree(tokens, ("batch", "length"), mesh)
    got = jax.jit(model.apply)(params, batch)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


def _device_check_activation_constraint():
  mesh = sh.make_mesh(_SIZES)
  f = jax.jit(lambda x: sh.with_logical_constraint(x * 2, ("batch", "length", "heads")))
  x = jnp.ones((4, 3, 8))
  with sh.use_mesh(mesh):
    y = f(x)
    assert y.sharding.spec == P("data", None, "tensor"), y.sharding
    # Indivisible batch (3) stays replicated instead of failing.
    z = f(jnp.ones((3, 3, 8)))
    assert z.sharding.spec == P(None, None, "tensor"), z.sharding
  # Outside the context the helper is the identity.
  assert sh.with_logical_constraint(x, ("batch", None, "heads")) is x


def _child_main() -> None:
  """Runs every device check and prints one JSON verdict per check."""
  results = {}
  for name, fn in sorted(globals().items()):
    if name.startswith("_device_check_"):
      try:
        fn()
        results[name] = "ok"
      except Exception:  # pylint: disable=broad-except
        results[name] = traceback.format_exc()
  print("RESULTS:" + json.dumps(results))


_DEVICE_CHECKS = sorted(n for n in list(globals()) if n.startswith("_device_check_"))


@pytest.fixture(scope="module")
def device_results():
  env = dict(os.environ)
  env["XLA_FLAGS"] = (
    env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
  ).strip()
  env["JAX_PLATFORMS"] = "cpu"
  env["PYTHONPATH"] = os.pathsep.join(p for p in (_ROOT, env.get("PYTHONPATH")) if p)
  proc = subprocess.run(
    [sys.executable, os.path.abspath(__file__)],
    env=env,
    capture_output=True,
    text=True,
    timeout=600,
    check=False,
  )
  lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULTS:")]
  assert proc.returncode == 0 and lines, (
    f"device check process failed (rc={proc.returncode}):\n"
    f"{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
  )
  return json.loads(lines[-1][len("RESULTS:") :])


@pytest.mark.parametrize("check", _DEVICE_CHECKS)
def test_on_8_devices(device_results, check):
  assert check in device_results, f"{check} did not run"
  assert device_results[check] == "ok", device_results[check]


if __name__ == "__main__":
  _child_main()
