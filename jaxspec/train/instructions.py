"""A chat instruction mix built offline from local text, for self-distilling drafters of chat
models.

A drafter learns the target's answers to prompts, so the prompts should look like what the
target will be asked. This module writes chat requests (lists of {"role", "content"}
messages) around the prose passages of `local_text` (stdlib docstrings, the language reference
topics, installed packages' READMEs, man pages) with 23 templates written for the purpose:
explain, summarize, simplify, bullet points, title, plain English, what problem it solves,
implement a function from its docstring, examples, steps, compare, "what is X for" questions
built from names alone, quiz, key terms, docstring writing, proofreading; two of them carry a
system message and two are two-turn (user, assistant, user), so the mix is not one shape.

* Split: a passage's train / held-out ("validation") side is drawn from its source key
  (`local_text.split_key`: the file, topic, package or page), so held-out prompts come from
  text the drafter never saw. Compared names (`compare`) come from the same side.
* Sampling: `n` requests spread evenly over the templates (a template with too few passages
  gives its share to the others; no passage repeats within a template), chosen and ordered by
  `seed` alone: the same seed gives the same list on a machine with the same text.
* Length: an excerpt is the start of a passage cut to a word budget, ending at a sentence end
  where one is near; `encode_requests` re-cuts it until the rendered chat fits
  `max_prompt_tokens` (the chat template is never cut) and drops a request that cannot fit.
"""

from __future__ import annotations

import dataclasses
import hashlib
import re
from collections.abc import Sequence
from typing import Any

import numpy as np

from jaxspec.errors import ConfigError
from jaxspec.serve import text as text_lib
from jaxspec.train import data as data_lib
from jaxspec.train import local_text
from jaxspec.train.local_text import Passage

DEFAULT_WORDS = 120  # excerpt budget before token-level trimming
_ANY = frozenset(("module", "class", "function", "topic", "package", "command", "manual"))
_NOUN = {
  "module": "the Python module",
  "class": "the Python class",
  "function": "the Python function",
  "topic": "the Python language reference",
  "package": "the Python package",
  "command": "the command",
  "manual": "the manual page",
}


@dataclasses.dataclass(frozen=True)
class Template:
  """One kind of request: its messages, with {text} {name} {summary} {signature} {other}
  {noun} filled in from a passage, and the passage kinds it suits."""

  kind: str
  turns: tuple[tuple[str, str], ...]
  accepts: frozenset[str] = _ANY
  needs: tuple[str, ...] = ()  # Passage fields that must be non-empty

  @property
  def uses_text(self) -> bool:
    return any("{text}" in content for _, content in self.turns)

  def suits(self, p: Passage) -> bool:
    return p.kind in self.accepts and all(getattr(p, f) for f in self.needs)


def _user(content: str) -> tuple[tuple[str, str], ...]:
  return (("user", content),)


TEMPLATES = (
  Template("explain", _user("Explain the following text in your own words.\n\n{text}")),
  Template("summarize", _user("Summarize this in two or three sentences:\n\n{text}")),
  Template(
    "simplify", _user("Rewrite this so that someone new to programming can follow it:\n\n{text}")
  ),
  Template(
    "bullets", _user("Turn the following into a short bulleted list of its main points.\n\n{text}")
  ),
  Template("title", _user("Suggest a short, descriptive title for this passage.\n\n{text}")),
  Template(
    "plain_english",
    _user("Translate this technical description of `{name}` into plain English:\n\n{text}"),
    frozenset(("function", "class", "command", "manual")),
  ),
  Template(
    "problem",
    _user("Read the text below, then answer: what problem does it solve, and for whom?\n\n{text}"),
  ),
  Template(
    "implement",
    _user("Write a Python function `{signature}` that does the following: {summary}"),
    frozenset(("function",)),
    ("signature", "summary"),
  ),
  Template(
    "examples",
    _user("Give two short examples of how `{name}` could be used. Its documentation:\n\n{text}"),
    frozenset(("function", "class", "command", "package")),
  ),
  Template(
    "steps",
    _user("Based on this documentation, list the steps someone would follow to use it.\n\n{text}"),
    frozenset(("package", "command", "manual", "topic")),
  ),
  Template(
    "compare",
    _user(
      "Compare `{name}` with `{other}`: what is each for, and when would you choose one over "
      "the other? Here is what the documentation says about `{name}`:\n\n{text}"
    ),
    frozenset(("module", "class", "package", "command")),
  ),
  Template(
    "module_use", _user("What is the Python module `{name}` used for?"), frozenset(("module",))
  ),
  Template(
    "command_use",
    _user("What does the `{name}` command do on Linux, and how is it typically run?"),
    frozenset(("command",)),
  ),
  Template(
    "package_use",
    _user("What is the Python package `{name}` for, and when would I install it?"),
    frozenset(("package",)),
  ),
  Template(
    "language",
    _user('In Python, what is meant by "{name}"? Please answer briefly, with an example.'),
    frozenset(("topic",)),
  ),
  Template("quiz", _user("Write three quiz questions, with answers, about this text:\n\n{text}")),
  Template(
    "key_terms",
    _user("List the most important terms in this passage and define each in one line.\n\n{text}"),
  ),
  Template(
    "docstring",
    _user("Write a clear docstring for a Python function `{signature}`. It should say: {summary}"),
    frozenset(("function",)),
    ("signature", "summary"),
  ),
  Template(
    "proofread",
    _user("Proofread this: point out anything unclear and suggest better wording.\n\n{text}"),
  ),
  Template(
    "concise",
    (
      ("system", "You are a concise technical writer. Answer in at most three sentences."),
      ("user", "What does this part of the documentation of {noun} `{name}` describe?\n\n{text}"),
    ),
  ),
  Template(
    "teacher",
    (
      ("system", "You are a patient teacher who explains programming with everyday analogies."),
      ("user", "Help me understand this:\n\n{text}"),
    ),
  ),
  Template(
    "follow_up",
    (
      (
        "user",
        "Here is part of the documentation of {noun} `{name}`:\n\n{text}\n\nWhat is it about?",
      ),
      ("assistant", "{summary}"),
      ("user", "Can you give me an example of when I would use it?"),
    ),
    needs=("summary",),
  ),
  Template(
    "simpler_again",
    (
      ("system", "You are a helpful assistant."),
      ("user", "Summarize this:\n\n{text}"),
      ("assistant", "{summary}"),
      ("user", "Now explain it as if I were twelve years old."),
    ),
    needs=("summary",),
  ),
)
_BY_KIND = {t.kind: t for t in TEMPLATES}


