"""jaxspec's own small models, trained on the Python standard library source.

Three models share the bundled 8192-id BPE tokenizer:

* ``target``: a ``Glm4MoeForCausalLM`` (4 layers, width 128, one dense first layer then
  routed experts — 8 per layer, top-2, sigmoid routing with a correction bias — plus a shared
  expert) with one MTP layer trained jointly (loss = main + 0.3 × MTP).
* ``draft``: a ``Qwen3ForCausalLM`` (2 layers, width 64) with 6.5× fewer active
  non-embedding parameters: the drafter of classic speculative sampling.
* ``hybrid``: a ``Qwen3_5MoeForCausalLM`` of the target's width and experts with 3 Gated
  DeltaNet layers and 1 full-attention layer, and Qwen3.5's MTP module (issue 17).

All are shipped in HF layout under ``jaxspec/assets/{target,draft,hybrid}/``; ``export_dir``
points there and ``launch/train_target.py`` writes it after training. ``test_target``,
``test_draft`` and ``test_hybrid`` are miniature versions for unit tests (seconds per run).

Feature-conditioned drafters are trained against the targets by self-distillation
(``launch/train_drafter.py``) and shipped in their published layouts:

* ``dflash``: a DFlash block-diffusion drafter (3 layers, block 16) reading target layers 1-3,
  each block slot trained half on the sampled token and half on the target's distribution;
* ``eagle3``: an EAGLE-3 head (one layer over fused layers 0-2, a 2048-token draft vocabulary);
* ``hybrid_dflash``: a 2-layer DFlash drafter against the hybrid target (layers 1-3).

``test_dflash`` / ``test_eagle3`` are miniature drafter runs for unit tests.

Usage: ``python -m launch.train_target --config=configs/tiny_code.py:target``,
``python -m launch.train_drafter --config=configs/tiny_code.py:dflash``.
"""

from __future__ import annotations

import importlib.util
import os

import ml_collections

MODEL_ARGS = ("target", "draft", "hybrid", "test_target", "test_draft", "test_hybrid")
DRAFTER_ARGS = ("dflash", "eagle3", "hybrid_dflash", "test_dflash", "test_eagle3")
ARGS = MODEL_ARGS + DRAFTER_ARGS


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
  # How to run it (jaxspec.RunOptions): training's scanned layout, float32 throughout.
  model.options = ml_collections.ConfigDict(
    {"dtype": "float32", "param_dtype": "float32", "scan_layers": True}
  )


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
  m.options.moe_backend = "dense"
  return m


def hybrid_model() -> ml_collections.ConfigDict:
  """The Qwen3.5-MoE-style hybrid target: 3 Gated DeltaNet layers, then 1 full-attention layer.

  Width, heads, experts and vocabulary match the GLM target so that the two compare at equal
  size; the hybrid-specific parts follow Qwen3.5: zero-centred RMSNorms, gated attention output,
  a quarter of each head rotated, a softmax router over 8 experts (top-2) and a sigmoid-gated
  shared expert, and one MTP module (a full-attention MoE layer over fc([norm(e); norm(h)])).
  """
  m = ml_collections.ConfigDict()
  m.architecture = "Qwen3_5MoeForCausalLM"
  _special(m)
  m.hidden_size = 128
  m.num_layers = 4
  m.layer_types = ("linear_attention",) * 3 + ("full_attention",)
  m.num_heads = 4
  m.num_kv_heads = 2
  m.head_dim = 32
  m.partial_rotary_factor = 0.25
  m.rope_theta = 10000.0
  m.linear_conv_kernel_dim = 4
  m.linear_num_key_heads = 2
  m.linear_num_value_heads = 4
  m.linear_key_head_dim = 32
  m.linear_value_head_dim = 32
  m.intermediate_size = 384  # unused: every layer routes (Qwen3.5-MoE has no dense layers)
  m.num_experts = 8
  m.num_experts_per_tok = 2
  m.moe_intermediate_size = 64
  m.shared_expert_intermediate_size = 128
  m.router = "softmax"
  m.norm_topk_prob = True
  m.layer_is_moe = (True,) * 4
  m.num_mtp_layers = 1
  m.tie_word_embeddings = True
  m.max_position_embeddings = 4096
  m.options.moe_backend = "dense"
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


