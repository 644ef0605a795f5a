"""Prose passages from text already on this machine, for building chat prompts offline.

`passages(sources)` reads, cleans and chunks the documentation this machine carries, with no
network. Each source is optional: one that is absent here yields nothing.

* "stdlib": module, class and function docstrings of the standard library (`ast`, so nothing is
  imported), over the files `data.corpus_files` lists (tests and idlelib left out).
* "topics": the language reference as `pydoc_data/topics.py` ships it (what `help("with")`
  shows), cut into chunks at section headings.
* "packages": installed distributions' long descriptions (their READMEs, in METADATA).
* "man": English manual pages of sections 1, 5, 7 and 8 (`/usr/share/man`, roff, gzip), their
  NAME line and DESCRIPTION section.

Cleaning keeps prose only: doctest sessions, literal and code blocks, reST and Markdown markup,
links, URLs, tables and special-token strings (`<|...|>`) are removed, whitespace is collapsed
(paragraphs are separated by a blank line, list items keep their own line), and paragraphs that
are mostly not words are dropped. Every passage carries a `key` naming the file, topic, package
or page it came from: the unit the train / held-out split is drawn on (`split_key`).
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import gzip
import hashlib
import importlib.metadata
import os
import re
from collections.abc import Iterator, Sequence

from jaxspec.errors import ConfigError
from jaxspec.train import data as data_lib

SOURCES = ("stdlib", "topics", "packages", "man")
MAN_ROOT = "/usr/share/man"
MAN_SECTIONS = ("1", "5", "7", "8")
MAN_PER_FAMILY = 20
CHUNK_WORDS = 160  # most words per passage; an excerpt is cut from its start
MIN_WORDS = 8  # fewer words of prose than this and a text is not worth a request


@dataclasses.dataclass(frozen=True)
class Passage:
  """One piece of prose and what it documents.

  Attributes:
    source: one of SOURCES.
    key: the file, topic, package or page it comes from ("stdlib:json/decoder.py",
      "man:1/ls"); every passage of one key falls in the same split.
    kind: "module", "class", "function", "topic", "package", "command" or "manual".
    name: what it documents ("json.decoder.JSONDecoder", "ls", "The with statement").
    text: cleaned prose, paragraphs separated by a blank line.
    summary: its one-line gist (a docstring's first sentence, a page's NAME line), or "".
    signature: for functions, "name(args)"; "" otherwise.
  """

  source: str
  key: str
  kind: str
  name: str
  text: str
  summary: str = ""
  signature: str = ""


def split_key(key: str, val_fraction: float = data_lib.DEFAULT_VAL_FRACTION) -> str:
  """Returns "train" or "validation" for a passage key; stdlib keys use the code corpus's own split
  (`data.split_of` of the file), so held-out docstrings come from files no model trained on."""
  source, _, rest = key.partition(":")
  return data_lib.split_of(rest if source == "stdlib" else key, val_fraction)


# ---- cleaning ---------------------------------------------------------------------------

_SUBS = (
  (re.compile(r"<\|[^|]*\|>"), ""),  # special-token strings
  (re.compile(r"!\[[^\]]*\]\([^)]*\)"), ""),  # Markdown images and badges
  (re.compile(r"\[([^\]]+)\]\([^)]*\)"), r"\1"),  # Markdown links
  (re.compile(r"<!--.*?-->|</?[a-zA-Z][^>]*>"), ""),  # HTML comments and tags
  (re.compile(r":[\w:.+-]+:`[~!]?([^`<]*?)\s*(?:<[^>]*>)?`"), r"`\1`"),  # reST roles
  (re.compile(r"`([^`<]+?)\s*<[^>]*>`__?"), r"\1"),  # reST links with a target
  (re.compile(r"`([^`]+)`__?"), r"\1"),  # reST references
  (re.compile(r"``([^`]+)``"), r"`\1`"),  # reST literals
  (re.compile(r"(?<![\w*])\*\*?([^*\s][^*]*?)\*\*?(?![\w*])"), r"\1"),  # emphasis
  (re.compile(r"https?://\S+"), ""),
  (re.compile(r"::$"), ":"),
)
_UNDERLINE = re.compile(r"^\s*([=\-~^*#+\"'`])\1{2,}\s*$")
_LIST_ITEM = re.compile(r"^\s*(?:[-*•+]|\d+[.)]|\([a-z0-9]\))\s")
_WORD = re.compile(r"^[(\"'`]*[A-Za-z][a-z'’-]*[.,;:!?)\"'`]*$")


def _inline(line: str) -> str:
  for pattern, repl in _SUBS:
    line = pattern.sub(repl, line)
  return " ".join(line.split())


def _is_prose(paragraph: str) -> bool:
  words = paragraph.split()
  return len(words) >= 4 and sum(bool(_WORD.match(w)) for w in words) >= 0.6 * len(words)


def clean(text: str) -> list[str]:
  """Prose paragraphs of a docstring, reST or Markdown text (see the module docstring).

  A paragraph is dropped when it is a doctest session, a Markdown code fence or table, a
  directive (`.. note::`), starts indented (a literal or code block), or is mostly not words.
  """
  paragraphs: list[list[str]] = [[]]
  in_fence = in_doctest = False
  for raw in text.expandtabs().splitlines():
    line = raw.rstrip()
    if line.lstrip().startswith(("```", "~~~")):
      in_fence = not in_fence
      continue
    if in_fence:
      continue
    if line.lstrip().startswith(">>>"):
      in_doctest = True
    if not line.strip():
      in_doctest = False
      paragraphs.append([])
      continue
    if in_doctest or line.lstrip().startswith(("|", ".. ", "+--", "+==")):
      continue
    if _UNDERLINE.match(line):  # the title above it stands alone
      title = paragraphs[-1].pop() if paragraphs[-1] else None
      paragraphs.extend([[title] if title else [], []])
      continue
    paragraphs[-1].append(line)
  out = []
  for lines in paragraphs:
    if not lines or lines[0].startswith(" "):
      continue
    heading = re.match(r"^#+\s+(.*)", lines[0])
    if heading:
      lines = [heading.group(1)] + lines[1:]
    joined: list[str] = []
    for line in lines:
      if joined and not _LIST_ITEM.match(line):
        joined[-1] += " " + line.strip()
      else:
        joined.append(line.strip())
    para = "\n".join(_inline(x) for x in joined if _inline(x))
    if _is_prose(para):
      out.append(para)
  return out


def chunks(paragraphs: Sequence[str], max_words: int = CHUNK_WORDS) -> list[str]:
  """Consecutive paragraphs grouped into texts of at most ~max_words words."""
  out: list[list[str]] = []
  size = 0
  for p in paragraphs:
    n = len(p.split())
    if not out or size + n > max_words:
      out.append([])
      size = 0
    out[-1].append(p)
    size += n
  return ["\n\n".join(c) for c in out if c]


def first_sentence(text: str) -> str:
  """The text up to its first full stop (its first line when it has none)."""
  line = text.strip().split("\n\n", 1)[0].replace("\n", " ")
  m = re.search(r"^(.+?[.!?])(\s|$)", line)
  return (m.group(1) if m else line).strip()


def _passage(
  source: str,
  key: str,
  kind: str,
  name: str,
  paragraphs: list[str],
  summary: str = "",
  signature: str = "",
) -> Passage | None:
  """The first chunk of `paragraphs` as a passage, or None when it is too short."""
  text = chunks(paragraphs)[0] if paragraphs else ""
  if len(text.split()) < MIN_WORDS:
    return None
  return Passage(source, key, kind, name, text, summary or first_sentence(text), signature)


# ---- the sources ------------------------------------------------------------------------


def _signature(node: ast.FunctionDef | ast.AsyncFunctionDef) -> str:
  """Returns "name(args)" without self / cls; "" when longer than a line's worth."""
  args = node.args
  first = (args.posonlyargs or args.args or [None])[0]
  if first is not None and first.arg in ("self", "cls"):  # never has a default
    args = ast.arguments(
      posonlyargs=args.posonlyargs[1:],
      args=args.args[1:] if not args.posonlyargs else args.args,
      vararg=args.vararg,
      kwonlyargs=args.kwonlyargs,
      kw_defaults=args.kw_defaults,
      kwarg=args.kwarg,
      defaults=args.defaults,
    )
  sig = f"{node.name}({ast.unparse(args)})"
  return sig if len(sig) <= 80 else ""


