"""The request boundary (issue 12): one validation of generate / stream / init_state arguments.

Every malformed request ends in a `jaxspec.JaxspecError` before any device work; equivalent
forms of one request generate the same tokens; user text is plain text unless asked otherwise;
drafters take exactly the γ they are given; a cache that cannot fit is refused up front.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect

import hypothesis
import hypothesis.strategies as st
import jax
import numpy as np
import pytest

import jaxspec
from jaxspec import plan
from jaxspec.drafters import registry
from jaxspec.speculative.request import Request, SamplingArgs
from jaxspec.state import DecodingState
from tests import drafter_models

pytestmark = pytest.mark.timeout(120)

MAX_LEN = 64
BATCH = 2


@functools.lru_cache(maxsize=None)
def bundled_target() -> jaxspec.TargetModel:
  return jaxspec.load_model(registry.bundled_dir("target"))


@functools.lru_cache(maxsize=None)
def engine() -> jaxspec.SpecEngine:
  """A plain-decoding engine on the bundled target (one compilation per prompt bucket)."""
  cfg = jaxspec.EngineConfig(max_len=MAX_LEN, batch_size=BATCH, use_eos=False)
  return jaxspec.SpecEngine(bundled_target(), None, cfg)


VOCAB = 8192  # the bundled target's (checked in test_bundled_vocabulary)


def test_bundled_vocabulary():
  assert bundled_target().config.vocab_size == VOCAB


# -- malformed requests ------------------------------------------------------------------------

BAD_REQUESTS = [
  # (arguments, message fragment)
  (dict(prompts=None), "prompts must be a str or a sequence"),
  (dict(prompts=17), "prompts must be a str or a sequence"),
  (dict(prompts=b"ab"), "prompts must be a str or a sequence"),
  (dict(prompts=[]), "no prompts"),
  (dict(prompts=[""]), "prompt 0 is empty"),
  (dict(prompts=[[]]), "prompt 0 is empty"),
  (dict(prompts=[1, 2, 3]), "flat sequence of 3 integers"),
  (dict(prompts=np.array([1, 2, 3])), "flat sequence of 3 integers"),
  (dict(prompts=[[268.7, 386.2]]), "token ids must be integers, got 268.7"),  # was truncated
  (dict(prompts=[["268", "386"]]), "not a list of str"),  # was taken as ids
  (dict(prompts=[[1, True]]), "token ids must be integers, got True"),
  (dict(prompts=[np.array([1.0, 2.0])]), "1-D integer token ids"),
  (dict(prompts=[np.array([[1, 2]])]), "1-D integer token ids"),
  (dict(prompts=np.zeros((1, 2, 2), np.int32)), "2-D integer token ids"),
  (dict(prompts=[[[1, 2]]]), "token ids must be integers"),
  (dict(prompts=[None]), "a prompt is a str or a 1-D sequence"),
  (dict(prompts=[[1, -2]]), "token ids must be ≥ 0"),
  (dict(prompts=[[1, 2**40]]), "token ids must be ≥ 0"),
  (dict(prompts=[[1, VOCAB]]), "outside the vocabulary"),
  (dict(prompts=["a", "b", "c"]), "got 3 prompts; this engine runs 1..2"),
  (dict(prompts=["a"], max_new_tokens=1.5), "max_new_tokens must be an integer ≥ 1, got 1.5"),
  (dict(prompts=["a"], max_new_tokens=0), "max_new_tokens must be an integer ≥ 1"),
  (dict(prompts=["a"], max_new_tokens=True), "max_new_tokens must be an integer"),
  (dict(prompts=["a"], max_new_tokens="4"), "max_new_tokens must be an integer"),
  (dict(prompts=["a"], max_new_tokens=[2, 2]), "max_new_tokens: got 2 values for 1 prompt"),
  (dict(prompts=["a"], max_new_tokens=MAX_LEN), "more than max_len"),
  (dict(prompts=["a"], temperature=[0.5, 0.5, 0.5]), "temperature: got 3 values for 1 prompt"),
  (dict(prompts=["a", "b"], temperature=[0.5]), "temperature: got 1 values for 2 prompts"),
  (dict(prompts=["a"], temperature=-0.1), "temperature must be a finite number ≥ 0"),
  (dict(prompts=["a"], temperature=float("nan")), "temperature must be a finite number"),
  (dict(prompts=["a"], temperature="hot"), "temperature must be a finite number"),
  (dict(prompts=["a"], temperature=np.zeros((1, 1))), "temperature: expected"),
  (dict(prompts=["a"], top_k=2.5), "top_k must be an integer ≥ 0"),
  (dict(prompts=["a"], top_k=-1), "top_k must be an integer ≥ 0"),
  (dict(prompts=["a"], top_p=0.0), "top_p must be a number in \\(0, 1\\]"),
  (dict(prompts=["a"], top_p=1.5), "top_p must be a number in \\(0, 1\\]"),
  # Positive, but 0 in float32 (found by tests/test_serve_fuzz.py: it stopped the scheduler).
  (dict(prompts=["a"], top_p=1e-320), "positive in float32"),
  (dict(prompts=["a"], seed=2**63), "seed must be an integer"),  # was OverflowError
  (dict(prompts=["a"], seed=1.5), "seed must be an integer"),
  (dict(prompts=["a"], seed=None), "seed must be an integer"),
  (dict(prompts=["a"], parse_special="yes"), "parse_special must be a bool"),
]


@pytest.mark.parametrize("call", ["generate", "stream", "init_state"])
@pytest.mark.parametrize("args, message", BAD_REQUESTS, ids=lambda x: str(x)[:40])
def test_malformed_requests_raise_input_error_before_any_work(call, args, message):
  args = dict(args)
  prompts = args.pop("prompts")
  with pytest.raises(jaxspec.InputError, match=message):
    getattr(engine(), call)(prompts, **args)


def test_a_single_string_is_one_prompt_not_its_characters():
  out = engine().generate("ab", max_new_tokens=3)  # was two prompts, "a" and "b"
  same = engine().generate(["ab"], max_new_tokens=3)
  assert len(out.tokens) == 1 and out.tokens == same.tokens


def test_per_prompt_values_apply_row_by_row():
  out = engine().generate(["def f(x):", "import os"], max_new_tokens=[2, 5])
  assert [len(t) for t in out.tokens] == [2, 5]


def test_engine_config_refuses_stop_ids_it_cannot_hold():
  with pytest.raises(jaxspec.ConfigError, match="stop_ids must be a tuple of token ids"):
    jaxspec.EngineConfig(stop_ids=(2**40,))  # was OverflowError inside generate
  with pytest.raises(jaxspec.ConfigError, match="stop_ids must be a tuple"):
    jaxspec.EngineConfig(stop_ids=[3])
  with pytest.raises(jaxspec.ConfigError, match="outside the vocabulary"):
    jaxspec.SpecEngine(bundled_target(), None, jaxspec.EngineConfig(stop_ids=(VOCAB,)))


# -- equivalent forms: the property ---------------------------------------------------------------

ids_strategy = st.lists(st.integers(3, VOCAB - 1), min_size=1, max_size=12)


def _as_form(ids: list[int], form: str):
  return {
    "list": list(ids),
    "tuple": tuple(ids),
    "np_int32": np.asarray(ids, np.int32),
    "np_int64": np.asarray(ids, np.int64),
    "np_scalars": [np.int64(t) for t in ids],
    "mixed": [np.int32(t) if i % 2 else int(t) for i, t in enumerate(ids)],
  }[form]


def _scalar_form(value, form: str, numpy_type):
  return {"scalar": value, "list": [value], "tuple": (value,), "numpy": numpy_type(value)}[form]


FORMS = ["list", "tuple", "np_int32", "np_int64", "np_scalars", "mixed"]
VALUE_FORMS = ["scalar", "list", "tuple", "numpy"]


@hypothesis.settings(max_examples=30, deadline=None, database=None, derandomize=True)
@hypothesis.given(
  ids=ids_strategy,
  form=st.sampled_from(FORMS),
  outer=st.sampled_from(["list", "tuple"]),
  new=st.integers(1, 6),
  new_form=st.sampled_from(VALUE_FORMS),
  temperature=st.sampled_from([0.0, 0.5, 1.0]),
  temp_form=st.sampled_from(VALUE_FORMS),
  top_k=st.integers(0, 20),
  seed=st.integers(0, 2**31),
)
def test_equivalent_forms_of_a_request_generate_identical_output(
  ids, form, outer, new, new_form, temperature, temp_form, top_k, seed
):
  canonical = engine().generate(
    [ids], max_new_tokens=new, temperature=temperature, top_k=top_k, seed=seed
  )
  prompts = [_as_form(ids, form)]
  other = engine().generate(
    prompts if outer == "list" else tuple(prompts),
    max_new_tokens=_scalar_form(new, new_form, np.int64),
    temperature=_scalar_form(temperature, temp_form, np.float32),
    top_k=_scalar_form(top_k, "numpy", np.int32),
    seed=np.int64(seed) if seed % 2 else seed,
  )
  assert other.tokens == canonical.tokens
  assert len(canonical.tokens[0]) == new


_junk_scalars = st.one_of(
  st.none(),
  st.booleans(),
  st.text(max_size=3),
  st.binary(max_size=3),
  st.floats(allow_nan=True, allow_infinity=True).filter(lambda x: not float(x).is_integer()),
  st.integers(max_value=-1),
  st.dictionaries(st.text(max_size=2), st.integers(), max_size=2),
)


@st.composite
def malformed_requests(draw):
  """A request with exactly one malformed argument (valid everywhere else)."""
  args = dict(prompts=[[5, 6, 7]], max_new_tokens=2)
  which = draw(
    st.sampled_from(
      [
        "prompts",
        "prompt",
        "token",
        "max_new_tokens",
        "temperature",
        "top_k",
        "top_p",
        "seed",
        "count",
      ]
    )
  )
  if which == "prompts":  # not a str or a sequence of prompts
    args["prompts"] = draw(
      st.one_of(
        st.none(),
        st.floats(),
        st.integers(),
        st.binary(),
        st.dictionaries(st.text(max_size=2), st.integers()),
      )
    )
  elif which == "prompt":  # a prompt that is neither a str nor a 1-D sequence of ints
    args["prompts"] = [
      draw(
        st.one_of(
          st.none(),
          st.floats(),
          st.integers(),
          st.binary(),
          st.lists(st.lists(st.integers(3, 9), min_size=1), min_size=1),
        )
      )
    ]
  elif which == "token":  # one bad id in an otherwise valid prompt
    bad = draw(
      st.one_of(
        _junk_scalars,
        st.integers(min_value=VOCAB),
        st.integers(max_value=-1),
        st.floats(3, 9).map(lambda x: x + 0.5),
      )
    )
    pos = draw(st.integers(0, 2))
    ids = [5, 6, 7]
    ids[pos] = bad
    args["prompts"] = [ids]
  elif which == "count":  # per-prompt values whose count is not the prompt count
    n = draw(st.sampled_from([0, 2, 3]))
    field = draw(st.sampled_from(["max_new_tokens", "temperature", "top_k", "top_p"]))
    value = {"max_new_tokens": 2, "temperature": 0.5, "top_k": 3, "top_p": 0.9}[field]
    args[field] = [value] * n
  elif which == "seed":
    args["seed"] = draw(
      st.one_of(
        st.none(),
        st.floats(),
        st.text(max_size=2),
        st.integers(min_value=2**63),
        st.integers(max_value=-(2**63) - 1),
      )
    )
  else:
    junk = {
      "max_new_tokens": st.one_of(_junk_scalars, st.just(0), st.integers(MAX_LEN, 2**70)),
      "temperature": st.one_of(
        st.none(),
        st.text(max_size=2),
        st.floats(max_value=-1e-6),
        st.just(float("nan")),
        st.just(float("inf")),
        st.booleans(),
      ),
      "top_k": _junk_scalars,
      "top_p": st.one_of(
        st.floats(max_value=0.0),
        st.floats(min_value=1.0001),
        st.just(float("nan")),
        st.none(),
        st.text(max_size=2),
      ),
    }[which]
    args[which] = draw(junk)
  return args


@hypothesis.settings(max_examples=80, deadline=None, database=None, derandomize=True)
@hypothesis.given(args=malformed_requests())
def test_anything_else_raises_jaxspec_error_and_nothing_else(args):
  args = dict(args)
  prompts = args.pop("prompts")
  with pytest.raises(jaxspec.JaxspecError):
    engine().generate(prompts, **args)


def test_the_property_fails_for_a_coercing_boundary(monkeypatch):
  """The property is not vacuous: a boundary that takes floats as ids (the old behaviour, which
  truncated them) must fail it."""
  from jaxspec.speculative import request  # pylint: disable=import-outside-toplevel

  exact = request._is_int
  monkeypatch.setattr(request, "_is_int", lambda x: isinstance(x, float) or exact(x))
  with pytest.raises(pytest.fail.Exception, match="DID NOT RAISE"):  # hypothesis' example
    test_anything_else_raises_jaxspec_error_and_nothing_else()


def test_one_sampling_args_type_is_the_keyword_arguments():
  """`SamplingArgs` is what generate, stream, prefill_row and Request take: given whole, by
  keyword (the public signature) or positionally, the same request."""
  args = SamplingArgs(3, 0.5, top_k=7, seed=11, stop_token_ids=[1])
  by_keyword = engine().generate(
    [[5, 6, 7]], max_new_tokens=3, temperature=0.5, top_k=7, seed=11, stop_token_ids=[1]
  )
  assert engine().generate([[5, 6, 7]], args).tokens == by_keyword.tokens
  assert engine().generate([[5, 6, 7]], 3, 0.5, 7, 1.0, 11, stop_token_ids=[1]).tokens == (
    by_keyword.tokens
  )
  replaced = engine().generate(
    [[5, 6, 7]], SamplingArgs(9, 0.5, top_k=7), seed=11, max_new_tokens=3, stop_token_ids=[1]
  )
  assert replaced.tokens == by_keyword.tokens
  assert Request.build([[5, 6, 7]], args) == Request.build(
    [[5, 6, 7]], max_new_tokens=3, temperature=0.5, top_k=7, seed=11, stop_token_ids=[1]
  )
  names = list(inspect.signature(jaxspec.SpecEngine.generate).parameters)
  assert names == ["self", "prompts", *(f.name for f in dataclasses.fields(SamplingArgs))]
  with pytest.raises(TypeError, match="generate"):
    engine().generate([[5, 6, 7]], max_new_token=3)


# -- special tokens are plain text by default --------------------------------------------------------


def test_typed_special_tokens_are_plain_text_unless_parsing_is_asked_for():
  tok = bundled_target().tokenizer
  mask, eos = tok.mask_id, tok.eos_id
  text = "x = <|mask|> + <|endoftext|>"
  state = engine().init_state([text], max_new_tokens=1)
  plain = np.asarray(state.tokens)[0, : int(state.prompt_len[0])].tolist()
  assert mask not in plain and eos not in plain
  assert tok.decode(plain) == text  # typed characters, all of them
  parsed_state = engine().init_state([text], max_new_tokens=1, parse_special=True)
  parsed = np.asarray(parsed_state.tokens)[0, : int(parsed_state.prompt_len[0])].tolist()
  assert mask in parsed and eos in parsed
  assert len(parsed) < len(plain)


# -- drafters take the γ they are given -----------------------------------------------------------


def test_dflash_gamma_is_honoured_bounded_by_the_trained_block_and_checked():
  target = bundled_target()
  dflash_dir = registry.bundled_dir("dflash")
  block = registry.load_drafter(dflash_dir, target).config.block_size
  assert registry.make_drafter("dflash", target, draft_dir=dflash_dir).gamma == block - 1
  assert registry.make_drafter("dflash", target, gamma=4, draft_dir=dflash_dir).gamma == 4
  assert registry.make_drafter("dflash", target, block_size=5, draft_dir=dflash_dir).gamma == 4
  with pytest.raises(jaxspec.ConfigError, match=f"more than {block - 1}"):
    registry.make_drafter("dflash", target, gamma=block, draft_dir=dflash_dir)
  with pytest.raises(jaxspec.ConfigError, match="block_size .* must be an integer ≥ 2, got 1"):
    registry.make_drafter("dflash", target, block_size=1, draft_dir=dflash_dir)  # was γ = 15
  with pytest.raises(jaxspec.ConfigError, match="disagree"):
    registry.make_drafter("dflash", target, gamma=3, block_size=8, draft_dir=dflash_dir)


@pytest.mark.parametrize("method", ["ngram", "eagle3", "draft_model", "dflash"])
@pytest.mark.parametrize("gamma", [0, -1, 2.0, True])
def test_a_gamma_that_is_not_a_positive_integer_is_refused(method, gamma):
  target = bundled_target()
  folder = {"eagle3": "eagle3", "draft_model": "draft", "dflash": "dflash"}.get(method)
  draft_dir = registry.bundled_dir(folder) if folder else None
  with pytest.raises(jaxspec.ConfigError, match="gamma"):  # gamma=0 was silently 4
    registry.make_drafter(method, target, gamma=gamma, draft_dir=draft_dir)


def test_a_shorter_dflash_block_still_decodes_losslessly():
  target = bundled_target()
  drafter = registry.make_drafter(
    "dflash", target, gamma=4, draft_dir=registry.bundled_dir("dflash")
  )
  cfg = jaxspec.EngineConfig(max_len=MAX_LEN, use_eos=False)
  spec = jaxspec.SpecEngine(target, drafter, cfg).generate(["def add(a, b):"], max_new_tokens=24)
  plain = engine().generate(["def add(a, b):"], max_new_tokens=24)
  assert spec.tokens == plain.tokens
  # Never more than γ + 1 = 5 tokens per target pass.
  assert spec.stats.tokens_generated <= 5 * spec.stats.target_passes


# -- memory is planned before it is allocated ----------------------------------------------------


@pytest.mark.parametrize("kv_format", ["float", "fp8"])
def test_the_plan_counts_exactly_what_the_state_allocates(kv_format):
  target = bundled_target()
  state = DecodingState.create(target.config, 2, 48, kv_format)
  actual = sum(x.nbytes for x in jax.tree_util.tree_leaves(state))
  assert plan.decoding_state_bytes(target.config, 2, 48, kv_format) == actual
  drafter = drafter_models.small_dflash(drafter_models.small_target(num_layers=3))
  dstate = drafter.init_state(drafter.params, 2, 48)
  assert plan.drafter_state_bytes(drafter, 2, 48) == sum(
    x.nbytes for x in jax.tree_util.tree_leaves(dstate)
  )


def test_a_cache_that_cannot_fit_is_refused_up_front_with_the_numbers():
  target = bundled_target()
  with pytest.raises(jaxspec.ConfigError, match=r"max_len=100000000.*GiB.*free"):
    jaxspec.SpecEngine(target, None, jaxspec.EngineConfig(max_len=10**8))  # was RESOURCE_EXHAUSTED
  fits = plan.engine_plan(target, None, 1, 256, "float")
  assert fits.free is not None and fits.state < fits.free
  # FP8 stores a quarter of float32's value bytes (plus one float32 scale per head vector).
  fp8 = plan.engine_plan(target, None, 1, 256, "fp8")
  assert fp8.target_state < fits.target_state / 2
  broken = plan.MemoryPlan(weights=0, target_state=10, drafter_state=0, buffers=0, free=9)
  with pytest.raises(jaxspec.ConfigError, match="10 B"):
    plan.check_fits(broken, 1, 8, "float")
