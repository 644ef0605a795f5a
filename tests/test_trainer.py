"""Tests of the training stack: losses, optimizer, metrics files, and kill-and-resume.

The runs use `configs/tiny_code.py:test_target` (a 2-layer GLM-MoE with one MTP layer,
width 32) on the stdlib corpus: a dozen steps take seconds.
"""

from __future__ import annotations

import glob
import json
import os
import signal
import struct
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import tiny_code
from jaxspec.io.tokenizer import Tokenizer
from jaxspec.models import target as target_lib
from jaxspec.train import data as data_lib
from jaxspec.train import losses, metrics_writer, optim, trainer

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _test_setup(name: str = "test_target"):
  cfg = tiny_code.get_config(name)
  return (
    trainer.model_config_from(cfg.model),
    trainer.TrainConfig.from_mapping(cfg.train.to_dict()),
  )


@pytest.fixture(scope="module")
def tiny_params():
  config, _ = _test_setup()
  return target_lib.init_params(config, 0)


# ---- losses --------------------------------------------------------------------------------------


def test_mtp_loss_is_the_shifted_prediction(tiny_params):
  """MTP layer 0 sees token t_{i+1} beside the main hidden h_i and is scored on t_{i+2}."""
  config, _ = _test_setup()
  params = tiny_params
  batch = jnp.asarray(np.random.default_rng(0).integers(3, config.vocab_size, (2, 9)), jnp.int32)
  _, aux = jax.jit(lambda p, b: losses.lm_losses(config, p, b))(params, batch)
  t = batch.shape[1] - 1
  out = target_lib.apply_decoder(config, params, batch[:, :-1])
  logits, *_ = target_lib.apply_mtp(config, params, 0, batch[:, 1:t], out.hidden[:, : t - 1])

  def ce(lg, y):
    return float(
      jnp.mean(jax.nn.logsumexp(lg, -1) - jnp.take_along_axis(lg, y[..., None], -1)[..., 0])
    )

  assert float(aux["lm_loss"]) == pytest.approx(ce(out.logits, batch[:, 1:]), abs=1e-5)
  assert float(aux["mtp_loss_0"]) == pytest.approx(ce(logits, batch[:, 2:]), abs=1e-5)
  assert set(aux["expert_load"]) == {"layers_1/mlp", "mtp_0/block/mlp"}
  np.testing.assert_allclose(np.sum(aux["expert_load"]["layers_1/mlp"], -1), 1.0, rtol=1e-6)


def test_bias_update_pushes_against_the_load(tiny_params):
  params = tiny_params
  load = jnp.asarray([[0.7, 0.1, 0.1, 0.1]])
  new = losses.bias_update(params, {"layers_1/mlp": load}, 0.01)
  bias = np.asarray(new["layers_1"]["mlp"]["e_score_correction_bias"])
  np.testing.assert_allclose(bias, [[-0.01, 0.01, 0.01, 0.01]])
  np.testing.assert_array_equal(
    np.asarray(new["mtp_0"]["block"]["mlp"]["e_score_correction_bias"]), 0.0
  )
  # The input tree is untouched (pure function).
  np.testing.assert_array_equal(
    np.asarray(params["layers_1"]["mlp"]["e_score_correction_bias"]), 0.0
  )


# ---- optimizer -----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["adamw", "muon"])
def test_optimizer_freezes_bias_and_decays_only_matrices(name, tiny_params):
  params = tiny_params
  mask = optim.decay_mask(params)
  assert mask["layers_0"]["input_layernorm"]["scale"] is False  # [layers, H], not a matrix
  assert mask["layers_1"]["mlp"]["gate_proj"] is True
  opt, schedule = optim.make_optimizer(
    params, total_steps=10, learning_rate=1e-2, warmup_steps=2, name=name
  )
  assert float(schedule(0)) == 0.0 and float(schedule(2)) == pytest.approx(1e-2)
  assert float(schedule(10)) == pytest.approx(1e-3)
  grads = jax.tree_util.tree_map(jnp.ones_like, params)
  state = opt.init(params)
  update = jax.jit(opt.update)
  for _ in range(2):  # the warmup starts at a learning rate of 0
    updates, state = update(grads, state, params)
  assert not np.any(np.asarray(updates["layers_1"]["mlp"]["e_score_correction_bias"]))
  assert np.all(np.isfinite(np.asarray(updates["layers_1"]["mlp"]["gate_proj"])))
  assert np.any(np.asarray(updates["layers_1"]["mlp"]["gate_proj"]))


# ---- metrics files -------------------------------------------------------------------------------


def test_crc32c_known_vector():
  assert metrics_writer.crc32c(b"123456789") == 0xE3069283