def _stdlib(root: str | None) -> Iterator[Passage]:
  root = root or data_lib.stdlib_root()
  for rel in data_lib.corpus_files(data_lib.ALL, root):
    module = rel[:-3].replace("/", ".").removesuffix(".__init__")
    if any(part.startswith("_") for part in module.split(".")):
      continue
    with open(os.path.join(root, rel), encoding="utf-8", errors="replace") as fh:
      try:
        tree = ast.parse(fh.read())
      except (SyntaxError, ValueError):
        continue
    key = f"stdlib:{rel}"
    todo: list[tuple[ast.AST, str]] = [(tree, module)]
    while todo:
      node, name = todo.pop(0)
      doc = ast.get_docstring(node, clean=True)
      if isinstance(node, ast.Module):
        kind, sig = "module", ""
      elif isinstance(node, ast.ClassDef):
        kind, sig = "class", ""
      else:
        kind, sig = "function", _signature(node)
      if doc:
        found = _passage("stdlib", key, kind, name, clean(doc), signature=sig)
        if found:
          yield found
      if kind != "function":
        for child in node.body:
          defines = isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
          if defines and not child.name.startswith("_"):
            todo.append((child, f"{name}.{child.name}"))


def _topics() -> Iterator[Passage]:
  try:
    from pydoc_data import topics  # pylint: disable=import-outside-toplevel
  except ImportError:
    return
  for topic in sorted(topics.topics):
    raw = topics.topics[topic]
    lines = raw.lstrip().splitlines()
    titled = len(lines) > 1 and _UNDERLINE.match(lines[1])
    title = _inline(lines[0]) if titled else topic.replace("-", " ")
    paragraphs = clean(raw)
    if paragraphs and paragraphs[0] == title:
      paragraphs = paragraphs[1:]
    for text in chunks(paragraphs):
      if len(text.split()) >= MIN_WORDS:
        yield Passage("topics", f"topics:{topic}", "topic", title, text, first_sentence(text))


