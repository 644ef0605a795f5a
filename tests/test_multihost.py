"""Two processes, one program: generation over a mesh spanning both (jax.distributed on CPU).

Two local processes with 4 virtual CPU devices each join through a coordinator on a free
localhost port (jaxspec.distributed, settings from the environment as a cluster launcher would
set them) and run the same script: restore an orbax checkpoint onto a (data=2, expert=2,
tensor=2) mesh over all 8 devices, take the leader's inputs by broadcast, generate greedily
(plain and DFlash chain; plain with quantized experts, each process quantizing its own
one-device restore and the engine placing the QTensors) and save the sharded model back. The tokens must equal this process's
one-device result. Both processes are killed if either outlives the timeout.
"""

from __future__ import annotations

import json
import os
import pathlib
import socket
import subprocess
import sys
import textwrap
import time

import pytest

from jaxspec import distributed
from jaxspec.errors import ConfigError
from tests import engine_models, near_ties
from tests.virtual_devices import REPO

PROMPTS = [[5, 17, 33, 8, 17, 33, 8], [40, 2, 71]]
NEW = 12
TIMEOUT_S = 420  # the processes take ~170 s at a load average of 10 on 2 cores

# Shared by the reference (this process, one device) and the processes (imported there).
DRAFTER = dict(mask_token_id=2, num_layers=1, block_size=4, target_layer_ids=(0, 1), seed=1)
# MXFP4 experts where the contraction allows it (down_proj's 16 inputs are under one 32-block),
# FP8 for the other expert matrices and attention.
POLICY = (
  ("layers_1/mlp/gate_proj", "mxfp4"),
  ("layers_1/mlp/up_proj", "mxfp4"),
  ("experts", "fp8"),
  ("attention", "fp8"),
)

# Every process script starts so: an uncaught error ends the process at once (jax.distributed's
# shutdown at exit would wait for the peers).
DIE_AT_ONCE = textwrap.dedent(r"""
    import json, os, sys, traceback

    def die(*exc):
        traceback.print_exception(*exc)
        sys.stderr.flush()
        os._exit(1)

    sys.excepthook = die
""")

