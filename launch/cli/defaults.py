"""What the launch scripts run when not told: the bundled target and its best measured method.

Shared by launch/generate.py, launch/serve.py and launch/load_test.py. It lives in launch/cli/,
not in a launch/*.py script, for the reason launch/cli/__init__.py gives: every launch/*.py is a
standalone binary that others cannot depend on.
"""

from __future__ import annotations

import sys
from typing import Any

from absl import flags

from jaxspec import sharding
from jaxspec.drafters import registry
from jaxspec.errors import ConfigError
from jaxspec.io import hf as hf_io
from jaxspec.models import target as target_lib
from jaxspec.speculative import engine as engine_lib
from jaxspec.speculative.engine_config import EngineConfig

# The fastest method measured on the bundled target (`launch/bench.py generate`, docs/benchmarks.md):
# (method, verify, tree budget).
# EAGLE-3 (γ = 4, chain) was the fastest at temperature 0 (1.14× plain decoding) and the fastest
# speculative method at temperature 1; budget 8 the fastest DDTree budget.
BUNDLED_BEST = ("eagle3", "chain", 0)
DEFAULT_TREE_BUDGET = 8

FLAGS = flags.FLAGS
MODEL_FLAGS = ("model", "method", "draft_model", "verify", "tree_budget", "gamma", "mesh")


def define_model_flags() -> None:
  """Defines the scripts' shared model and method flags (once): --model, --method,
  --draft_model, --verify, --tree_budget, --gamma, --mesh; `engine_from_flags` and
  `mesh_from_flags` read them."""
  if "method" in FLAGS:
    return
  flags.DEFINE_string(
    "model",
    None,
    "HF model directory, GGUF file or hub id (org/name; org/name/file.gguf) (default: the "
    "bundled target).",
  )
  flags.DEFINE_enum(
    "method",
    "auto",
    ("auto",) + registry.METHODS,
    "Drafting method; auto = the best one available for the model.",
  )
  flags.DEFINE_string(
    "draft_model",
    None,
    "Drafter checkpoint directory: a draft model, DFlash, EAGLE-3 or a Gemma 4 assistant "
    "(default: the bundled one of the method).",
  )
  flags.DEFINE_enum("verify", "auto", ("auto", "chain", "tree"), "Chain or DDTree verification.")
  flags.DEFINE_integer("tree_budget", 0, "Draft nodes per tree (0 = the measured default).")
  flags.DEFINE_integer(
    "gamma",
    None,
    "Draft tokens per step (default: the method's own: 4 for chains; DFlash: block_size - 1).",
    lower_bound=1,
  )
  flags.DEFINE_string(
    "mesh",
    "data=1,expert=1,tensor=1",
    f"Device mesh of the engine ({sharding.MESH_FORM}; -1 fills an axis). On CPU, "
    "XLA_FLAGS=--xla_force_host_platform_device_count=N gives N virtual devices.",
  )
  for name in MODEL_FLAGS:  # listed by the script's --help, as its own flags are
    FLAGS.register_key_flag_for_module(sys.argv[0], FLAGS[name])


def _tiny_random() -> target_lib.TargetModel:
  import configs  # pylint: disable=import-outside-toplevel
  from jaxspec.config import ModelConfig  # pylint: disable=import-outside-toplevel
  from jaxspec.io.tokenizer import Tokenizer  # pylint: disable=import-outside-toplevel

  c = configs.get("tiny_random")
  cfg = ModelConfig(
    architecture=c.architecture,
    vocab_size=c.vocab_size,
    hidden_size=c.hidden_size,
    num_layers=c.num_layers,
    num_heads=c.num_heads,
    num_kv_heads=c.num_kv_heads,
    head_dim=c.head_dim,
    intermediate_size=c.intermediate_size,
    num_experts=c.num_experts,
    num_experts_per_tok=c.num_experts_per_tok,
    moe_intermediate_size=c.moe_intermediate_size,
    norm_topk_prob=c.norm_topk_prob,
    rope_theta=c.rope_theta,
    eos_token_ids=(c.eos_token_id,),
    pad_token_id=c.pad_token_id,
  )
  model = target_lib.TargetModel.random(cfg, seed=c.seed, tokenizer=Tokenizer.bundled())
  return model.with_scan_layers(False)


