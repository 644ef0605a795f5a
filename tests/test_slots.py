"""Engine slots: rows that come and go without recompiling, each with its own key and stops.

A request inserted into a freed row while other rows are mid-generation must produce what it
produces alone, greedy or sampled (row keys: its random stream depends on its seed only),
with the drafter's state moved along (DFlash + DDTree here, whose state and tree commit are
the most involved), and the log-probs the engine reports must be the target's own.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jaxspec.errors import InputError
from jaxspec import sampling
from jaxspec.speculative.engine import SpecEngine
from jaxspec.speculative.engine_config import EngineConfig

from tests import near_ties

# (prompt, max_new_tokens, temperature, seed)
REQUESTS = {
  "greedy_a": ("def fib(n):\n", 24, 0.0, 0),
  "sampled_b": ("class Stack:\n", 30, 1.0, 7),
  "sampled_c": ("import os\nimport sys\n", 20, 0.8, 3),
  "greedy_d": ("for i in range(", 16, 0.0, 0),
}


# Plain decoding has the same slot code with less state to move: with the slow tests.
@pytest.fixture(
  scope="module", params=[pytest.param("plain", marks=pytest.mark.slow), "dflash_tree"]
)
def engine(request, target, bundled_drafter):
  if request.param == "plain":
    return SpecEngine(target, None, EngineConfig(max_len=80, batch_size=3))
  drafter = bundled_drafter("dflash")
  cfg = EngineConfig(max_len=80, batch_size=3, verify="tree", tree_budget=6)
  return SpecEngine(target, drafter, cfg)


def _alone(engine, name):
  prompt, new, temp, seed = REQUESTS[name]
  out = engine.generate([prompt], max_new_tokens=new, temperature=temp, seed=seed)
  return out.tokens[0], out.logprobs[0]


def _row(engine, name):
  prompt, new, temp, seed = REQUESTS[name]
  return engine.prefill_row(prompt, new, temp, seed=seed)


def test_request_in_a_freed_row_equals_it_alone(engine, target):
  alone = {name: _alone(engine, name) for name in REQUESTS}
  state = engine.warm_up_slots()
  compiled = engine.compile_counts()

  state = engine.insert(state, 1, _row(engine, "greedy_a"))
  state = engine.insert(state, 2, _row(engine, "sampled_b"))
  state = engine.run(state, 3)
  state = engine.evict(state, 2)  # sampled_b cancelled mid-generation: row 2 is free
  state = engine.insert(state, 2, _row(engine, "sampled_c"))  # while greedy_a is mid-way
  state = engine.run(state, 2)
  state = engine.insert(state, 0, _row(engine, "greedy_d"))
  state = engine.run(state)

  tokens = engine._outputs(state, 3)  # pylint: disable=protected-access
  logprobs = engine._outputs(state, 3, "logprobs")  # pylint: disable=protected-access
  got = {"greedy_a": 1, "sampled_c": 2, "greedy_d": 0}
  for name, row in got.items():
    want, want_lp = alone[name]
    if REQUESTS[name][2] == 0:
      prompt = target.tokenizer.encode(REQUESTS[name][0])
      near_ties.assert_greedy_match(target, [prompt], [want], [tokens[row]])
    else:  # the row's own key: the same draws as alone
      assert tokens[row] == want, name
    n = near_ties.comparable_length(target, target.tokenizer.encode(REQUESTS[name][0]), want)
    np.testing.assert_allclose(logprobs[row][:n], want_lp[:n], atol=1e-4)
  # The cancelled request stopped where it was evicted; nothing recompiled after warm-up.
  assert engine.compile_counts() == compiled


def test_logprobs_are_the_targets(engine, target):
  """Each generated token's log-prob equals log softmax of a full forward over the text."""
  prompt = target.tokenizer.encode("def merge_sorted(a, b):\n")
  out = engine.generate([prompt], max_new_tokens=20, temperature=1.0, seed=5)
  text = prompt + out.tokens[0]
  logits = np.asarray(target.logits([text[:-1]]))[0].astype(np.float64)
  top = logits.max(-1, keepdims=True)
  logp = logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))
  want = logp[np.arange(len(prompt) - 1, len(text) - 1), out.tokens[0]]
  np.testing.assert_allclose(out.logprobs[0], want, atol=1e-4)
  assert np.all(np.asarray(out.logprobs[0]) <= 0)