def distill_config(**overrides) -> ml_collections.ConfigDict:
  """Self-distillation data (fields of jaxspec.train.distill.DistillConfig)."""
  d = ml_collections.ConfigDict()
  d.split = "train"
  d.num_prompts = 4096  # of the 12.9K function openings of the train split
  d.max_prompt_tokens = 64
  d.new_tokens = 192
  d.temperatures = (0.0, 1.0)  # one greedy and one sampled continuation per prompt
  d.batch_size = 128
  d.seed = 0
  d.corpus_root = ""
  d.update(overrides)
  return d


def drafter_train_config(**overrides) -> ml_collections.ConfigDict:
  """Drafter hyper-parameters (fields of jaxspec.train.drafter_trainer.DrafterTrainConfig)."""
  t = ml_collections.ConfigDict()
  t.batch_size = 16
  t.num_epochs = 2.0
  t.num_steps = 0
  t.learning_rate = 1e-3
  t.muon_learning_rate = 0.02
  t.optimizer = "muon"
  t.warmup_steps = 50
  t.final_lr_fraction = 0.1
  t.weight_decay = 0.0
  t.b1 = 0.9
  t.b2 = 0.95
  t.grad_clip = 1.0
  t.num_anchors = 32
  t.loss_decay = 7.0
  t.soft_label_weight = 0.0  # DFlash: weight of the soft CE against the target's distribution
  t.ttt_steps = 7
  t.ttt_decay = 0.8
  t.seed = 0
  t.data_seed = 0
  t.checkpoint_every = 100
  t.keep_checkpoints = 2
  t.eval_every = 0
  t.eval_batches = 0
  t.patience = 0
  t.log_every = 10
  t.step_delay_s = 0.0
  t.update(overrides)
  return t


def drafter_config(arg: str) -> ml_collections.ConfigDict:
  """A drafter run: architecture, distillation data, training, target and export paths."""
  name = arg.replace("test_", "")
  method = name.replace("hybrid_", "")
  hybrid = name != method  # a drafter of the hybrid target
  config = ml_collections.ConfigDict()
  config.name = arg
  config.method = method
  config.target_dir = assets_dir("hybrid" if hybrid else "target")
  d = ml_collections.ConfigDict()
  # Taps (layer outputs, HF hidden_states[id + 1]; docs/drafters.md): the published spreads
  # degenerate on 4 layers (DFlash's [1, L-3] gives (1, 1), EAGLE-3's (1, L//2-1, L-4) gives
  # (1, 1, 0)). DFlash reads layers 1-3, the last one final-normed as HF reports it (what the
  # LM head reads); EAGLE-3 reads layers 0-2 (the inputs of layers 1-3), low/mid/high inside
  # the stack, where SpecForge, SGLang and HF agree on what each id means. The hybrid target's
  # DFlash reads the same ids: the outputs of its Gated DeltaNet layers 1 and 2 (what the
  # recurrent state has folded in) and of its full-attention layer 3, final-normed.
  d.target_layer_ids = (1, 2, 3) if method == "dflash" else (0, 1, 2)
  d.num_heads = 4
  d.num_kv_heads = 2
  d.head_dim = 32
  d.intermediate_size = 384
  d.seed = 0
  if method == "dflash":
    # The GLM target's drafter grew from 2 to 3 layers (issue 13: the 2-layer one had
    # plateaued); the hybrid's is still the 2-layer one.
    d.num_layers = 2 if hybrid else 3
    d.block_size = 16
  else:
    d.draft_vocab_size = 2048  # the most frequent tokens of the target's continuations
  config.drafter = d
  config.distill = distill_config()
  config.val_distill = distill_config(split="validation", num_prompts=128)
  config.distill_dir = f"/tmp/jaxspec_runs/tiny_code_{'hybrid_' if hybrid else ''}distill"
  # DFlash: 2 epochs (1024 steps); EAGLE-3: 1 epoch (its 7-step unroll costs more per batch).
  config.train = drafter_train_config(num_epochs=2.0 if method == "dflash" else 1.0)
  if method == "dflash" and not hybrid:
    # Half of each slot's loss on the target's own distribution (docs/drafters.md, issue 13).
    config.train.soft_label_weight = 0.5
  config.workdir = f"/tmp/jaxspec_runs/tiny_code_{arg}"
  # A drafter directory to continue from (same architecture), or "" to start fresh. Pass it to
  # --export_only too: EAGLE-3's draft vocabulary (d2t) comes from it, not from the checkpoint.
  config.init_from = ""
  config.export_dir = assets_dir(name)
  if arg.startswith("test_"):
    d.num_heads, d.num_kv_heads, d.head_dim, d.intermediate_size = 2, 1, 16, 64
    d.target_layer_ids = (0, 1, 1) if method == "eagle3" else (0, 1)
    if method == "dflash":
      d.num_layers, d.block_size = 1, 4
    else:
      d.draft_vocab_size = 512
    config.distill = distill_config(
      num_prompts=16, max_prompt_tokens=16, new_tokens=16, batch_size=16
    )
    config.val_distill = distill_config(
      split="validation", num_prompts=8, max_prompt_tokens=16, new_tokens=16, batch_size=8
    )
    config.distill_dir = ""  # <workdir>/distill
    config.train = drafter_train_config(
      batch_size=4,
      num_steps=12,
      warmup_steps=2,
      learning_rate=1e-2,
      muon_learning_rate=0.1,
      num_anchors=8,
      ttt_steps=3,
      soft_label_weight=0.5 if method == "dflash" else 0.0,
      checkpoint_every=4,
      eval_every=6,
      log_every=2,
    )
    config.export_dir = ""
  return config


