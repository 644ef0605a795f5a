"""The two layer layouts (ModelConfig.scan_layers): the same model, different weight buffers.

Scanned (`nn.scan` over stacked [n, ...] weights) and unrolled (one buffer per layer) must give
the same logits, taps and decoding state; convert exactly both ways; load, save and restore in
either; and the unrolled forward must not copy weights out of a stack, which is its reason to
exist (checked on the compiled program, not by timing).
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxspec
from jaxspec.io import checkpoint
from jaxspec.models import target as target_lib
from tests import drafter_models, engine_models


@pytest.fixture(scope="module")
def scanned() -> jaxspec.TargetModel:
  # GLM4-MoE with a dense first layer: two layer runs, one dense, one MoE.
  return engine_models.random_target()


def _equal_trees(a, b) -> bool:
  same = jax.tree_util.tree_map(lambda x, y: np.array_equal(np.asarray(x), np.asarray(y)), a, b)
  return jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b) and all(
    jax.tree_util.tree_leaves(same)
  )


def test_conversion_is_exact_both_ways(scanned):
  unrolled = scanned.with_scan_layers(False)
  assert not unrolled.config.options.scan_layers
  runs = [k for k in unrolled.params if k.startswith("layers_")]
  assert runs and all(
    set(unrolled.params[k]) == {str(j) for j in range(len(unrolled.params[k]))} for k in runs
  )
  layer0 = unrolled.params["layers_1"]["0"]
  stacked = scanned.params["layers_1"]
  assert jax.tree_util.tree_all(
    jax.tree_util.tree_map(lambda a, s: a.shape == s.shape[1:], layer0, stacked)
  )
  assert _equal_trees(unrolled.with_scan_layers(True).params, scanned.params)
  assert scanned.with_scan_layers(True) is scanned


def test_both_layouts_compute_the_same_forward_and_state(scanned):
  unrolled = scanned.with_scan_layers(False)
  prompt = jnp.asarray([[3, 14, 15, 92, 65, 35], [8, 9, 7, 9, 3, 2]], jnp.int32)
  outs = []
  for model in (scanned, unrolled):
    state = model.init_state(2, 16)
    first = target_lib.forward(model.config, model.params, prompt, None, state, taps=(0, 1))
    nxt = jnp.argmax(first.logits[:, -1:], axis=-1).astype(jnp.int32)
    start = jnp.full((2,), prompt.shape[1], jnp.int32)
    second = target_lib.forward(model.config, model.params, nxt, start, first.state, taps=(1,))
    outs.append((first.logits, first.taps, second.logits, second.taps, second.state))
  for a, b in zip(*outs):
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
      np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=2e-5, atol=2e-5)


def test_load_model_in_either_layout_and_files_are_the_same_either_way(scanned, tmp_path):
  jaxspec.save_hf(scanned, str(tmp_path / "scanned"))
  unrolled = jaxspec.load_model(str(tmp_path / "scanned"), scan_layers=False)
  assert not unrolled.config.options.scan_layers
  stacked = jaxspec.load_model(str(tmp_path / "scanned"), scan_layers=True)  # training's
  assert stacked.config.options.scan_layers and _equal_trees(stacked.params, scanned.params)
  # Decoding's layout unless asked, whatever the options say.
  default = jaxspec.load_model(str(tmp_path / "scanned"), options=jaxspec.RunOptions())
  assert not default.config.options.scan_layers
  assert _equal_trees(default.params, unrolled.params)
  assert _equal_trees(unrolled.with_scan_layers(True).params, scanned.params)
  # Saving from the unrolled layout writes the same tensors.
  jaxspec.save_hf(unrolled, str(tmp_path / "unrolled"))
  again = jaxspec.load_model(str(tmp_path / "unrolled"), scan_layers=True)
  assert _equal_trees(again.params, scanned.params)
  # orbax: one stacked layout on disk, restored in the layout asked for.
  checkpoint.save(unrolled, str(tmp_path / "orbax"))
  restored = checkpoint.restore(str(tmp_path / "orbax"), scan_layers=False)
  assert not restored.config.options.scan_layers
  assert _equal_trees(restored.with_scan_layers(True).params, scanned.params)
  assert checkpoint.restore(str(tmp_path / "orbax")).config.options.scan_layers


def _weight_slices(model: jaxspec.TargetModel) -> list[str]:
  """Instructions of the compiled one-token decode that slice a layer's weights out of a
  stack (a copy of the weight each step on XLA:CPU): dynamic slices at least as large as a
  dense MLP weight (the cache slices read here are smaller)."""
  c = model.config
  shapes = jax.eval_shape(lambda: model.params)
  state = jax.eval_shape(lambda: model.init_state(1, 32))
  ids = jax.ShapeDtypeStruct((1, 1), jnp.int32)
  start = jax.ShapeDtypeStruct((1,), jnp.int32)
  text = target_lib._forward.lower(c, shapes, ids, start, state).compile().as_text()
  big = c.hidden_size * c.intermediate_size
  found = []
  for line in text.splitlines():
    m = re.match(r"\s*(ROOT )?%(dynamic[-_]slice\S*) = f32\[([\d,]*)\]", line)
    if m and int(np.prod([int(d) for d in m.group(3).split(",") if d])) >= big:
      found.append(line.strip()[:120])
  return found


def test_the_unrolled_decode_reads_weights_in_place():
  scanned = drafter_models.small_target(num_layers=3)  # one run of three layers
  assert _weight_slices(scanned), "the scanned program no longer slices weights: test is stale"
  assert _weight_slices(scanned.with_scan_layers(False)) == []


def test_decoding_never_runs_on_the_scanned_layout(scanned):
  """`for_decoding` (what engines call on their target): the per-layer layout, re-laid out
  from the scanned one with a warning, or the model itself when already per layer."""
  with pytest.warns(UserWarning, match="re-lays the scanned"):
    unrolled = scanned.for_decoding()
  assert not unrolled.config.options.scan_layers
  assert _equal_trees(unrolled.params, scanned.with_scan_layers(False).params)
  assert unrolled.for_decoding() is unrolled
  assert unrolled.with_options(scan_layers=True).config == scanned.config