def test_event_file_is_readable_by_tensorboard(tmp_path):
  with metrics_writer.MetricsWriter(str(tmp_path)) as w:
    w.write_scalars(3, {"train/loss": 2.5, "train/lr": 1e-3})
    w.write_scalars(7, {"train/loss": 1.25})
  # Check the TFRecord framing and CRCs ourselves ...
  blob = open(w.path, "rb").read()
  records, pos = [], 0
  while pos < len(blob):
    (n,) = struct.unpack("<Q", blob[pos : pos + 8])
    assert struct.unpack("<I", blob[pos + 8 : pos + 12])[0] == metrics_writer._masked_crc(
      blob[pos : pos + 8]
    )
    payload = blob[pos + 12 : pos + 12 + n]
    assert struct.unpack("<I", blob[pos + 12 + n : pos + 16 + n])[0] == metrics_writer._masked_crc(
      payload
    )
    records.append(payload)
    pos += 16 + n
  assert len(records) == 3
  lines = [json.loads(l) for l in open(tmp_path / "metrics.jsonl")]
  assert lines == [
    {"step": 3, "train/loss": 2.5, "train/lr": 1e-3},
    {"step": 7, "train/loss": 1.25},
  ]
  # ... and with TensorBoard's own reader when it is installed.
  ea = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
  acc = ea.EventAccumulator(str(tmp_path))
  acc.Reload()
  assert [(s.step, s.value) for s in acc.Scalars("train/loss")] == [(3, 2.5), (7, 1.25)]
  assert acc.Scalars("train/lr")[0].value == pytest.approx(1e-3)


# ---- training ------------------------------------------------------------------------------------


def test_tiny_run_lowers_the_loss_and_writes_metrics(tmp_path):
  config, tc = _test_setup()
  tok = Tokenizer.bundled()
  val = data_lib.PackedDataset.from_corpus(
    tok, data_lib.VALIDATION, seq_len=tc.seq_len, batch_size=tc.batch_size, shuffle=False
  )
  before = trainer.evaluate(
    trainer.make_eval_step(config, tc),
    target_lib.init_params(config, tc.seed),
    val,
    tc.eval_batches,
  )
  result = trainer.train(config, tc, str(tmp_path), tok, progress=False)
  assert result.step == tc.num_steps
  after = result.history[-1]
  assert after["lm_loss"] < before["lm_loss"] - 0.5, (before, after)
  assert after["mtp_loss_0"] < before["mtp_loss_0"] - 0.5, (before, after)
  assert [h["step"] for h in result.history] == [6, 12]
  lines = [json.loads(l) for l in open(tmp_path / "tb" / "metrics.jsonl")]
  train_lines = [l for l in lines if "train/loss" in l]
  assert train_lines[-1]["train/loss"] < train_lines[0]["train/loss"]
  assert all(l["train/tokens_per_s"] > 0 for l in train_lines)
  assert glob.glob(str(tmp_path / "tb" / "events.out.tfevents.*"))
  counts = trainer.count_params(config, result.params)
  assert counts["active"] < counts["main"] <= counts["total"]


def _launch(workdir: str, *extra: str) -> subprocess.Popen:
  """Starts launch/train_target.py; its log goes to <workdir>.log (a pipe could fill up)."""
  cmd = [
    sys.executable,
    "-m",
    "launch.train_target",
    "--config=configs/tiny_code.py:test_target",
    f"--workdir={workdir}",
    "--progress=false",
    "--export_dir=",
    *extra,
  ]
  env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
  log = open(workdir + ".log", "a")
  return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)


def _wait(proc: subprocess.Popen, workdir: str, timeout: float) -> str:
  proc.wait(timeout=timeout)
  with open(workdir + ".log") as f:
    return f.read()


def _steps(workdir: str) -> list[int]:
  return (
    sorted(int(d) for d in os.listdir(os.path.join(workdir, "checkpoints")) if d.isdigit())
    if os.path.isdir(os.path.join(workdir, "checkpoints"))
    else []
  )


@pytest.mark.slow
def test_sigkill_and_resume_reaches_the_uninterrupted_parameters(tmp_path):
  """A run SIGKILLed after a checkpoint and restarted ends bit-identical to a straight run."""
  config, tc = _test_setup()
  straight, killed = str(tmp_path / "straight"), str(tmp_path / "killed")
  ref = _launch(straight)
  # The interrupted run sleeps after each step so that the kill lands mid-run.
  proc = _launch(killed, "--config.train.step_delay_s=0.5")
  deadline = time.time() + 600
  while not _steps(killed) and proc.poll() is None and time.time() < deadline:
    time.sleep(0.05)
  proc.send_signal(signal.SIGKILL)
  err = _wait(proc, killed, 60)
  at_kill = _steps(killed)
  assert proc.returncode == -signal.SIGKILL, err[-3000:]
  assert at_kill and max(at_kill) < tc.num_steps, f"no mid-run checkpoint: {at_kill}"
  resumed = _launch(killed)
  err = _wait(resumed, killed, 600)
  assert resumed.returncode == 0, err[-3000:]
  assert f"resumed from checkpoint at step {max(at_kill)}" in err
  err = _wait(ref, straight, 600)
  assert ref.returncode == 0, err[-3000:]
  p_ref, s_ref = trainer.load_params(straight, config, tc)
  p_res, s_res = trainer.load_params(killed, config, tc)
  assert s_ref == s_res == tc.num_steps
  for (path, a), b in zip(
    jax.tree_util.tree_leaves_with_path(p_ref), jax.tree_util.tree_leaves(p_res)
  ):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=str(path))
