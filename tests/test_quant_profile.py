"""The quantization sensitivity profiler (issue 15, part): end to end on the bundled target.

The chosen policy must meet its KL budget on the held-out tokens, a zero budget must choose
nothing and a budget larger than everything must choose every group; per-layer rules touch
exactly their layer.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys

import pytest

import jaxspec
from jaxspec import quant
from jaxspec.drafters import registry
from jaxspec.profiling import sensitivity as profile_lib
from jaxspec.quant import policy as policy_lib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@functools.lru_cache(maxsize=None)
def _profiled():
  target = jaxspec.load_model(registry.bundled_dir("target"), scan_layers=False)
  tokens = profile_lib.held_out_windows(target.tokenizer, 2, 64)
  results, evaluator = profile_lib.profile(target, tokens, formats=("fp8",), progress=False)
  return target, results, evaluator


def test_every_group_is_measured():
  target, results, _ = _profiled()
  assert {r.pattern for r in results} == {
    (role if layer is None else f"{role}@{layer}") for layer, role in profile_lib.groups(target)
  }
  for r in results:
    assert r.kl >= 0 and 0 <= r.top1 <= 1 and r.bytes_after < r.bytes_before
  # The target's own logits: MTP layers do not change them; every layer's attention does.
  assert next(r for r in results if r.role == "mtp").kl == 0
  assert all(r.kl > 0 for r in results if r.role == "attention")


@pytest.mark.parametrize("budget", [2e-4, 1e-3])
def test_chosen_policy_meets_its_budget(budget):
  target, results, evaluator = _profiled()
  rules, measured = profile_lib.choose_policy(results, evaluator, target, budget)
  assert rules and measured["kl"] <= budget
  again = evaluator.compare(jaxspec.quantize(target, rules))
  assert again["kl"] == pytest.approx(measured["kl"]) and again["kl"] <= budget
  assert measured["bytes_after"] < measured["bytes_before"]


def test_zero_and_unbounded_budgets():
  target, results, evaluator = _profiled()
  rules, measured = profile_lib.choose_policy(results, evaluator, target, 0.0)
  # Only what leaves the target's logits exactly as they were: its MTP layers (they change
  # drafting, never the output).
  assert rules == (("mtp", "fp8"),) and measured["kl"] == 0.0
  rules, _ = profile_lib.choose_policy(results, evaluator, target, 1e9)
  assert {p for p, _ in rules} == {r.pattern for r in results}


def test_per_layer_rules_touch_their_layer_only(tmp_path):
  target, _, _ = _profiled()
  q = jaxspec.quantize(target, (("experts@2", "mxfp4"), ("attention@0", "fp8")))
  assert sorted(q.quant_report.formats) == [
    "layers_0/0/self_attn/k_proj/kernel",
    "layers_0/0/self_attn/o_proj/kernel",
    "layers_0/0/self_attn/q_proj/kernel",
    "layers_0/0/self_attn/v_proj/kernel",
    "layers_1/1/mlp/down_proj",
    "layers_1/1/mlp/gate_proj",
    "layers_1/1/mlp/up_proj",
  ]
  scanned = jaxspec.load_model(registry.bundled_dir("target"), scan_layers=True)
  with pytest.raises(jaxspec.ConfigError, match="scan_layers=False"):
    jaxspec.quantize(scanned, (("experts@2", "mxfp4"),))
  with pytest.raises(jaxspec.ConfigError, match="must be a number"):
    quant.check_policy([("experts@x", "fp8")])
  path = str(tmp_path / "policy.json")
  policy_lib.save_policy((("experts@2", "mxfp4"),), path, kl_budget=0.1)
  assert policy_lib.load_policy(path) == (("experts@2", "mxfp4"),)
  assert policy_lib.load_policy("default") == quant.DEFAULT_POLICY
  with pytest.raises(jaxspec.ConfigError, match="neither"):
    policy_lib.load_policy(str(tmp_path / "missing.json"))


@pytest.mark.slow  # a minute of CPU: the library path above is the default suite's check
def test_launch_script_writes_a_policy_generate_accepts(tmp_path):
  out = str(tmp_path / "q")
  cmd = [
    sys.executable,
    os.path.join(ROOT, "launch", "bench.py"),
    "quant-profile",
    "--windows=2",
    "--window_len=32",
    "--drafter=none",
    "--kl_budget=0.001",
    f"--out={out}",
  ]
  run = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
  assert run.returncode == 0, run.stderr[-2000:]
  assert "chosen policy" in run.stdout and "default policy" in run.stdout
  with open(os.path.join(out, "profile.json")) as f:
    report = json.load(f)
  assert report["chosen"]["kl"] <= 0.001
  assert os.path.exists(os.path.join(out, "sensitivity.png"))
  rules = policy_lib.load_policy(os.path.join(out, "policy.json"))
  assert [list(r) for r in rules] == report["chosen"]["rules"]
  assert {g["format"] for g in report["groups"]} == {"mxfp4", "fp8"}


@pytest.mark.slow  # a minute of engine compiles; `bench.py quant-profile` runs it per policy
def test_policy_effect_on_greedy_decoding():
  target, _, _ = _profiled()
  prompts = ["def fib(n):"]
  same = profile_lib.policy_effect(target, (), None, prompts, 8)
  assert same == {"greedy_match": 1.0, "greedy_match_before_divergence": 1.0}
  # Everything in MXFP4: greedy decoding moves off the full target's path.
  crude = (("experts", "mxfp4"), ("attention", "mxfp4"), ("shared_experts", "mxfp4"))
  changed = profile_lib.policy_effect(target, crude + (("mlp", "mxfp4"),), None, prompts, 16)
  assert changed["greedy_match_before_divergence"] <= changed["greedy_match"] <= 1.0
  assert changed["greedy_match_before_divergence"] < 1.0
