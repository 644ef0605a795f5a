"""The launch scripts' command line (launch.cli): one-line errors, exit statuses, --help.

Each case runs a script in a subprocess (a few seconds each, mostly the jax import) on tiny
random models written to a temporary folder.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

import jaxspec
from jaxspec.io.tokenizer import Tokenizer
from launch import cli
from tests import engine_models

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RULE = "-" * 72  # generate.py prints the generated text between two such rules


@pytest.fixture(scope="module")
def models(tmp_path_factory):
  """{name: directory}: no tokenizer, truncated weights, and one with the bundled tokenizer."""
  root = tmp_path_factory.mktemp("models")
  plain, truncated, with_tok = root / "plain", root / "truncated", root / "with_tokenizer"
  jaxspec.save_hf(engine_models.random_draft(96), str(plain))
  jaxspec.save_hf(engine_models.random_draft(96), str(truncated))
  with open(truncated / "model.safetensors", "r+b") as f:
    f.truncate(100)
  tok = Tokenizer.bundled()
  jaxspec.save_hf(engine_models.random_draft(tok.vocab_size), str(with_tok))
  tok.save_hf(str(with_tok))
  assert not (plain / "tokenizer.json").exists() and (with_tok / "tokenizer.json").exists()
  return {"plain": str(plain), "truncated": str(truncated), "with_tokenizer": str(with_tok)}


def _run(script: str, *args: str) -> subprocess.CompletedProcess:
  """Runs launch/<script>.py (as a module, like the docs do for the trainers)."""
  cmd = [sys.executable, "-m", f"launch.{script}", *args]
  env = dict(
    os.environ,
    JAX_PLATFORMS="cpu",
    PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
  )
  return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


def _generate(model: str, *args: str) -> subprocess.CompletedProcess:
  return _run("generate", f"--model={model}", "--compare_plain=false", "--max_new_tokens=2", *args)


def _assert_one_line_error(proc: subprocess.CompletedProcess, *words: str) -> None:
  assert proc.returncode == 2, (proc.returncode, proc.stderr[-3000:])
  lines = proc.stderr.splitlines()
  assert len(lines) == 1, proc.stderr[-3000:]
  assert lines[0].startswith("jaxspec: error: "), lines[0]
  for word in words:
    assert word in lines[0], (word, lines[0])
  assert RULE not in proc.stdout, proc.stdout  # nothing was generated


def test_help_exits_zero_with_the_usage():
  proc = _run("generate", "--help")
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "--prompt_ids" in proc.stdout and "--traceback" in proc.stdout
  assert "Generate with jaxspec" in proc.stdout  # the module docstring


def test_text_prompt_without_tokenizer_is_an_error(models):
  """It used to generate from the ids [1, 2, 3] and print the text prompt in front."""
  _assert_one_line_error(_generate(models["plain"]), "no tokenizer", "--prompt_ids=")


def test_prompt_ids_work_without_tokenizer(models):
  proc = _generate(models["plain"], "--prompt_ids=1,2,3")
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert proc.stdout.count(RULE) == 2 and "[1, 2, 3] + [" in proc.stdout, proc.stdout


def test_text_prompt_with_special_tokens_parsed(models):
  proc = _generate(models["with_tokenizer"], "--prompt=<|endoftext|>def f(", "--parse_special")
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert proc.stdout.count(RULE) == 2, proc.stdout


def test_chat_on_a_gguf_file_renders_its_template(tmp_path):
  """--model=file.gguf --chat: the file's tokenizer and chat template, the reply after it."""
  gguf_files = pytest.importorskip("tests.gguf_files")  # needs the gguf package's writer
  from jaxspec.io import architectures, hf as hf_io  # pylint: disable=import-outside-toplevel

  vocab = gguf_files.tiny_vocab()
  model = engine_models.random_draft(len(vocab["tokens"])).with_scan_layers(False)
  config = architectures.config_to_hf(model.config)
  path = str(tmp_path / "chat.gguf")
  tensors = hf_io.export_tensors(model.config, model.params)
  gguf_files.write_gguf(path, "qwen3", config, tensors, tokenizer=vocab)
  proc = _generate(path, "--chat", "--prompt=hello world")
  assert proc.returncode == 0, proc.stderr[-3000:]
  shown = proc.stdout.split(RULE)[1]
  assert shown.startswith("\n<|im_start|>user\nhello world<|im_end|>\n<|im_start|>assistant\n")


def test_engine_input_error_is_one_line(models):
  proc = _generate(models["plain"], "--prompt_ids=1,2", "--max_new_tokens=0")
  _assert_one_line_error(proc, "max_new_tokens")
  assert proc.stdout == "", proc.stdout  # refused before the header is printed


def test_truncated_model_is_one_line(models):
  _assert_one_line_error(_generate(models["truncated"], "--prompt_ids=1"), "truncated")


@pytest.mark.parametrize("mesh", ["bogus", "data=x"])
def test_bad_mesh_names_the_expected_form(models, mesh):
  proc = _generate(models["plain"], "--prompt_ids=1", "--mesh", mesh)
  _assert_one_line_error(proc, f"--mesh={mesh}", "data=1,expert=2,tensor=1")


def test_traceback_flag_shows_the_trace(models):
  proc = _generate(models["plain"], "--prompt_ids=1", "--mesh=bogus", "--traceback")
  assert proc.returncode == 2, proc.stderr[-3000:]
  assert "Traceback (most recent call last)" in proc.stderr
  assert proc.stderr.rstrip().splitlines()[-1].startswith("jaxspec.errors.ConfigError: --mesh")


def test_drafter_trainer_given_a_target_config():
  """It used to stop at `AttributeError: 'target_dir'`."""
  proc = _run("train_drafter", "--config=configs/tiny_code.py:test_target")
  _assert_one_line_error(proc, "not a drafter config", "method", "drafter", "target_dir")


def test_convert_of_a_truncated_checkpoint(models, tmp_path):
  proc = _run(
    "convert", f"--input={models['truncated']}", f"--output={tmp_path / 'out'}", "--to=orbax"
  )
  _assert_one_line_error(proc, "truncated")


# ---- in-process ----------------------------------------------------------------------------------


def test_messages_fit_on_one_line():
  quoted = (
    "flag --config=x: Error:\n\n  Traceback (most recent call last):\n    ...\n  ValueError: no"
  )
  assert cli.one_line(quoted) == "flag --config=x: Error: ValueError: no"
  assert cli.one_line("a\n  b\n") == "a b"
  missing = FileNotFoundError(2, "No such file or directory", "/nowhere")
  assert cli.describe(missing) == "No such file or directory: /nowhere"
  assert cli.describe(jaxspec.InputError("")) == "InputError"