SCRIPT = DIE_AT_ONCE + textwrap.dedent(r"""
    import jaxspec
    from jaxspec import distributed
    joined = distributed.initialize()  # from JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, ...
    assert distributed.initialize(joined) == joined  # once: a second call changes nothing
    try:
        distributed.initialize(distributed.DistributedConfig("localhost:1", 3, 0))
        raise AssertionError("joined a second, different run")
    except jaxspec.ConfigError:
        pass
    import jax, numpy as np
    from jax.sharding import PartitionSpec as P
    from jaxspec import sharding
    from jaxspec.io import checkpoint
    from tests.test_multihost import DRAFTER, POLICY

    ckpt, saved = sys.argv[1], sys.argv[2]
    # Only the leader has the request (argv[3]); the others learn it by broadcast.
    request = distributed.broadcast(json.loads(sys.argv[3]) if distributed.is_leader() else None)

    def refuse():  # run by the leader only; every process must raise its error
        raise jaxspec.InputError(f"refused by process {jax.process_index()}")

    try:
        distributed.on_leader(refuse)
        refused = None
    except jaxspec.InputError as e:
        refused = str(e)
    mesh = sharding.make_mesh({"data": 2, "expert": 2, "tensor": 2})
    target = checkpoint.restore(ckpt, mesh=mesh)
    experts = target.params["layers_1"]["mlp"]["gate_proj"]
    report = {
        "process": jax.process_index(), "processes": jax.process_count(),
        "devices": jax.device_count(), "local_devices": jax.local_device_count(),
        "request": request, "refused": refused,
        "expert_spec": [str(a) for a in experts.sharding.spec],
        "experts_span_processes": not experts.is_fully_addressable,
    }
    for name in ("plain", "dflash"):
        drafter = jaxspec.DFlashDrafter.random(target, **DRAFTER) if name == "dflash" else None
        engine = jaxspec.SpecEngine(target, drafter, jaxspec.EngineConfig(
            method=name, max_len=64, batch_size=2))
        out = engine.generate(request["prompts"], max_new_tokens=request["max_new_tokens"])
        report[name] = out.tokens
        report[name + "_generated"] = out.stats.tokens_generated
    # Quantized weights (MXFP4 and FP8 experts, FP8 attention), quantized by every
    # process from its own one-device copy and placed by the engine across both processes.
    quantized = jaxspec.quantize(checkpoint.restore(ckpt, mesh=None), POLICY)
    engine_q = jaxspec.SpecEngine(quantized, None, jaxspec.EngineConfig(
        method="plain", max_len=64, batch_size=2), mesh=mesh)
    q_run = engine_q.target.params["layers_1"]  # the engine decodes per layer: {"0": ...}
    q_experts = q_run.get("0", q_run)["mlp"]["gate_proj"]
    report["quantized_spans_processes"] = not q_experts.values.is_fully_addressable
    report["quantized_format"] = q_experts.format
    report["quantized"] = engine_q.generate(
        request["prompts"], max_new_tokens=request["max_new_tokens"]).tokens
    # The host boundary once the state is batch-sharded over processes (the engine's own
    # placement of its state may shard it so): inputs become global arrays, outputs and stats
    # are gathered from both processes.
    by_batch = jax.sharding.NamedSharding(mesh, P("data"))
    placed = engine._to_device(np.zeros((2, 64), np.int32), ("batch", "length"))
    report["input_spec"] = [str(a) for a in placed.sharding.spec]
    report["input_spans_processes"] = not placed.is_fully_addressable
    state = engine.run(engine.init_state(request["prompts"], request["max_new_tokens"]))
    state = state.replace(**{k: jax.device_put(getattr(state, k), by_batch)
                             for k in ("tokens", "seq_len", "prompt_len")})
    state = state.replace(stats=jax.tree.map(lambda x: jax.device_put(x, by_batch), state.stats))
    assert not state.tokens.is_fully_addressable and not state.tokens.is_fully_replicated
    report["sharded_outputs"] = engine._outputs(state, 2)
    report["sharded_generated"] = engine._stats(state, 0.0, 1.0, 2).tokens_generated
    # Save from the two-process mesh, restore again: the same values in the same layout.
    checkpoint.save(target, saved)
    again = checkpoint.restore(saved, mesh=mesh)
    a, b = jax.tree.leaves(target.params), jax.tree.leaves(again.params)
    report["resaved_equal"] = all(
        x.sharding == y.sharding and np.array_equal(u, v)
        for x, y, u, v in zip(a, b, distributed.gather(a), distributed.gather(b)))
    print(json.dumps(report))
""")


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def _start_processes(
  args: list[str], logs: pathlib.Path, n: int = 2, script: str = SCRIPT
) -> list[subprocess.Popen]:
  """Starts `script` in n processes of 4 CPU devices each, joined through a local coordinator;
  process i writes logs/i.out and logs/i.err (files, so that no pipe fills while we wait)."""
  address = f"localhost:{_free_port()}"
  logs.mkdir(parents=True, exist_ok=True)
  procs = []
  for pid in range(n):
    env = dict(
      os.environ,
      XLA_FLAGS="--xla_force_host_platform_device_count=4",
      JAX_PLATFORMS="cpu",
      JAX_COORDINATOR_ADDRESS=address,
      JAX_NUM_PROCESSES=str(n),
      JAX_PROCESS_ID=str(pid),
      PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
    )
    with open(logs / f"{pid}.out", "w") as out, open(logs / f"{pid}.err", "w") as err:
      procs.append(
        subprocess.Popen(
          [sys.executable, "-c", script, *args], stdout=out, stderr=err, env=env, cwd=REPO
        )
      )
  return procs


def _finish(procs: list[subprocess.Popen], logs: pathlib.Path, deadline: float) -> list[dict]:
  """Each process's last stdout line, parsed. When one fails the others are killed at once
  (a peer left waiting in a collective would hang), and all of them by `deadline`."""
  exited: list[int] = []  # in the order they ended
  try:
    while time.monotonic() < deadline and len(exited) < len(procs):
      exited += [i for i, p in enumerate(procs) if i not in exited and p.poll() is not None]
      if any(procs[i].returncode for i in exited):
        break
      time.sleep(0.2)
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
      p.wait()
  failed = [  # in the order they ended: a peer that lost its partner fails right after it
    f"process {i} {'exited' if i in exited else 'was killed (timeout or a failed peer)'} "
    f"({procs[i].returncode}):\n{(logs / f'{i}.err').read_text()[-3000:]}"
    for i in exited + [i for i in range(len(procs)) if i not in exited]
    if procs[i].returncode
  ]
  assert not failed, "\n".join(failed)
  return [
    json.loads((logs / f"{i}.out").read_text().strip().splitlines()[-1]) for i in range(len(procs))
  ]


