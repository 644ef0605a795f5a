"""jaxspec's own small models, trained on the Python standard library source.

Two models share the bundled 8192-id BPE tokenizer:

* ``target``: a ``Glm4MoeForCausalLM`` (4 layers, width 128, one dense first layer then
  routed experts — 8 per layer, top-2, sigmoid routing with a correction bias — plus a shared
  expert) with one MTP layer trained jointly (loss = main + 0.3 × MTP).
* ``draft``: a ``Qwen3ForCausalLM`` (2 layers, width 64) with 6.5× fewer active
  non-embedding parameters: the drafter of classic speculative sampling.

Both are shipped in HF layout under ``jaxspec/assets/{target,draft}/``; ``export_dir`` points
there and ``launch/train_target.py`` writes it after training. ``test_target`` and
``test_draft`` are miniature versions for unit tests (a few seconds per run).

Usage: ``python -m launch.train_target --config=configs/tiny_code.py:target``.
"""

from __future__ import annotations

import importlib.util
import os

import ml_collections

ARGS = ("target", "draft", "test_target", "test_draft")


def assets_dir(name: str) -> str:
  """jaxspec/assets/<name>, found without importing jaxspec (and hence jax)."""
  spec = importlib.util.find_spec("jaxspec")
  if spec is None or not spec.submodule_search_locations:
    raise ImportError("jaxspec is not importable")
  return os.path.join(list(spec.submodule_search_locations)[0], "assets", name)


def _special(model: ml_collections.ConfigDict) -> None:
  # The bundled tokenizer: <|endoftext|>=0, <|pad|>=1, <|mask|>=2.
  model.vocab_size = 8192
  model.eos_token_ids = (0,)
  model.pad_token_id = 1
  model.dtype = "float32"
  model.param_dtype = "float32"


def target_model() -> ml_collections.ConfigDict:
  """The GLM-4.5-style MoE target with one MTP layer."""
  m = ml_collections.ConfigDict()
  m.architecture = "Glm4MoeForCausalLM"
  _special(m)
  m.hidden_size = 128
  m.num_layers = 4
  m.num_heads = 4
  m.num_kv_heads = 2
  m.head_dim = 32
  m.partial_rotary_factor = 0.5  # GLM rotates half of each head
  m.rope_theta = 10000.0
  m.qk_norm = False
  m.intermediate_size = 384  # the dense first layer
  m.num_experts = 8
  m.num_experts_per_tok = 2
  m.moe_intermediate_size = 64  # fine-grained experts, DeepSeek style
  m.n_shared_experts = 2  # one always-on MLP of width 2 x 64
  m.router = "sigmoid"
  m.norm_topk_prob = True
  m.routed_scaling_factor = 1.0
  m.layer_is_moe = (False,) + (True,) * 3  # first_k_dense_replace = 1
  m.num_mtp_layers = 1
  m.tie_word_embeddings = True
  m.max_position_embeddings = 4096
  # On CPU the dense oracle (all experts, masked combine) trains faster than ragged_dot here;
  # the numbers are identical. Inference loads use the library default.
  m.moe_backend = "dense"
  return m


def draft_model() -> ml_collections.ConfigDict:
  """The Qwen3 dense draft model."""
  m = ml_collections.ConfigDict()
  m.architecture = "Qwen3ForCausalLM"
  _special(m)
  m.hidden_size = 64
  m.num_layers = 2
  m.num_heads = 2
  m.num_kv_heads = 1
  m.head_dim = 32
  m.intermediate_size = 192
  m.rope_theta = 10000.0
  m.qk_norm = True
  m.tie_word_embeddings = True
  m.max_position_embeddings = 4096
  return m


def train_config(**overrides) -> ml_collections.ConfigDict:
  """Training hyper-parameters (fields of jaxspec.train.trainer.TrainConfig)."""
  t = ml_collections.ConfigDict()
  t.seq_len = 256
  t.batch_size = 16
  t.num_epochs = 2.0
  t.num_steps = 0
  t.schedule_steps = 0
  t.learning_rate = 2e-3
  t.final_lr_fraction = 0.1
  t.warmup_steps = 200
  t.weight_decay = 0.1
  t.b1 = 0.9
  t.b2 = 0.95
  t.grad_clip = 1.0
  t.optimizer = "adamw"
  t.muon_learning_rate = 0.02
  t.mtp_weight = 0.3
  t.aux_loss_weight = 0.0
  t.bias_update_rate = 1e-3
  t.seed = 0
  t.data_seed = 0
  t.checkpoint_every = 100
  t.keep_checkpoints = 2
  t.eval_every = 0
  t.eval_batches = 0
  t.patience = 2
  t.log_every = 10
  t.corpus_root = ""
  t.step_delay_s = 0.0
  t.update(overrides)
  return t


def get_config(arg: str = "target") -> ml_collections.ConfigDict:
  """Returns the named setup: "target", "draft", "test_target" or "test_draft"."""
  if arg not in ARGS:
    raise ValueError(f"unknown tiny_code config {arg!r}; expected one of {ARGS}")
  config = ml_collections.ConfigDict()
  config.name = arg
  is_target = arg.endswith("target")
  config.model = target_model() if is_target else draft_model()
  if is_target:
    # Half-epoch evaluations: 688 batches of 16 x 256 per epoch of the 3.11 stdlib.
    # 1.5 epochs (1032 steps, 4.2M tokens), evaluated every half epoch. On 2 CPU cores
    # shared with other jobs this ran at ~400-1600 tokens/s. (The shipped run did its first
    # 344 steps under a 516-step schedule, then was extended: see docs/training.md.)
    config.train = train_config(num_epochs=1.5, eval_every=344)
  else:
    config.train = train_config(num_epochs=2.0, learning_rate=3e-3)
  config.workdir = f"/tmp/jaxspec_runs/tiny_code_{arg}"
  config.export_dir = assets_dir("target" if is_target else "draft")
  # Stored as trained (float32: ~10 MB + ~2.7 MB); "bfloat16" halves the bytes while
  # config.json keeps float32 as the compute dtype.
  config.export_dtype = "float32"
  config.assets = ml_collections.ConfigDict(
    {"target": assets_dir("target"), "draft": assets_dir("draft")}
  )
  if arg.startswith("test_"):
    m = config.model
    m.hidden_size, m.num_heads, m.num_kv_heads, m.head_dim = 32, 2, 1, 16
    m.intermediate_size = 64
    if is_target:
      m.num_layers, m.num_experts, m.moe_intermediate_size = 2, 4, 16
      m.layer_is_moe = (False, True)
    config.train = train_config(
      seq_len=32,
      batch_size=4,
      num_steps=12,
      warmup_steps=2,
      learning_rate=1e-2,
      checkpoint_every=4,
      eval_every=6,
      eval_batches=2,
      log_every=2,
      patience=0,
    )
    config.export_dir = ""
  return config
