"""`python launch/bench.py`: the subcommand dispatcher, and the generate, cost-curve and quant
benchmarks on tiny random models (structure only, no timing assertions)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import jaxspec
from launch import benchmarks
from launch.benchmarks import cost_curve
from launch.benchmarks import generate
from launch.benchmarks import latent
from launch.benchmarks import quant
from launch.benchmarks import runners

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# What each subcommand's --help must list: a flag of its own.
OWN_FLAG = {
  "generate": "--methods",
  "cost-curve": "--cost_tokens",
  "quant": "--quant_policies",
  "quant-profile": "--kl_budget",
  "kv": "--max_lens",
  "long": "--contexts",
  "serve": "--concurrency",
  "ep": "--experts",
  "compile": "--layers",
  "device": "--sections",
  "hybrid-context": "--contexts",
  "latent": "--kv_lora_rank",
  "tree-calibrate": "--calibrate_temperatures",
  "gdn": "--traceback",
  "hybrid-tree": "--traceback",
  "llamacpp": "--llama_formats",
  "ordered-head": "--centroids",
  "serve-pages": "--budget_rows",
  "serve-adaptive": "--slots",
}


def _bench(*args: str) -> subprocess.CompletedProcess:
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  cmd = [sys.executable, os.path.join(REPO, "launch", "bench.py"), *args]
  return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


def test_every_subcommand_is_registered_and_importable():
  assert set(benchmarks.SUBCOMMANDS) == set(OWN_FLAG)
  for sub in benchmarks.SUBCOMMANDS.values():
    module = __import__(f"launch.benchmarks.{sub.module}", fromlist=["main"])
    assert callable(module.main) and callable(module.define_flags), sub.name
    assert module.__doc__, sub.name


def test_top_level_help_lists_the_subcommands():
  proc = _bench("--help")
  assert proc.returncode == 0, proc.stderr[-3000:]
  for name, sub in benchmarks.SUBCOMMANDS.items():
    assert f"  {name} " in proc.stdout and sub.summary in proc.stdout, name


# Runs `bench.py <name> --help` for every subcommand in one interpreter (jax imported once): a
# forked child per subcommand, as each defines its own flags. Prints "<name> <exit status>" after
# each help text.
HELP_ALL = r"""
import os, sys
sys.path.insert(0, sys.argv[1])
from launch import benchmarks
for name in benchmarks.SUBCOMMANDS:
  sys.stdout.flush()
  pid = os.fork()
  if pid == 0:
    code = 3
    try:
      benchmarks.main([os.path.join(sys.argv[1], "launch", "bench.py"), name, "--help"])
    except SystemExit as e:
      code = e.code
    finally:
      sys.stdout.flush()
      sys.stderr.flush()
      os._exit(code or 0)
  _, status = os.waitpid(pid, 0)
  print(f"\n@@@ {name} {os.waitstatus_to_exitcode(status)}", flush=True)