@pytest.mark.timeout(TIMEOUT_S + 60)
def test_two_processes_generate_as_one_device(tmp_path):
  import jaxspec  # pylint: disable=import-outside-toplevel
  from jaxspec.io import checkpoint  # pylint: disable=import-outside-toplevel

  ckpt = str(tmp_path / "ckpt")
  checkpoint.save(engine_models.random_target(), ckpt)
  request = {"prompts": PROMPTS, "max_new_tokens": NEW}
  deadline = time.monotonic() + TIMEOUT_S
  logs = tmp_path / "logs"
  procs = _start_processes([ckpt, str(tmp_path / "resaved"), json.dumps(request)], logs)
  try:  # the one-device reference, while the processes run
    target = checkpoint.restore(ckpt)  # the layout the processes restore, on one device
    reference = {}
    for name in ("plain", "dflash"):
      drafter = jaxspec.DFlashDrafter.random(target, **DRAFTER) if name == "dflash" else None
      engine = jaxspec.SpecEngine(
        target, drafter, jaxspec.EngineConfig(method=name, max_len=64, batch_size=2)
      )
      reference[name] = engine.generate(PROMPTS, max_new_tokens=NEW).tokens
    quantized = jaxspec.quantize(target, POLICY)
    engine = jaxspec.SpecEngine(
      quantized, None, jaxspec.EngineConfig(method="plain", max_len=64, batch_size=2)
    )
    reference["quantized"] = engine.generate(PROMPTS, max_new_tokens=NEW).tokens
  finally:
    reports = _finish(procs, logs, deadline)
  assert reference["dflash"] == reference["plain"]  # lossless on one device

  for pid, r in enumerate(reports):
    assert (r["process"], r["processes"], r["devices"], r["local_devices"]) == (pid, 2, 8, 4)
    assert r["request"] == request  # process 1 got it by broadcast only
    assert r["refused"] == "refused by process 0"  # the leader's error, raised everywhere
    assert r["expert_spec"][1] == "expert" and r["experts_span_processes"], r["expert_spec"]
    for name in ("plain", "dflash"):
      near_ties.assert_greedy_match(target, PROMPTS, reference[name], r[name])
      assert r[name + "_generated"] == sum(len(t) for t in r[name])
    assert r["quantized_format"] == "mxfp4" and r["quantized_spans_processes"]  # packed, sharded
    near_ties.assert_greedy_match(quantized, PROMPTS, reference["quantized"], r["quantized"])
    assert r["resaved_equal"]
    assert r["input_spec"] == ["data", "None"] and r["input_spans_processes"]
    assert r["sharded_outputs"] == r["dflash"]
    assert r["sharded_generated"] == r["dflash_generated"]
  assert reports[0]["plain"] == reports[1]["plain"]
  assert reports[0]["dflash"] == reports[1]["dflash"]


def test_resolve_reads_flags_then_environment(monkeypatch):
  for name in distributed.ENV.values():
    monkeypatch.delenv(name, raising=False)
  assert distributed.resolve() is None  # nothing set: one process
  assert distributed.resolve(num_processes=1) is None
  cfg = distributed.resolve("10.0.0.1:1234", 4, 3)
  assert (cfg.coordinator_address, cfg.num_processes, cfg.process_id) == ("10.0.0.1:1234", 4, 3)
  monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", "host:99")
  monkeypatch.setenv("JAX_NUM_PROCESSES", "2")
  monkeypatch.setenv("JAX_PROCESS_ID", "1")
  assert distributed.resolve() == distributed.DistributedConfig("host:99", 2, 1)
  assert distributed.resolve(process_id=0).process_id == 0  # a flag wins over the environment
  monkeypatch.delenv("JAX_COORDINATOR_ADDRESS")
  with pytest.raises(ConfigError, match="coordinator_address"):
    distributed.resolve()  # incomplete: no coordinator
  bad = [
    (("host:99", 2, 2), "outside"),
    (("host:99", 0, 0), ">= 1"),
    (("host", 2, 0), "host:port"),
    (("host:port", 2, 0), "host:port"),
  ]
  for args, message in bad:
    with pytest.raises(ConfigError, match=message):
      distributed.resolve(*args)
  monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", "host:99")
  monkeypatch.setenv("JAX_PROCESS_ID", "one")
  with pytest.raises(ConfigError, match="JAX_PROCESS_ID"):
    distributed.resolve()
