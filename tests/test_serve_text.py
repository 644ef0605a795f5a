"""Tests for jaxspec/serve/text.py: incremental detokenizing, stop strings, chat templates."""

from __future__ import annotations

import json

import pytest
import tokenizers

from jaxspec.errors import CheckpointError, InputError
from jaxspec.io.tokenizer import Tokenizer
from jaxspec.serve import text

MULTIBYTE = "héllo wörld € 日本語 ok"


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
  return Tokenizer.bundled()


def test_detokenizer_emits_only_complete_characters(tok):
  ids = tok.encode(MULTIBYTE)
  assert any(tok.decode([i]) == text.REPLACEMENT for i in ids)  # the case under test occurs
  d = text.Detokenizer(tok)
  pieces = [d.add(i) for i in ids]
  assert all(text.REPLACEMENT not in p for p in pieces)
  assert "".join(pieces) + d.flush() == MULTIBYTE


def test_detokenizer_round_trips_code(tok):
  prompt = tok.encode("def f(x):")
  ids = tok.encode("\n  return x + 1\n")
  d = text.Detokenizer(tok, prompt)
  assert "".join(d.add(i) for i in ids) + d.flush() == tok.decode(ids)


def test_detokenizer_decodes_the_first_token_after_the_prompt():
  """SentencePiece-style decoders drop a sequence's leading space: "▁world" alone decodes to
  "world", but after the prompt's "▁hello" it is " world"."""
  backend = tokenizers.Tokenizer(
    tokenizers.models.WordLevel({"▁hello": 0, "▁world": 1, "<unk>": 2}, unk_token="<unk>")
  )
  backend.pre_tokenizer = tokenizers.pre_tokenizers.Metaspace()
  backend.decoder = tokenizers.decoders.Metaspace()
  meta = Tokenizer(backend)
  assert meta.decode([1]) == "world"
  d = text.Detokenizer(meta, prompt_ids=[0])
  assert d.add(1) + d.add(1) + d.flush() == " world world"


def test_detokenizer_flush_shows_an_unfinished_character(tok):
  ids = tok.encode("€")
  d = text.Detokenizer(tok)
  assert d.add(ids[0]) == ""
  assert d.flush() == text.REPLACEMENT


def test_stop_matcher_cuts_at_the_stop_string():
  m = text.StopMatcher(["STOP"])
  assert m.feed("abc ST") == "abc "  # "ST" might start the stop string: held back
  assert m.feed("OP and more") == ""
  assert m.matched == "STOP"
  assert m.feed("later") == ""


def test_stop_matcher_releases_a_false_start():
  m = text.StopMatcher(["STOP"])
  assert m.feed("x ST") == "x "
  assert m.feed("AY") == "STAY"
  assert m.feed("S") == ""
  assert m.flush() == "S"
  assert m.matched is None


def test_stop_matcher_earliest_of_several():
  m = text.StopMatcher(["world", "lo w"])
  assert m.feed("hello world") == "hel"
  assert m.matched == "lo w"


def test_stop_matcher_refuses_empty():
  with pytest.raises(InputError, match="non-empty"):
    text.StopMatcher([""])


def test_text_stream_aligns_tokens_logprobs_and_offsets(tok):
  ids = tok.encode(MULTIBYTE)
  lps = [-0.1 * (i + 1) for i in range(len(ids))]
  s = text.TextStream(tok, [], logprobs=True)
  out = [s.add(ids[i : i + 3], lps[i : i + 3]) for i in range(0, len(ids), 3)] + [s.finish()]
  assert "".join(p.text for p in out) == MULTIBYTE
  got_ids = [t for p in out for t in p.token_ids]
  assert got_ids == ids
  assert [x for p in out for x in p.logprobs] == lps
  # A token starts where the complete text before it ends.
  offsets = [o for p in out for o in p.offsets]
  assert offsets == [len(tok.decode(ids[:k]).rstrip(text.REPLACEMENT)) for k in range(len(ids))]
  assert s.completion_tokens == len(ids)


def test_text_stream_stop_string_drops_later_tokens(tok):
  ids = tok.encode("x = 1\nSTOP\ny = 2\n")
  s = text.TextStream(tok, [], ["STOP"])
  piece = s.add(ids)
  assert piece.stopped and piece.text == "x = 1\n"
  assert tok.decode(piece.token_ids).startswith("x = 1\n")
  assert "STOP" not in tok.decode(piece.token_ids)  # tokens from the stop string on are dropped
  assert s.completion_tokens == len(piece.token_ids) < len(ids)
  assert s.add(tok.encode("more")).token_ids == []


def test_text_stream_holds_tokens_with_held_text(tok):
  ids = tok.encode("x") + tok.encode("a")
  s = text.TextStream(tok, [], ["ab"])
  first = s.add(ids)
  assert first.text == "x" and first.token_ids == ids[:1]  # "a" might start "ab"
  rest = s.finish()
  assert rest.text == "a" and not rest.stopped
  assert rest.token_ids == ids[1:]


def test_default_chat_template():
  t = text.ChatTemplate()
  out = t.render([{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}])
  assert out == "system: be brief\nuser: hi\nassistant:"


def test_checkpoint_chat_template_is_used(tmp_path):
  template = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
  )
  cfg = {"chat_template": template, "bos_token": {"content": "<s>"}}
  (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
  out = text.load_chat_template(str(tmp_path)).render([{"role": "user", "content": "hi"}])
  assert out == "<s><|user|>hi<|assistant|>"


def test_bundled_model_has_no_template_so_the_default_is_used():
  from jaxspec.drafters import registry  # pylint: disable=import-outside-toplevel

  t = text.load_chat_template(registry.bundled_dir("target"))
  assert t.source == text.DEFAULT_CHAT_TEMPLATE


def test_chat_template_is_sandboxed():
  evil = "{{ messages.__class__.__mro__[1].__subclasses__() }}"
  with pytest.raises(InputError, match="template"):
    text.ChatTemplate(evil).render([{"role": "user", "content": "x"}])


def test_chat_template_raise_exception_is_a_400():
  t = text.ChatTemplate("{{ raise_exception('no system role') }}")
  with pytest.raises(InputError, match="no system role"):
    t.render([{"role": "user", "content": "x"}])


def test_bad_template_is_a_checkpoint_error(tmp_path):
  (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{% for %}"}))
  with pytest.raises(CheckpointError, match="does not parse"):
    text.load_chat_template(str(tmp_path))


def test_token_bytes_are_exact_for_partial_characters(tok):
  ids = tok.encode(MULTIBYTE)
  assert bytes(b for i in ids for b in text.token_bytes(tok, i)).decode() == MULTIBYTE
