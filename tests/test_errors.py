"""One error hierarchy, and engine settings that used to hang (issue 12, first part)."""

from __future__ import annotations

import pytest

import jaxspec
from jaxspec.config import ModelConfig


@pytest.mark.parametrize(
  "error", [jaxspec.ConfigError, jaxspec.InputError, jaxspec.CheckpointError]
)
def test_every_user_error_is_a_jaxspec_error_and_a_value_error(error):
  assert issubclass(error, jaxspec.JaxspecError) and issubclass(error, ValueError)
  # The modules that raise them re-export the same classes.
  from jaxspec.config import ConfigError  # pylint: disable=import-outside-toplevel
  from jaxspec.io.hf import CheckpointError  # pylint: disable=import-outside-toplevel
  from jaxspec.models.target import InputError  # pylint: disable=import-outside-toplevel

  assert (ConfigError, InputError, CheckpointError) == (
    jaxspec.ConfigError,
    jaxspec.InputError,
    jaxspec.CheckpointError,
  )


@pytest.mark.parametrize(
  "field, value",
  [
    ("min_prompt_bucket", 0),  # the bucket loop doubled 0 forever: generate never returned
    ("min_prompt_bucket", -4),
    ("stream_every", 0),  # stream() yielded empty lists forever
    ("stream_every", -1),
    ("max_len", 1),
    ("max_len", 512.0),  # not silently truncated
    ("batch_size", 0),
    ("batch_size", True),
  ],
)
def test_engine_settings_that_would_hang_or_coerce_are_refused(field, value):
  with pytest.raises(jaxspec.ConfigError, match=rf"EngineConfig: {field} must be an integer"):
    jaxspec.EngineConfig(**{field: value})


def test_tree_settings_are_checked_only_for_trees():
  jaxspec.EngineConfig(tree_budget=0)  # chain verification ignores the tree fields
  with pytest.raises(jaxspec.ConfigError, match="tree_budget must be an integer ≥ 1, got 0"):
    jaxspec.EngineConfig(verify="tree", tree_budget=0)
  with pytest.raises(jaxspec.ConfigError, match="tree_topk"):
    jaxspec.EngineConfig(verify="tree", tree_topk=-1)


def test_engine_errors_are_catchable_as_jaxspec_errors():
  cfg = ModelConfig(
    architecture="Qwen3ForCausalLM",
    vocab_size=16,
    hidden_size=16,
    num_layers=1,
    num_heads=2,
    num_kv_heads=1,
    head_dim=8,
    intermediate_size=16,
  )
  target = jaxspec.TargetModel.random(cfg)
  with pytest.raises(jaxspec.JaxspecError, match="per-position distributions"):
    jaxspec.SpecEngine(target, None, jaxspec.EngineConfig(verify="tree"))
  with pytest.raises(jaxspec.JaxspecError, match="at most 8 stop ids"):
    jaxspec.SpecEngine(target, None, jaxspec.EngineConfig(stop_ids=tuple(range(9))))
  engine = jaxspec.SpecEngine(target, None, jaxspec.EngineConfig(max_len=8))
  with pytest.raises(jaxspec.JaxspecError, match="outside the vocabulary"):
    engine.generate([[1, 99]], max_new_tokens=2)
  with pytest.raises(jaxspec.JaxspecError, match="more than max_len=8"):
    engine.generate([[1, 2, 3]], max_new_tokens=8)