"""


def test_every_subcommand_help_lists_its_flags():
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  proc = subprocess.run(
    [sys.executable, "-c", HELP_ALL, REPO], cwd=REPO, env=env, capture_output=True, text=True,
    timeout=300,
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  chunks = proc.stdout.split("\n@@@ ")
  helps = {}
  for chunk, trailer in zip(chunks[:-1], chunks[1:]):
    name, status = trailer.split("\n", 1)[0].split()
    helps[name] = (int(status), chunk)
  assert set(helps) == set(OWN_FLAG), proc.stderr[-3000:]
  for name, (status, text) in helps.items():
    assert status == 0, (name, proc.stderr[-3000:])
    assert f"usage: python launch/bench.py {name}" in text, (name, text[:500])
    assert OWN_FLAG[name] in text and "--traceback" in text, (name, text)


def test_unknown_subcommand_is_a_one_line_error():
  proc = _bench("nonsense", "--x=1")
  assert proc.returncode == 2, proc.stderr[-3000:]
  lines = proc.stderr.splitlines()
  assert len(lines) == 1 and lines[0].startswith("jaxspec: error: unknown subcommand"), lines
  assert "cost-curve" in lines[0] and proc.stdout == ""


def test_bad_flag_of_a_subcommand_is_a_one_line_error():
  proc = _bench("kv", "--kv_formats=float,fp16")
  assert proc.returncode == 2, proc.stderr[-3000:]
  lines = proc.stderr.splitlines()
  assert len(lines) == 1 and "--kv_formats" in lines[0], lines


def test_no_subcommand_is_a_one_line_error_naming_them():
  for args in ((), ("--mode=cost_curve",)):
    proc = _bench(*args)
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("jaxspec: error: "), lines
    assert all(name in lines[0] for name in benchmarks.SUBCOMMANDS) and proc.stdout == "", lines


def test_command_runs_this_tree_s_entry_point():
  assert benchmarks.command("long", "--job=x")[1:] == [benchmarks.entry_point(), "long", "--job=x"]
  assert os.path.samefile(benchmarks.entry_point(), os.path.join(REPO, "launch", "bench.py"))


# ---- generate, cost-curve, quant -----------------------------------------------------------------



@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
  pytest.importorskip("torch")
  pytest.importorskip("transformers")
  return runners.write_random_models(str(tmp_path_factory.mktemp("bench_models")), "tiny", seed=0)


def _config(model_dirs, out, **kw) -> generate.BenchConfig:
  target, draft = model_dirs
  args = dict(
    model=target,
    draft_model=draft,
    num_prompts=1,
    max_new_tokens=8,
    temperatures=(0.0,),
    out=out,
    profile=False,
    verbose=False,
  )
  args.update(kw)
  return generate.BenchConfig(**args)


def _check_runner(s: dict, speculative: bool) -> None:
  for key in (
    "tokens_generated",
    "wall_s",
    "tokens_per_second",
    "target_passes",
    "tokens_per_target_pass",
    "seconds_per_prompt",
    "speedup_vs_plain",
  ):
    assert key in s, key
  assert s["tokens_generated"] == 8 and s["all_full_length"]
  assert s["tokens_per_second"] > 0
  if speculative:
    assert len(s["acceptance_rate_per_position"]) == 4  # γ
    assert s["acceptance_length"] >= 1.0


def test_bench_with_transformers_peers(model_dirs, tmp_path):
  out = str(tmp_path / "bench.json")
  report = generate.run_benchmark(_config(model_dirs, out, hf=True, torch_threads=1))
  with open(out, encoding="utf-8") as f:
    saved = json.load(f)
  assert saved["table"] == report["table"]
  # Acceptance by position, beside the JSON.
  assert report["plot"] == str(tmp_path / "bench.png") and os.path.getsize(report["plot"]) > 1000
  for key in (
    "config",
    "machine",
    "models",
    "prompts",
    "results",
    "max_len",
    "tokens_per_second_definition",
    "recompiled_during_timing",
  ):
    assert key in saved, key
  assert saved["machine"]["torch_threads"] == 1 and "jax" in saved["machine"]
  assert len(saved["prompts"]) == 1 and saved["prompts"][0]["text"].startswith("def ")
  entry = saved["results"]["0"]
  runners = entry["runners"]
  assert set(runners) == {
    "jaxspec/plain",
    "jaxspec/draft_model",
    "jaxspec/ngram",
    "transformers/generate",
    "transformers/assisted",
    "transformers/prompt_lookup",
  }
  for name, s in runners.items():
    _check_runner(s, name in ("jaxspec/draft_model", "jaxspec/ngram"))
  assert set(entry["jaxspec_over_transformers"]) == {
    "plain/generate",
    "draft_model/assisted",
    "ngram/prompt_lookup",
  }
  # Lossless: greedy speculation reproduces plain decoding exactly (same engine, float32).
  tokens = entry["tokens"]
  assert tokens["jaxspec/draft_model"] == tokens["jaxspec/plain"]
  assert tokens["jaxspec/ngram"] == tokens["jaxspec/plain"]
  check = entry["greedy_check"]
  assert check["reference"] == "jaxspec/plain"
  assert check["vs"]["jaxspec/draft_model"]["mismatched_prompts"] == 0
  assert "transformers/generate" in check["vs"]
  assert "temperature 0" in report["table"] and "jaxspec/plain" in report["table"]


def test_bench_jaxspec_only(model_dirs, tmp_path):
  prompt = "def add(a, b):\n    return a + b\n"
  report = generate.run_benchmark(
    _config(model_dirs, None, hf=False, methods=("plain", "ngram", "ngram@2"), prompts=[prompt])
  )
  assert "torch" not in report["machine"]
  entry = report["results"]["0"]
  assert set(entry["runners"]) == {"jaxspec/plain", "jaxspec/ngram", "jaxspec/ngram@2"}
  assert entry["jaxspec_over_transformers"] == {}
  assert entry["tokens"]["jaxspec/ngram"] == entry["tokens"]["jaxspec/plain"]
  assert entry["tokens"]["jaxspec/ngram@2"] == entry["tokens"]["jaxspec/plain"]
  assert len(entry["runners"]["jaxspec/ngram@2"]["acceptance_rate_per_position"]) == 2
  assert runners.split_method("eagle3@15") == ("eagle3", 15)
  with pytest.raises(jaxspec.ConfigError, match="after '@'"):
    runners.split_method("eagle3@x")
  assert runners.split_method("dflash@7:argmax") == ("dflash", 7)
  assert runners.drafter_options("dflash:argmax") == {"sample_drafts": False}
  assert runners.drafter_options("dflash") == {}
  with pytest.raises(jaxspec.ConfigError, match="applies to DFlash"):
    runners.drafter_options("eagle3:argmax")
  assert report["prompts"][0]["text"] == prompt
  assert "profile" not in report


def test_profile_forwards(model_dirs):
  target = jaxspec.load_model(model_dirs[0])
  draft = jaxspec.load_model(model_dirs[1])
  prof = runners.profile_forwards(target, draft, gamma=2, max_len=32, repeats=1)
  assert set(prof) == {
    "target_1_token_s",
    "target_3_tokens_s",
    "draft_1_token_s",
    "draft_2_tokens_s",
    "draft_step_floor_s",
  }
  assert all(v > 0 for v in prof.values())


def test_cost_curve_mode(tmp_path):
  """`bench.py cost-curve` on tiny random models: curves for both layer layouts, drafter step
  costs, a JSON report and a plot (τ measurement skipped: no prompts)."""
  out = str(tmp_path / "cost.json")
  report = cost_curve.run_cost_curves(
    size="tiny", tokens=(1, 2, 4), max_len=64, num_prompts=0, out=out
  )
  names = set(report["curves"])
  assert names == {"dense (unrolled layers)", "dense (scanned layers)", "moe (unrolled layers)"}
  for pts in report["curves"].values():
    assert [p["tokens"] for p in pts] == [1, 2, 4]
    assert all(p["seconds"] > 0 and p["weight_bytes"] > 0 for p in pts)
    # More tokens read more embedding rows (and, for MoE, more experts).
    assert pts[0]["weight_bytes"] < pts[-1]["weight_bytes"]
  assert set(report["drafter_step_s"]) == {"dense", "moe"}
  assert report["bandwidth_bytes_per_s"]["best"] > 0
  assert "reference bandwidth" in report["table"] and "t(T)/t(1)" in report["table"]
  with open(out) as f:
    assert json.load(f)["curves"] == report["curves"]
  assert report["plot"] and os.path.getsize(report["plot"]) > 1000


def test_projection_formula():
  from jaxspec.profiling import roofline  # pylint: disable=import-outside-toplevel

  # τ tokens for one verify and one draft step, against τ plain steps.
  assert roofline.project_speedup(4.0, 1.0, 1.5, 0.5) == pytest.approx(2.0)
  pts = [roofline.CostPoint(1, 1.0, 10.0), roofline.CostPoint(4, 2.0, 10.0)]
  assert roofline.interpolate(pts, 2) == pytest.approx(1.5)  # halfway in log2(T)
  assert roofline.interpolate(pts, 8) == pytest.approx(4.0)  # linear past the last point
  # The roofline is the larger of the bytes' time and the FLOPs' time.
  p = roofline.CostPoint(16, 3.0, 10.0, flops=40.0)
  assert roofline.roofline_seconds(p, bandwidth=5.0) == pytest.approx(2.0)
  assert roofline.roofline_seconds(p, bandwidth=5.0, flops_per_s=10.0) == pytest.approx(4.0)
  assert roofline.roofline_seconds(p, bandwidth=5.0, flops_per_s=40.0) == pytest.approx(2.0)
  table = "\n".join(roofline.curve_table("m", [p], 5.0, 10.0))
  assert "t/roofline" in table and table.split()[-1] == "0.75"  # 3 s against a 4 s floor
  # Expected distinct experts: all of them for many tokens, k for one token.
  assert roofline.expected_distinct_experts(64, 8, 1) == pytest.approx(8)
  assert roofline.expected_distinct_experts(64, 8, 1000) == pytest.approx(64)


def test_weight_bytes_read_counts_only_routed_experts_and_stored_bytes():
  """A token reads every dense weight, its embedding row and the experts it routes to, in
  the bytes they are stored in (quantized weights as stored)."""
  import jax  # pylint: disable=import-outside-toplevel

  from jaxspec import quant  # pylint: disable=import-outside-toplevel
  from jaxspec.models import target as target_lib  # pylint: disable=import-outside-toplevel
  from jaxspec.profiling import roofline  # pylint: disable=import-outside-toplevel

  config = roofline.moe_config(
    hidden=512, layers=2, experts=8, experts_per_tok=2, expert_intermediate=64, vocab=512
  ).replace(num_mtp_layers=0).with_options(scan_layers=False)
  params = target_lib.init_params(config)
  sizes = {}
  for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
    role = quant.role_of(quant.policy.path_str(path))
    sizes[role] = sizes.get(role, 0) + leaf.size * 4
  experts = sizes.pop("experts")
  embed = sizes.pop("embed")
  want = sum(sizes.values()) + embed / 512 + experts * 2 / 8
  assert roofline.weight_bytes_read(config, params, 1) == pytest.approx(want)
  q = jaxspec.quantize(jaxspec.TargetModel(config, params), (("experts", "mxfp4"),))
  want_q = sum(sizes.values()) + embed / 512 + experts * 4.25 / 32 * 2 / 8
  assert roofline.weight_bytes_read(config, q.params, 1) == pytest.approx(want_q)


@pytest.mark.parametrize("moe", [False, True])
def test_forward_flops_counts_every_product_once_per_token(moe):
  """2 FLOPs per weight element per token (a token's own k experts, not all of them; no
  embedding products) plus QKᵀ and PV over each token's prefix, written out from the shapes."""
  from jaxspec.models import target as target_lib  # pylint: disable=import-outside-toplevel
  from jaxspec.profiling import roofline  # pylint: disable=import-outside-toplevel

  h, n, v, heads, kv, hd, inter, e, k = 256, 2, 512, 4, 2, 64, 384, 8, 2
  kw = dict(hidden=h, layers=n, vocab=v, head_dim=hd, kv_heads=kv)
  if moe:
    config = roofline.moe_config(experts=e, experts_per_tok=k, expert_intermediate=inter, **kw)
  else:
    config = roofline.dense_config(intermediate=inter, **kw)
  config = config.replace(num_mtp_layers=0).with_options(scan_layers=False)
  params = target_lib.init_params(config)
  attn_proj = h * heads * hd * 2 + h * kv * hd * 2
  mlp = 3 * h * inter * (k if moe else 1) + (h * e if moe else 0)  # + the router
  norms = n * (2 * h + 2 * hd) + h  # input/post norms, q/k norms, the final norm
  per_token = n * (attn_proj + mlp) + v * h + norms
  tokens, position = 5, 7
  prefix = sum(position + i + 1 for i in range(tokens))
  want = 2 * tokens * per_token + n * 4 * prefix * heads * hd
  assert roofline.forward_flops(config, params, tokens, position) == pytest.approx(want)