def test_top_logprobs_are_the_targets_alternatives(target, bundled_drafter):
  """EngineConfig.top_logprobs: each generated token's K most likely alternatives (a tree
  engine: tokens committed several per step) equal the top K of log softmax of a full forward
  over the text; the token itself is among them with its own log-prob when it ranks."""
  drafter = bundled_drafter("dflash")
  config = EngineConfig(max_len=80, batch_size=2, verify="tree", tree_budget=6, top_logprobs=4)
  engine = SpecEngine(target, drafter, config)
  prompts = [target.tokenizer.encode(p) for p in ("def merge_sorted(a, b):\n", "import os\n")]
  out = engine.generate(prompts, max_new_tokens=16, temperature=1.0, seed=[5, 6])
  assert out.stats.acceptance_length > 1.0  # several tokens per step went through the commit
  for prompt, tokens, top in zip(prompts, out.tokens, out.top_logprobs):
    assert len(top) == len(tokens) and all(len(alts) == 4 for alts in top)
    text = prompt + tokens
    logits = np.asarray(target.logits([text[:-1]]))[0].astype(np.float64)
    logp = logits - logits.max(-1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
    for j, alts in enumerate(top):
      row = logp[len(prompt) - 1 + j]
      want = np.sort(row)[::-1][:4]
      np.testing.assert_allclose([lp for _, lp in alts], want, atol=1e-4)
      for token_id, lp in alts:
        assert abs(row[token_id] - lp) < 1e-4
  assert SpecEngine(target, None, EngineConfig(max_len=32)).generate([[5]], 2).top_logprobs is None


def test_row_keys_make_a_request_independent_of_its_row(target):
  engine = SpecEngine(target, None, EngineConfig(max_len=64, batch_size=3))
  a, b = "def fib(n):\n", "class Stack:\n"
  both = engine.generate([a, b], max_new_tokens=16, temperature=1.0, seed=[11, 12]).tokens
  swapped = engine.generate([b, a], max_new_tokens=16, temperature=1.0, seed=[12, 11]).tokens
  alone_a = engine.generate([a], max_new_tokens=16, temperature=1.0, seed=11).tokens[0]
  assert both[0] == swapped[1] == alone_a
  assert both[1] == swapped[0]
  # One seed for the call: each row still gets a key of its own.
  same = engine.generate([a, a], max_new_tokens=16, temperature=1.0, seed=11).tokens
  assert same[0] == alone_a and same[1] != same[0]
  keys = np.asarray(sampling.row_keys([11, 11], [0, 1]))
  assert not np.array_equal(keys[0], keys[1])
  np.testing.assert_array_equal(keys[0], np.asarray(jax.random.fold_in(jax.random.PRNGKey(11), 0)))


def test_per_request_stop_token_ids(target):
  engine = SpecEngine(target, None, EngineConfig(max_len=64, batch_size=2, max_stop_ids=4))
  prompt = "def fib(n):\n"
  free = engine.generate([prompt], max_new_tokens=12).tokens[0]
  stop = free[3]
  cut = engine.generate([prompt, prompt], max_new_tokens=12, stop_token_ids=[[stop], []]).tokens
  assert cut[0] == free[: free.index(stop) + 1]
  assert cut[1] == free
  with pytest.raises(InputError, match="outside the vocabulary"):
    engine.generate([prompt], stop_token_ids=[target.config.vocab_size])
  with pytest.raises(InputError, match="max_stop_ids=4"):
    engine.generate([prompt], stop_token_ids=[5, 6, 7, 8, 9])
  with pytest.raises(InputError, match="stop_token_ids"):
    engine.generate([prompt], stop_token_ids="5")
  with pytest.raises(InputError, match="2 lists for 1 prompts"):
    engine.generate([prompt], stop_token_ids=[[5], [6]])


def test_slot_errors(target):
  engine = SpecEngine(target, None, EngineConfig(max_len=32, batch_size=2))
  state = engine.empty_state()
  assert bool(np.all(np.asarray(state.done)))
  with pytest.raises(InputError, match="slot 2 is outside"):
    engine.insert(state, 2, engine.prefill_row("x", 4))
  with pytest.raises(InputError, match="more than max_len=32"):
    engine.check_row("x", 40)
  with pytest.raises(InputError, match="max_new_tokens"):
    engine.check_row("x", 0)