def _packages() -> Iterator[Passage]:
  seen = set()
  dists = [(d.metadata["Name"] or "", d) for d in importlib.metadata.distributions()]
  for name, dist in sorted(dists, key=lambda x: x[0].lower()):
    if not name or name.lower() in seen:
      continue
    seen.add(name.lower())
    meta = dist.metadata
    body = meta.get_payload() or meta.get("Description") or ""
    if not isinstance(body, str):
      continue
    found = _passage(
      "packages",
      f"packages:{name.lower()}",
      "package",
      name,
      clean(body),
      summary=" ".join((meta.get("Summary") or "").split()),
    )
    if found:
      yield found


_ROFF_ESCAPES = (
  (re.compile(r"\\f(?:\[[^\]]*\]|\(..|.)"), ""),  # font changes
  (re.compile(r"\\\((?:em|en)"), " - "),
  (re.compile(r"\\\((?:aq|cq|oq)"), "'"),
  (re.compile(r"\\\((?:lq|rq|dq)"), '"'),
  (re.compile(r"\\\(..|\\\[[^\]]*\]|\\\*(?:\(..|\[[^\]]*\]|.)|\\s[+-]?\d"), ""),
  (re.compile(r"\\-"), "-"),
  (re.compile(r"\\e"), "\\\\"),
  (re.compile(r"\\ "), " "),
  (re.compile(r"\\[&,/:%|^)]"), ""),
)


def _roff_line(line: str) -> str:
  for pattern, repl in _ROFF_ESCAPES:
    line = pattern.sub(repl, line)
  return line