def excerpt(text: str, max_words: int) -> str:
  """The start of `text`, at most `max_words` words, ending at a sentence end when one lies in
  the second half of the cut; paragraph breaks and list lines are kept."""
  pieces = re.split(r"(\s+)", text.strip())
  if len(pieces[0::2]) <= max_words:
    return text.strip()
  if max_words < 1:
    return ""
  cut = "".join(pieces[: 2 * max_words - 1])
  ends = [m.end() for m in re.finditer(r"[.!?][)\"'`]*(?=\s|$)", cut)]
  if ends and ends[-1] >= len(cut) // 2:
    return cut[: ends[-1]]
  return cut.rstrip(",;") + " …"


@dataclasses.dataclass(frozen=True)
class Instruction:
  """One chat request: a template applied to a passage (and, for `compare`, another name)."""

  template: str
  passage: Passage
  other: str = ""

  def messages(self, max_words: int = DEFAULT_WORDS) -> list[dict[str, str]]:
    """The request's messages, its excerpt and summary cut to `max_words` words."""
    p = self.passage
    fields = {
      "text": excerpt(p.text, max_words),
      "name": p.name,
      "summary": excerpt(p.summary, max_words),
      "signature": p.signature,
      "other": self.other,
      "noun": _NOUN[p.kind],
    }
    return [
      {"role": role, "content": content.format(**fields)}
      for role, content in _BY_KIND[self.template].turns
    ]


def _quotas(n: int, sizes: Sequence[int], order: Sequence[int]) -> list[int]:
  """n spread evenly over templates (in `order` for the remainder), none above its size."""
  quotas = [0] * len(sizes)
  while n > 0:
    room = [i for i in order if quotas[i] < sizes[i]]
    if not room:
      break
    share, extra = divmod(n, len(room))
    for rank, i in enumerate(room):
      give = min(share + (rank < extra), sizes[i] - quotas[i])
      quotas[i] += give
      n -= give
  return quotas


