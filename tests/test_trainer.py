"""Tests of the training stack: losses, optimizer, metrics files, and kill-and-resume.

The runs use `configs/tiny_code.py:test_target` (a 2-layer GLM-MoE with one MTP layer,
width 32) on the stdlib corpus: a dozen steps take seconds. The drafter trainer's kill-and-resume
test uses `test_dflash` on the bundled target.
"""

from __future__ import annotations

import glob
import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from tensorboard.backend.event_processing import event_accumulator, event_file_loader
from tensorboard.compat.proto import event_pb2

from configs import tiny_code
from jaxspec.io.tokenizer import Tokenizer
from jaxspec.models import target as target_lib
from jaxspec.train import data as data_lib
from jaxspec.train import distill, losses, metrics_writer, optim, trainer

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


def _events(path: str) -> list:
  """The events of one event file, as TensorBoard's own loader reads them."""
  return list(event_file_loader.LegacyEventFileLoader(path).Load())


def test_event_file_is_readable_by_tensorboard(tmp_path):
  with metrics_writer.MetricsWriter(str(tmp_path)) as w:
    w.write_scalars(3, {"train/loss": 2.5, "train/lr": 1e-3})
    w.write_scalars(7, {"train/loss": 1.25})
  assert glob.glob(str(tmp_path / "events.out.tfevents.*")) == [w.path]
  events = _events(w.path)
  assert [e.WhichOneof("what") for e in events] == ["file_version", "summary", "summary"]
  assert events[0].file_version == "brain.Event:2"
  assert [[v.tag for v in e.summary.value] for e in events[1:]] == [
    ["train/loss", "train/lr"],
    ["train/loss"],
  ]
  lines = [json.loads(l) for l in open(tmp_path / "metrics.jsonl")]
  assert lines == [
    {"step": 3, "train/loss": 2.5, "train/lr": 1e-3},
    {"step": 7, "train/loss": 1.25},
  ]
  acc = event_accumulator.EventAccumulator(str(tmp_path))
  acc.Reload()
  assert [(s.step, s.value) for s in acc.Scalars("train/loss")] == [(3, 2.5), (7, 1.25)]
  assert acc.Scalars("train/lr")[0].value == pytest.approx(1e-3)


def test_flush_puts_the_events_on_disk(tmp_path):
  """The trainer flushes before each checkpoint: what was written is then in the file."""
  w = metrics_writer.MetricsWriter(str(tmp_path), resume_step=0)
  try:
    w.write_scalars(1, {"train/loss": 1.0})
    w.flush()
    assert [e.step for e in _events(w.path)] == [0, 1, 1]
  finally:
    w.close()


# ---- training ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def straight_run(tmp_path_factory) -> tuple[str, trainer.TrainResult]:
  """(workdir, result) of an uninterrupted test_target run in this process: checked by the
  next test, and the reference that the interrupted runs must reproduce bit for bit."""
  config, tc = _test_setup()
  workdir = str(tmp_path_factory.mktemp("straight"))
  return workdir, trainer.train(config, tc, workdir, Tokenizer.bundled(), progress=False)


def test_tiny_run_lowers_the_loss_and_writes_metrics(straight_run):
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
  workdir, result = straight_run
  out = pathlib.Path(workdir)
  assert result.step == tc.num_steps
  after = result.history[-1]
  assert after["lm_loss"] < before["lm_loss"] - 0.5, (before, after)
  assert after["mtp_loss_0"] < before["mtp_loss_0"] - 0.5, (before, after)
  assert [h["step"] for h in result.history] == [6, 12]
  lines = [json.loads(l) for l in open(out / "tb" / "metrics.jsonl")]
  train_lines = [l for l in lines if "train/loss" in l]
  assert train_lines[-1]["train/loss"] < train_lines[0]["train/loss"]
  assert all(l["train/tokens_per_s"] > 0 for l in train_lines)
  assert glob.glob(str(out / "tb" / "events.out.tfevents.*"))
  counts = trainer.count_params(config, result.params)
  assert counts["active"] < counts["main"] <= counts["total"]