def get_config(arg: str = "target") -> ml_collections.ConfigDict:
  """Returns the named setup: one of ARGS (models, drafters and their test miniatures)."""
  if arg not in ARGS:
    raise ValueError(f"unknown tiny_code config {arg!r}; expected one of {ARGS}")
  if arg in DRAFTER_ARGS:
    return drafter_config(arg)
  config = ml_collections.ConfigDict()
  config.name = arg
  kind = arg.replace("test_", "")
  config.model = {"target": target_model, "hybrid": hybrid_model, "draft": draft_model}[kind]()
  if kind == "target":
    # Half-epoch evaluations: 688 batches of 16 x 256 per epoch of the 3.11 stdlib.
    # 3.5 epochs (2408 steps, 9.9M tokens), evaluated every half epoch; ~2,900 tokens/s on an
    # idle 2-core machine. (The shipped run was extended twice on a shared machine, with warm
    # restarts of the schedule: see docs/training.md for the exact commands.)
    config.train = train_config(num_epochs=3.5, eval_every=344)
  elif kind == "hybrid":
    # Softmax router without a correction bias: Qwen3.5's switch-style auxiliary loss balances it.
    config.train = train_config(num_epochs=2.0, eval_every=344, aux_loss_weight=0.01)
  else:
    config.train = train_config(num_epochs=2.0, learning_rate=3e-3)
  config.workdir = f"/tmp/jaxspec_runs/tiny_code_{arg}"
  config.export_dir = assets_dir(kind)
  # Stored as trained (float32: ~10 MB + ~2.7 MB); "bfloat16" halves the bytes while
  # config.json keeps float32 as the compute dtype.
  config.export_dtype = "float32"
  config.assets = ml_collections.ConfigDict(
    {name: assets_dir(name) for name in ("target", "draft", "dflash", "eagle3", "hybrid")}
  )
  if arg.startswith("test_"):
    m = config.model
    m.hidden_size, m.num_heads, m.num_kv_heads, m.head_dim = 32, 2, 1, 16
    m.intermediate_size = 64
    if kind == "target":
      m.num_layers, m.num_experts, m.moe_intermediate_size = 2, 4, 16
      m.layer_is_moe = (False, True)
    elif kind == "hybrid":
      m.num_layers, m.num_experts, m.moe_intermediate_size = 2, 4, 16
      m.layer_types, m.layer_is_moe = ("linear_attention", "full_attention"), (True, True)
      m.linear_num_key_heads, m.linear_num_value_heads = 1, 2
      m.linear_key_head_dim = m.linear_value_head_dim = 16
      m.shared_expert_intermediate_size = 32
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