def instruction_requests(
  split: str = data_lib.TRAIN,
  n: int | None = None,
  seed: int = 0,
  *,
  sources: Sequence[str] = local_text.SOURCES,
  stdlib_root: str | None = None,
  val_fraction: float = data_lib.DEFAULT_VAL_FRACTION,
) -> list[Instruction]:
  """`n` requests over the passages of one split (None: one per passage of the split).

  Args:
    split: "train" or "validation" (the held-out side).
    n: how many; fewer when the split's passages run out.
    seed: which passages, which compared names and the order (hash ranks: a larger `n` keeps
      the requests of a smaller one, and more text on the machine keeps most of them).
    sources: the `local_text` sources to draw from.
    stdlib_root: the standard library folder ("stdlib" source); None: the running one.
    val_fraction: share of source keys held out.
  """
  if split not in (data_lib.TRAIN, data_lib.VALIDATION):
    raise ConfigError(f"split must be {data_lib.TRAIN!r} or {data_lib.VALIDATION!r}, got {split!r}")
  if n is not None and n < 0:
    raise ConfigError(f"n must be >= 0 or None, got {n}")
  pool = [
    p
    for p in local_text.passages(sources, stdlib_root)
    if local_text.split_key(p.key, val_fraction) == split
  ]
  n = len(pool) if n is None else n
  names = {
    kind: sorted({p.name for p in pool if p.kind == kind}) for kind in _BY_KIND["compare"].accepts
  }
  eligible = [[p for p in pool if t.suits(p)] for t in TEMPLATES]
  rng = np.random.default_rng([seed, 0])
  quotas = _quotas(n, [len(e) for e in eligible], rng.permutation(len(TEMPLATES)))
  out = []
  for template, cands, quota in zip(TEMPLATES, eligible, quotas):
    # Each passage's rank is a hash of (seed, template, passage), not a draw over the pool: a
    # machine with more text (another installed package) adds passages between the others
    # instead of reshuffling all of them, and a larger n takes the same passages and more.
    ranked = sorted(cands, key=lambda p: _rank(seed, template.kind, p.key, p.name, p.text))
    for p in ranked[:quota]:
      other = ""
      if template.kind == "compare":
        choices = [c for c in names[p.kind] if c != p.name]
        if not choices:
          continue  # the only one of its kind
        other = min(choices, key=lambda c: _rank(seed, "other", p.key, p.name, c))
      out.append(Instruction(template.kind, p, other))
  return sorted(out, key=lambda r: _rank(seed, "order", r.template, r.passage.key, r.passage.name))


def _rank(*parts: Any) -> bytes:
  """A stable pseudo-random sort key of `parts` (the same on every machine and run)."""
  return hashlib.sha256("\x1f".join(map(str, parts)).encode()).digest()


def instruction_prompts(
  split: str = data_lib.TRAIN,
  n: int | None = None,
  seed: int = 0,
  *,
  max_words: int = DEFAULT_WORDS,
  **kwargs: Any,
) -> list[list[dict[str, str]]]:
  """The messages of `instruction_requests(split, n, seed, **kwargs)`, excerpts cut to
  `max_words` words."""
  return [r.messages(max_words) for r in instruction_requests(split, n, seed, **kwargs)]


def chat_template(tokenizer: Any) -> text_lib.ChatTemplate:
  """The tokenizer's own chat template; ConfigError when it has none (the instruction mix is
  for chat models: jaxspec's plain-text default template would not be what the model knows)."""
  template = text_lib.chat_template_of(tokenizer)
  if template.source == text_lib.DEFAULT_CHAT_TEMPLATE:
    where = getattr(tokenizer, "source", None) or type(tokenizer).__name__
    raise ConfigError(
      f"the tokenizer ({where}) has no chat template: instruction prompts need a chat model"
    )
  return template


def chat_stop_ids(tokenizer: Any, extra: Sequence[int] = ()) -> list[int]:
  """Ids that end a reply: the template's eos token (SmolLM2's <|im_end|>), the tokenizer's
  <|endoftext|>, and `extra` (say the model config's eos ids)."""
  ids = [*extra, tokenizer.eos_id]
  eos = getattr(tokenizer, "special_tokens", {}).get("eos_token")
  if eos:
    ids.append(tokenizer.token_to_id(eos))
  return sorted({int(i) for i in ids if i is not None})


def encode_requests(
  tokenizer: Any,
  requests: Sequence[Instruction],
  max_prompt_tokens: int,
  max_words: int = DEFAULT_WORDS,
) -> list[list[int]]:
  """Token ids of each request rendered with the tokenizer's chat template (ending with the
  assistant header), at most `max_prompt_tokens` long.

  A request that is too long is rendered again with a shorter excerpt, in proportion to its
  excess, until it fits; one that does not fit with `local_text.MIN_WORDS` words of excerpt
  (or has no excerpt to cut) is dropped. Returns the ids of the kept requests, in order.
  """
  template = chat_template(tokenizer)
  words = [min(max_words, len(r.passage.text.split())) for r in requests]
  ids: list[list[int] | None] = [None] * len(requests)
  todo = list(range(len(requests)))
  while todo:
    texts = [template.render(requests[i].messages(words[i])) for i in todo]
    retry = []
    for i, got in zip(todo, tokenizer.encode_batch(texts)):
      if len(got) <= max_prompt_tokens:
        ids[i] = got
      elif _BY_KIND[requests[i].template].uses_text and words[i] > local_text.MIN_WORDS:
        shorter = int(words[i] * max_prompt_tokens / len(got) * 0.95)
        words[i] = max(local_text.MIN_WORDS, min(words[i] - 1, shorter))
        retry.append(i)
    todo = retry
  return [x for x in ids if x is not None]


def distill_prompt_ids(
  tokenizer: Any, split: str, n: int | None, seed: int, max_prompt_tokens: int, **kwargs: Any
) -> list[list[int]]:
  """The encoded instruction mix `distill.build` continues (`DistillConfig.prompts`)."""
  requests = instruction_requests(split, n, seed, **kwargs)
  return encode_requests(tokenizer, requests, max_prompt_tokens)