def _launch(
  workdir: str,
  *extra: str,
  script: str = "launch.train_target",
  config: str = "test_target",
  driver: str | None = None,
) -> subprocess.Popen:
  """Starts `python -m <script>` on a tiny_code config, or `python <driver> <script>` (a driver
  that runs the script, see `_kill_driver`); its log goes to <workdir>.log (a pipe could fill
  up)."""
  cmd = [
    sys.executable,
    *(["-m"] if driver is None else [driver]),
    script,
    f"--config=configs/tiny_code.py:{config}",
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


# ---- interruption and resume ---------------------------------------------------------------------


def _event_steps(path: str) -> list[tuple[int, bool]]:
  """(step, is a SessionLog START) of each event of an event file."""
  start = event_pb2.SessionLog.START
  return [
    (e.step, e.HasField("session_log") and e.session_log.status == start) for e in _events(path)
  ]


def test_resumed_metrics_drop_the_rows_past_the_checkpoint(tmp_path):
  with metrics_writer.MetricsWriter(str(tmp_path), resume_step=0) as w:
    for step in (2, 4, 6):
      w.write_scalars(step, {"train/loss": float(step)})
  with open(tmp_path / "metrics.jsonl", "a") as f:
    f.write('{"step": 8, "train/lo')  # a row cut short by SIGKILL
  with metrics_writer.MetricsWriter(str(tmp_path), resume_step=4) as w:
    assert w.dropped_rows == 2
    w.write_scalars(6, {"train/loss": 60.0})
  lines = [json.loads(l) for l in open(tmp_path / "metrics.jsonl")]
  assert lines == [
    {"step": 2, "train/loss": 2.0},
    {"step": 4, "train/loss": 4.0},
    {"step": 6, "train/loss": 60.0},
  ]
  # TensorBoard drops the events of steps ≥ 5 read before a SessionLog START at step 5 ...
  assert _event_steps(w.path) == [(0, False), (5, True), (6, False)]
  assert sorted(glob.glob(str(tmp_path / "events.out.tfevents.*")))[-1] == w.path  # read last
  acc = event_accumulator.EventAccumulator(str(tmp_path))  # ... as its own reader confirms.
  acc.Reload()
  assert [(s.step, s.value) for s in acc.Scalars("train/loss")] == [(2, 2.0), (4, 4.0), (6, 60.0)]


def _toy_loop(workdir: str, total: int, on_step=lambda step: None, wrap_save=None):
  """run_loop on a model-free state (params: a counter), checkpoints every 4 steps."""
  state = {
    "step": jnp.int32(0),
    "params": jnp.zeros(3),
    "best_val": jnp.float32(jnp.inf),
    "bad_evals": jnp.int32(0),
  }
  manager = trainer.checkpoint_manager(workdir)
  if wrap_save is not None:
    manager.save = wrap_save(manager.save)
  state, restored = trainer.restore_latest(manager, state)
  start = 0 if restored is None else int(state["step"])

  def train_step(s, batch):
    del batch
    on_step(int(s["step"]) + 1)
    return dict(s, step=s["step"] + 1, params=s["params"] + 1), {"loss": jnp.float32(1.0)}

  return trainer.run_loop(
    state,
    train_step,
    lambda s: None,
    lambda params: {"lm_loss": 1.0},
    manager,
    workdir=workdir,
    total=total,
    start=start,
    per_epoch=100,
    tokens_per_step=1,
    eval_every=1000,
    loop=trainer.LoopConfig(log_every=1, checkpoint_every=4),
    progress=False,
  )


def _ctrl_c():
  os.kill(os.getpid(), signal.SIGINT)


def _train_rows(workdir) -> list[int]:
  rows = [json.loads(l) for l in open(os.path.join(workdir, "tb", "metrics.jsonl"))]
  return [r["step"] for r in rows if "train/loss" in r]


def test_ctrl_c_checkpoints_the_step_and_resume_logs_each_step_once(tmp_path):
  workdir = str(tmp_path)
  handler = signal.getsignal(signal.SIGINT)
  # Ctrl-C during step 6: the step completes, is checkpointed, and training stops.
  with pytest.raises(trainer.TrainingInterrupted, match="stopped at step 6") as e:
    _toy_loop(workdir, 10, on_step=lambda s: s == 6 and _ctrl_c())
  assert isinstance(e.value, KeyboardInterrupt) and e.value.step == 6
  assert signal.getsignal(signal.SIGINT) is handler  # restored
  assert _steps(workdir) == [4, 6] and _train_rows(workdir) == [1, 2, 3, 4, 5, 6]
  # A second Ctrl-C stops at once, inside step 9: the last checkpoint is step 8's.
  with pytest.raises(KeyboardInterrupt) as e:
    _toy_loop(workdir, 12, on_step=lambda s: s == 9 and (_ctrl_c(), _ctrl_c()))
  assert not isinstance(e.value, trainer.TrainingInterrupted)
  assert _steps(workdir) == [6, 8] and _train_rows(workdir) == list(range(1, 9))
  # Rows past the checkpoint, as a process killed after logging steps 9 and 10 leaves them ...
  with open(os.path.join(workdir, "tb", "metrics.jsonl"), "a") as f:
    f.writelines(json.dumps({"step": s, "train/loss": -1.0}) + "\n" for s in (9, 10))
  # ... are dropped by the resumed run, which logs steps 9-12 once.
  result = _toy_loop(workdir, 12)
  assert result.step == 12 and _train_rows(workdir) == list(range(1, 13))
  rows = [json.loads(l) for l in open(os.path.join(workdir, "tb", "metrics.jsonl"))]
  assert all(r["train/loss"] == 1.0 for r in rows if "train/loss" in r)
  assert float(result.params[0]) == 12.0
  # TensorBoard reads the three runs' event files in order: each step once.
  acc = event_accumulator.EventAccumulator(os.path.join(workdir, "tb"))
  acc.Reload()
  assert [s.step for s in acc.Scalars("train/loss")] == list(range(1, 13))


def test_second_ctrl_c_during_a_save_lets_it_complete(tmp_path):
  def wrap_save(save):
    def interrupted_save(step, **kwargs):
      _ctrl_c()  # the second Ctrl-C (the first came during step 3)
      return save(step, **kwargs)

    return interrupted_save

  with pytest.raises(KeyboardInterrupt):
    _toy_loop(str(tmp_path), 10, on_step=lambda s: s == 3 and _ctrl_c(), wrap_save=wrap_save)
  assert _steps(str(tmp_path)) == [3]
  assert not [d for d in os.listdir(tmp_path / "checkpoints") if "tmp" in d]
  with trainer.checkpoint_manager(str(tmp_path)) as manager:
    state, step = trainer.restore_latest(
      manager,
      {
        "step": jnp.int32(0),
        "params": jnp.zeros(3),
        "best_val": jnp.float32(0),
        "bad_evals": jnp.int32(0),
      },
    )
  assert step == 3 and float(state["params"][0]) == 3.0


@pytest.mark.slow
def test_ctrl_c_stops_the_launch_script_in_one_line_and_resumes(tmp_path):
  """SIGINT mid-run: status 130, one message and no traceback, a restorable checkpoint of the
  step reached; the resumed run finishes with each step's metrics logged once."""
  config, tc = _test_setup()
  workdir = str(tmp_path / "run")
  proc = _launch(workdir, "--config.train.step_delay_s=0.5", "--config.train.log_every=1")
  deadline = time.time() + 600
  while not _steps(workdir) and proc.poll() is None and time.time() < deadline:
    time.sleep(0.05)
  proc.send_signal(signal.SIGINT)
  log = _wait(proc, workdir, 120)
  assert proc.returncode == 130, log[-3000:]
  assert "Traceback" not in log, log[-3000:]
  messages = [l for l in log.splitlines() if l.startswith("jaxspec:")]
  assert len(messages) == 1 and messages[0].startswith("jaxspec: interrupted: training stopped")
  assert log.rstrip().splitlines()[-1] == messages[0]
  at_stop = max(_steps(workdir))
  assert f"stopped at step {at_stop};" in messages[0] and at_stop < tc.num_steps
  params, step = trainer.load_params(workdir, config, tc)
  assert step == at_stop and jax.tree_util.tree_leaves(params)
  resumed = _launch(workdir, "--config.train.log_every=1")
  log = _wait(resumed, workdir, 600)
  assert resumed.returncode == 0, log[-3000:]
  assert f"resumed from checkpoint at step {at_stop}" in log
  rows = [json.loads(l) for l in open(os.path.join(workdir, "tb", "metrics.jsonl"))]
  for kind in ("train/loss", "val/lm_loss"):
    steps = [r["step"] for r in rows if kind in r]
    assert steps == sorted(set(steps)), (kind, steps)
  assert [r["step"] for r in rows if "train/loss" in r] == list(range(1, tc.num_steps + 1))
  acc = event_accumulator.EventAccumulator(os.path.join(workdir, "tb"))
  acc.Reload()
  assert [s.step for s in acc.Scalars("train/loss")] == list(range(1, tc.num_steps + 1))


# ---- killed during a checkpoint save -------------------------------------------------------------

# Written into a test's tmp_path (`_kill_driver`) and run as `python <driver> <module> <flags>`: it
# runs `python -m <module> <flags>` and SIGKILLs itself in the middle of one checkpoint save. orbax
# writes step S into `S.orbax-checkpoint-tmp/` (the state's item directory inside it under a tmp
# name too) and commits it by renaming: first the item directory, then, as its last act, the step
# directory to `S/`. The kill lands at one of those renames, with the files written but the step
# not committed: "mid_save" at the first rename (the arrays on disk, the item and the step still
# tmp directories), "before_commit" at the step directory's (every file written, commit_success
# markers included; only the rename is missing). Patching os.rename keeps library code free of
# test hooks; if orbax ever stops renaming, the run is not killed and the test says so.
_KILL_DRIVER = """\
import os
import runpy
import signal
import sys

STEP, AT = {step}, {at!r}
TMP = f"{{STEP}}.orbax-checkpoint-tmp"
_rename = os.rename


def rename_or_die(src, dst, *args, **kwargs):
  path = os.fspath(src)
  if AT == "mid_save":  # the first rename in (or of) the step's tmp directory
    die = os.sep + TMP in path
  else:  # "before_commit": the rename of the step's tmp directory itself
    die = os.path.basename(path).startswith(TMP)
  if die:
    os.kill(os.getpid(), signal.SIGKILL)
  return _rename(src, dst, *args, **kwargs)


os.rename = rename_or_die
runpy.run_module(sys.argv.pop(1), run_name="__main__", alter_sys=True)
"""


def _kill_driver(tmp_path: pathlib.Path, step: int, at: str) -> str:
  """Writes the `_KILL_DRIVER` that kills a run inside step `step`'s save, at `at`."""
  assert at in ("mid_save", "before_commit")
  path = tmp_path / f"kill_{at}_{step}.py"
  path.write_text(_KILL_DRIVER.format(step=step, at=at))
  return str(path)


def _assert_killed_in_save(proc: subprocess.Popen, workdir: str, step: int) -> list[int]:
  """Checks that a `_kill_driver` run died by SIGKILL inside step's save, leaving the step
  half-written as a tmp directory only; returns the complete steps on disk."""
  log = _wait(proc, workdir, 600)
  assert proc.returncode == -signal.SIGKILL, log[-3000:]
  partial = glob.glob(os.path.join(workdir, "checkpoints", f"{step}.orbax-checkpoint-tmp*"))
  assert len(partial) == 1, os.listdir(os.path.join(workdir, "checkpoints"))
  assert any(files for _, _, files in os.walk(partial[0])), "the save wrote nothing"
  complete = _steps(workdir)
  assert complete and step not in complete and max(complete) < step, complete
  return complete


def _latest_state(workdir: str) -> tuple[int, list[tuple[str, np.ndarray]]]:
  """(step, [(path, leaf)]) of the latest checkpoint: the whole saved state (parameters,
  optimizer state, early-stopping counters), read as saved, without a template."""
  with trainer.checkpoint_manager(workdir, remove_partial=False) as manager:
    step = manager.latest_step()
    state = manager.restore(step, args=ocp.args.StandardRestore())
  leaves = jax.tree_util.tree_leaves_with_path(state)
  return step, [(jax.tree_util.keystr(p), np.asarray(x)) for p, x in leaves]


def _metric_rows(workdir: str) -> list[dict]:
  """The rows of metrics.jsonl without the wall-clock throughput."""
  with open(os.path.join(workdir, "tb", "metrics.jsonl")) as f:
    rows = [json.loads(l) for l in f]
  return [{k: v for k, v in r.items() if k != "train/tokens_per_s"} for r in rows]


def _assert_same_run(straight: str, resumed: str, total: int) -> None:
  """The resumed run ends where the straight one does: the same final state bit for bit, the
  same metrics rows (each step once, in TensorBoard too), and no partial checkpoint left."""
  (s_ref, ref), (s_res, res) = _latest_state(straight), _latest_state(resumed)
  assert s_ref == s_res == total
  assert [p for p, _ in res] == [p for p, _ in ref]
  assert any("opt_state" in p for p, _ in ref)
  for (path, a), (_, b) in zip(ref, res):
    np.testing.assert_array_equal(b, a, err_msg=path)
  assert not glob.glob(os.path.join(resumed, "checkpoints", "*.orbax-checkpoint-tmp*"))
  assert _metric_rows(resumed) == _metric_rows(straight)
  steps = []
  for workdir in (straight, resumed):
    acc = event_accumulator.EventAccumulator(os.path.join(workdir, "tb"))
    acc.Reload()
    steps.append([s.step for s in acc.Scalars("train/loss")])
  assert steps[1] == steps[0] and steps[0][-1] == total


@pytest.mark.parametrize("at", ["mid_save", pytest.param("before_commit", marks=pytest.mark.slow)])
def test_sigkill_during_a_save_resumes_from_the_last_complete_checkpoint(
  at, straight_run, tmp_path
):
  """A target run SIGKILLed while writing step 8's checkpoint restarts from step 6's, the last
  complete one, and ends bit-identical to an uninterrupted run."""
  _, tc = _test_setup()
  killed = str(tmp_path / "killed")
  proc = _launch(killed, driver=_kill_driver(tmp_path, 8, at))
  assert _assert_killed_in_save(proc, killed, 8) == [4, 6]
  resumed = _launch(killed)
  log = _wait(resumed, killed, 600)
  assert resumed.returncode == 0, log[-3000:]
  assert "resumed from checkpoint at step 6\n" in log, log[-3000:]
  _assert_same_run(straight_run[0], killed, tc.num_steps)


@pytest.mark.slow
def test_drafter_run_sigkilled_during_a_save_resumes_from_the_last_complete_checkpoint(
  target, tmp_path
):
  """The same for the drafter trainer (launch/train_drafter.py, DFlash), killed as it commits
  step 8's checkpoint: every file is written but the step is not, and it is not restored."""
  config = tiny_code.get_config("test_dflash")
  data = str(tmp_path / "distill")  # built once here, read by every run
  for section, out in (
    (config.distill, data),
    (config.val_distill, os.path.join(data, "validation")),
  ):
    distill.build(target, target.tokenizer, distill.DistillConfig.from_mapping(section), out)

  def launch(workdir: str, **kwargs) -> subprocess.Popen:
    flag = f"--config.distill_dir={data}"
    return _launch(workdir, flag, script="launch.train_drafter", config="test_dflash", **kwargs)

  straight, killed = str(tmp_path / "straight"), str(tmp_path / "killed")
  ref = launch(straight)
  proc = launch(killed, driver=_kill_driver(tmp_path, 8, "before_commit"))
  assert _assert_killed_in_save(proc, killed, 8) == [4, 6]
  resumed = launch(killed)
  log = _wait(resumed, killed, 600)
  assert resumed.returncode == 0, log[-3000:]
  assert "resumed from checkpoint at step 6\n" in log, log[-3000:]
  ref_log = _wait(ref, straight, 600)
  assert ref.returncode == 0, ref_log[-3000:]
  assert "reusing the distillation data" in log and "reusing the distillation data" in ref_log
  _assert_same_run(straight, killed, config.train.num_steps)