@pytest.mark.slow  # ~45 s of compiles; weight_bytes_read and quantize are tested on their own
def test_quant_cost_mode(tmp_path):
  """`bench.py quant` on tiny random models: per weight format, the bytes a decode step
  reads (bf16 exactly half of float32; the default policy less than float32) and times."""
  out = str(tmp_path / "quant.json")
  report = quant.run_quant_costs(
    size="tiny", tokens=(1, 4), max_len=64, policies=("float32", "bfloat16", "default"), out=out
  )
  rows = {(r["model"], r["weights"]): r for r in report["rows"]}
  assert set(rows) == {(m, w) for m in ("dense", "moe") for w in ("float32", "bfloat16", "default")}
  for m in ("dense", "moe"):
    f32 = rows[(m, "float32")]
    assert rows[(m, "bfloat16")]["step_bytes"] == pytest.approx(f32["step_bytes"] / 2)
    assert rows[(m, "default")]["stored_bytes"] < f32["stored_bytes"]
    assert rows[(m, "default")]["step_bytes"] < f32["step_bytes"]
    assert all(s > 0 for s in f32["seconds"].values())
  with open(out) as f:
    assert len(json.load(f)["rows"]) == 6


def test_latent_bench_measures_both_caches_at_tiny_sizes():
  # r + dr = 40 values per token against 2 heads × (16 + 8) × 2 for K and V.
  m = latent.measure(64, heads=2, r=32, dn=16, dr=8, dv=16, repeats=1)
  assert latent.cache_bytes_per_token(2, 32, 16, 8) == (2 * 2 * 24 * 4, 40 * 4)
  assert m["gqa_bytes"] == 64 * 2 * 2 * 24 * 4
  assert m["latent_bytes"] == 64 * 40 * 4 + 32 * 2 * 32 * 4  # the cache and kv_b_proj
  assert m["gqa_s"] > 0 and m["latent_s"] > 0