def load_target(model_dir: str | None) -> tuple[target_lib.TargetModel, str]:
  """(target, where it came from): `model_dir`, else the bundled target, else a tiny random
  model (configs/tiny_random.py) so the scripts always run; layers unstacked for decoding."""
  if model_dir:
    return hf_io.load_model(model_dir, scan_layers=False), model_dir
  bundled = registry.bundled_dir("target")
  if bundled:
    return hf_io.load_model(bundled, scan_layers=False), "bundled target"
  return _tiny_random(), "tiny random model (no bundled weights found)"


def choose_method(
  target: target_lib.TargetModel,
  model_dir_given: bool,
  method: str = "auto",
  verify: str = "auto",
  tree_budget: int = 0,
  draft_model: str | None = None,
) -> tuple[str, str | None, str, int]:
  """(method, drafter dir, verify, tree budget) from the scripts' flags.

  auto: on the bundled target, the fastest measured method (BUNDLED_BEST); on another model its
  own MTP layers when it has them, else the given drafter checkpoint's kind, else prompt
  lookup.
  """
  budget = tree_budget
  if method == "auto":
    best, best_verify, best_budget = BUNDLED_BEST
    asset = {"draft_model": "draft", "dflash": "dflash", "eagle3": "eagle3"}.get(best, "target")
    if not model_dir_given and registry.bundled_dir(asset):
      method = best
      verify = best_verify if verify == "auto" else verify
      budget = budget or best_budget
    elif target.config.num_mtp_layers > 0:
      method = "mtp"
    else:  # a given drafter checkpoint's own kind (draft model, DFlash, EAGLE-3, assistant)
      method = registry.checkpoint_kind(draft_model) if draft_model else "ngram"
  draft_dir = draft_model
  if draft_dir is None and not model_dir_given and method in ("draft_model", "dflash", "eagle3"):
    draft_dir = registry.bundled_dir("draft" if method == "draft_model" else method)
  verify = "chain" if verify == "auto" else verify
  return method, draft_dir, verify, budget or DEFAULT_TREE_BUDGET


def mesh_from_flags(always: bool = False) -> Any:
  """The --mesh device mesh, or None for a one-device run (`always`: build it even then, as a
  multi-process run needs a mesh over every process's devices)."""
  shape = sharding.parse_mesh(FLAGS.mesh, "--mesh")
  if not always and all(v == 1 for v in shape.values()):
    return None
  try:
    return sharding.make_mesh(shape)
  except ValueError as e:  # more or fewer devices than the mesh needs
    raise ConfigError(f"--mesh={FLAGS.mesh}: {e}") from None


def engine_from_flags(
  target: target_lib.TargetModel, *, mesh: Any = None, **config: Any
) -> tuple[engine_lib.SpecEngine, str, str]:
  """(engine, method, label) for the flags `define_model_flags` defined; `config` →
  EngineConfig (max_len, batch_size, ...); `mesh`: run on this device mesh (None: one device)."""
  method, draft_dir, verify, budget = choose_method(
    target,
    FLAGS.model is not None,
    FLAGS.method,
    FLAGS.verify,
    FLAGS.tree_budget,
    FLAGS.draft_model,
  )
  engine, label = make_engine(
    target,
    method,
    draft_dir=draft_dir,
    verify=verify,
    tree_budget=budget,
    gamma=FLAGS.gamma,
    mesh=mesh,
    **config,
  )
  return engine, method, label


def make_engine(
  target: target_lib.TargetModel,
  method: str,
  *,
  draft_dir: str | None,
  verify: str,
  tree_budget: int,
  gamma: int | None = None,
  mesh: Any = None,
  **config: Any,
) -> tuple[engine_lib.SpecEngine, str]:
  """(engine, a label for reports) for `choose_method`'s answer; `config` → EngineConfig;
  `mesh`: the engine's device mesh (None: one device)."""
  drafter = registry.make_drafter(method, target, gamma=gamma, draft_dir=draft_dir)
  tree = dict(verify="tree", tree_budget=tree_budget) if verify == "tree" and drafter else {}
  cfg = EngineConfig(method=method, **tree, **config)
  label = f"{method} + tree verification ({tree_budget} nodes)" if tree else method
  return engine_lib.SpecEngine(target, drafter, cfg, mesh=mesh), label