def man_text(source: str) -> tuple[str, list[str]]:
  """(NAME line, DESCRIPTION paragraphs) of a man(7) page; ("", []) for mdoc or redirects."""
  if re.search(r"^\.(Dd|Sh|so)\b", source, re.MULTILINE):
    return "", []
  sections: dict[str, list[list[str]]] = {}
  current: list[list[str]] | None = None
  for line in source.splitlines():
    if line.startswith(('.\\"', "'\\\"", '.\\"')):
      continue
    if line.startswith((".SH", ".SS")):
      title = _roff_line(line[3:]).strip().strip('"').upper()
      current = sections.setdefault(title, [[]]) if line.startswith(".SH") else current
      if current is not None:
        current.append([])
      continue
    if current is None:
      continue
    m = re.match(r"^[.'](\w+)\s*(.*)$", line)
    if m:
      macro, args = m.groups()
      if macro in ("B", "I", "BR", "IR", "RB", "RI", "BI", "IB", "SM", "SB"):
        current[-1].append(" ".join(a or b for a, b in re.findall(r'"([^"]*)"|(\S+)', args)))
      elif macro in ("PP", "P", "LP", "TP", "IP", "HP", "sp", "br"):
        current.append([])
      continue
    current[-1].append(line)
  name = " ".join(_roff_line(" ".join(x for p in sections.get("NAME", []) for x in p)).split())
  paragraphs = []
  for lines in sections.get("DESCRIPTION", []):
    para = _inline(_roff_line(" ".join(lines)))
    if _is_prose(para):
      paragraphs.append(para)
  return name, paragraphs


def _man_files(root: str) -> list[tuple[str, str]]:
  """(section, file) of the pages read: at most MAN_PER_FAMILY per family (the name up to its
  first "_", "-" or "."), so one tool's thousands of subcommand pages do not swamp the rest;
  which ones is fixed by a hash of the name."""
  families: dict[str, list[tuple[str, str, str]]] = {}
  for section in MAN_SECTIONS:
    folder = os.path.join(root, f"man{section}")
    if not os.path.isdir(folder):
      continue
    for fname in os.listdir(folder):
      if fname.endswith(".gz") and not os.path.islink(os.path.join(folder, fname)):
        rank = hashlib.sha256(fname.encode()).hexdigest()
        families.setdefault(re.split(r"[_.-]", fname)[0], []).append((rank, section, fname))
  chosen = [x[1:] for fam in families.values() for x in sorted(fam)[:MAN_PER_FAMILY]]
  return sorted(chosen)


def _man(root: str = MAN_ROOT) -> Iterator[Passage]:
  for section, fname in _man_files(root):
    try:
      with gzip.open(os.path.join(root, f"man{section}", fname), "rt", errors="replace") as fh:
        name_line, paragraphs = man_text(fh.read())
    except (OSError, EOFError):
      continue
    page = fname[: -len(".gz")].rsplit(".", 1)[0]
    summary = name_line.split(" - ", 1)[-1] if " - " in name_line else ""
    kind = "command" if section in ("1", "8") else "manual"
    found = _passage("man", f"man:{section}/{page}", kind, page, paragraphs, summary=summary)
    if found:
      yield found


def passages(
  sources: Sequence[str] = SOURCES, stdlib_root: str | None = None
) -> tuple[Passage, ...]:
  """Every passage of `sources`, in a fixed order (cached: reading them takes seconds)."""
  return _passages(tuple(sources), stdlib_root)


@functools.lru_cache(maxsize=4)
def _passages(sources: tuple[str, ...], stdlib_root: str | None) -> tuple[Passage, ...]:
  """The passages of `sources`; a text met again (a copied docstring, a page installed twice)
  is kept the first time only."""
  unknown = [s for s in sources if s not in SOURCES]
  if unknown:
    raise ConfigError(f"unknown text source(s) {unknown}; expected some of {SOURCES}")
  readers = {
    "stdlib": lambda: _stdlib(stdlib_root),
    "topics": _topics,
    "packages": _packages,
    "man": _man,
  }
  seen: set[str] = set()
  out = []
  for p in (p for s in sources for p in readers[s]()):
    if p.text not in seen:  # a text copied between files must not sit on both sides of the split
      seen.add(p.text)
      out.append(p)
  return tuple(out)
