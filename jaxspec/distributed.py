"""Several processes (hosts) running one jaxspec program: jax.distributed and the host boundary.

Multi-host JAX is SPMD: every process runs the same script on its own devices, the mesh spans
the devices of all of them (`sharding.make_mesh` over `jax.devices()`), and XLA's collectives
join them (on CPU through gloo, JAX 0.10's default `jax_cpu_collectives_implementation`). This
module holds what that needs at the edges of a program:

* `define_flags` / `config_from_flags`: `--coordinator_address --num_processes --process_id`,
  each read from JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID when unset;
* `initialize`: `jax.distributed.initialize` exactly once, before any JAX computation, with
  a bounded `--heartbeat_timeout` (`joined` answers the settings joined);
* `is_leader`: process 0, the one that reads the inputs and prints;
* `broadcast` / `on_leader`: the leader's inputs (token ids, request values), or the error
  reading them raised, to every process;
* `gather` and `put`: host values of arrays that span processes, and global arrays from host
  values that every process holds;
* `kv_client`: the coordinator's key-value store, a host-side channel that needs no collective
  (the multi-host server's ticks, jaxspec/serve/multihost.py).

One process (no flags, no environment) is the default and needs none of it: every function
here is then a plain local operation.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from absl import flags
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxspec import errors
from jaxspec import sharding as sharding_lib
from jaxspec.errors import ConfigError

FLAGS = flags.FLAGS

# Environment variables read when the flags are unset (JAX itself reads the first).
ENV = {
  "coordinator_address": "JAX_COORDINATOR_ADDRESS",
  "num_processes": "JAX_NUM_PROCESSES",
  "process_id": "JAX_PROCESS_ID",
}

# Seconds without a process's heartbeat after which JAX's coordination service declares it
# dead and ends every process of the run (JAX's own default, 100 s, is long for a server that an
# orchestrator should restart; the multi-host server's watchdog acts at half of it).
HEARTBEAT_TIMEOUT_S = 20


@dataclasses.dataclass(frozen=True)
class DistributedConfig:
  """Where the coordinator listens, how many processes there are, which one this is, and how
  long a silent one is waited for."""

  coordinator_address: str
  num_processes: int
  process_id: int
  # A process silent this long (dead, hung, cut off) ends the whole run (`initialize`).
  heartbeat_timeout_s: int = HEARTBEAT_TIMEOUT_S

  def __post_init__(self):
    host, sep, port = self.coordinator_address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
      raise ConfigError(
        f"coordinator address {self.coordinator_address!r} is not host:port (say "
        "10.0.0.1:1234): process 0 listens there and every process connects to it"
      )
    for name in ("num_processes", "process_id"):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ConfigError(f"{name} must be an integer, got {value!r}")
    if self.num_processes < 1:
      raise ConfigError(f"num_processes must be >= 1, got {self.num_processes}")
    if not 0 <= self.process_id < self.num_processes:
      raise ConfigError(
        f"process_id {self.process_id} is outside [0, num_processes={self.num_processes})"
      )
    timeout = self.heartbeat_timeout_s
    if isinstance(timeout, bool) or not isinstance(timeout, (int, np.integer)) or timeout < 2:
      raise ConfigError(f"heartbeat_timeout_s must be an integer >= 2 seconds, got {timeout!r}")


def define_flags() -> None:
  """Defines --coordinator_address, --num_processes and --process_id (once per program)."""
  if "coordinator_address" in FLAGS:
    return
  flags.DEFINE_string(
    "coordinator_address",
    None,
    f"host:port of process 0's coordinator, for multi-host runs (else ${ENV['coordinator_address']}).",
  )
  flags.DEFINE_integer(
    "num_processes",
    None,
    f"Processes (hosts) in a multi-host run (else ${ENV['num_processes']}; unset: one).",
  )
  flags.DEFINE_integer(
    "process_id",
    None,
    f"This process's index in [0, num_processes), 0 = the leader (else ${ENV['process_id']}).",
  )
  flags.DEFINE_integer(
    "heartbeat_timeout",
    HEARTBEAT_TIMEOUT_S,
    "Multi-host: seconds a process may go without a heartbeat before the run counts it as lost "
    "and ends every process (a restart is the orchestrator's).",
    lower_bound=2,
  )
  for name in [*ENV, "heartbeat_timeout"]:  # listed by the script's --help, as its own flags are
    FLAGS.register_key_flag_for_module(sys.argv[0], FLAGS[name])


def _env_int(name: str) -> int | None:
  raw = os.environ.get(name)
  if raw is None or raw.strip() == "":
    return None
  try:
    return int(raw)
  except ValueError:
    raise ConfigError(f"${name}={raw!r} is not an integer") from None


def resolve(
  coordinator_address: str | None = None,
  num_processes: int | None = None,
  process_id: int | None = None,
  heartbeat_timeout_s: int | None = None,
) -> DistributedConfig | None:
  """The multi-process settings from these values, each unset one from its environment
  variable; None for a single process (none of the three anywhere, or num_processes == 1).
  `heartbeat_timeout_s` (None: `HEARTBEAT_TIMEOUT_S`) bounds how long a lost process goes
  unnoticed.

  Raises:
    ConfigError: for an incomplete set (say a process id without a coordinator address) or
      values that cannot describe a run (process_id ≥ num_processes, a bad address).
  """
  values = {
    "coordinator_address": coordinator_address
    or os.environ.get(ENV["coordinator_address"])
    or None,
    "num_processes": num_processes if num_processes is not None else _env_int(ENV["num_processes"]),
    "process_id": process_id if process_id is not None else _env_int(ENV["process_id"]),
  }
  given = [k for k, v in values.items() if v is not None]
  if not given:
    return None
  if values["num_processes"] == 1 and values["process_id"] in (None, 0):
    return None  # one process: nothing to coordinate
  missing = [k for k in values if values[k] is None]
  if missing:
    have = ", ".join(f"{k}={values[k]}" for k in given)
    need = ", ".join(f"--{k} (${ENV[k]})" for k in missing)
    raise ConfigError(
      f"a multi-process run needs --coordinator_address, --num_processes and --process_id "
      f"together; got {have} but not {need}"
    )
  if heartbeat_timeout_s is not None:
    values["heartbeat_timeout_s"] = heartbeat_timeout_s
  return DistributedConfig(**values)


def config_from_flags() -> DistributedConfig | None:
  """`resolve` of the flags `define_flags` defined (after absl parsed them)."""
  return resolve(
    FLAGS.coordinator_address, FLAGS.num_processes, FLAGS.process_id, FLAGS.heartbeat_timeout
  )


_initialized: DistributedConfig | None = None


def initialize(config: DistributedConfig | None = None) -> DistributedConfig | None:
  """Joins the multi-process run `config` describes (None: `resolve()` from the environment).

  Calls `jax.distributed.initialize` exactly once per process: a second call with the same
  settings does nothing, one with other settings is a ConfigError. A single process (None)
  initialises nothing. It must run before any JAX computation, since the backend learns the
  other processes' devices when it starts.

  A process that dies, hangs or is cut off stops sending heartbeats to the coordinator (hosted
  by process 0); after `config.heartbeat_timeout_s` the coordination service ends every
  process of the run (JAX aborts them: a non-zero exit), so none is left waiting on it for
  good. A process whose coordinator closes (process 0 died) is aborted at once.

  Returns:
    The settings joined, or None for a single process.
  """
  global _initialized
  config = resolve() if config is None else config
  if config is None:
    return None
  if _initialized is not None:
    if config != _initialized:
      raise ConfigError(f"jax.distributed is already initialised as {_initialized}, not {config}")
    return config
  if jax.distributed.is_initialized():
    raise ConfigError("jax.distributed was initialised outside jaxspec.distributed.initialize")
  try:
    jax.distributed.initialize(
      coordinator_address=config.coordinator_address,
      num_processes=config.num_processes,
      process_id=config.process_id,
      heartbeat_timeout_seconds=int(config.heartbeat_timeout_s),
    )
  except RuntimeError as e:
    if "before any JAX computations" in str(e):
      raise ConfigError(
        "jaxspec.distributed.initialize must run before any JAX computation (the backend "
        "fixes its devices when it starts): call it first thing in main()"
      ) from None
    raise
  _initialized = config
  return config


def joined() -> DistributedConfig | None:
  """The settings `initialize` joined in this process; None before (or for one process)."""
  return _initialized


def is_leader() -> bool:
  """True on process 0 (and in a single-process run): it reads the inputs and prints."""
  return jax.process_index() == 0


def broadcast(value: Any) -> Any:
  """The leader's `value` (anything JSON can hold: token ids, request values) on every
  process; what the other processes pass is ignored (None will do). Every process must call
  it, in the same order. Lists come back for tuples, as JSON reads them."""
  if jax.process_count() == 1:
    return json.loads(json.dumps(value))
  payload = json.dumps(value).encode() if is_leader() else b""
  size = int(multihost_utils.broadcast_one_to_all(np.int32(len(payload))))
  buffer = np.zeros((size,), np.uint8)
  if is_leader():
    buffer[:] = np.frombuffer(payload, np.uint8)
  buffer = multihost_utils.broadcast_one_to_all(buffer)
  return json.loads(np.asarray(buffer, np.uint8).tobytes().decode())


def on_leader(fn: Callable[[], Any]) -> Any:
  """`fn()` run on the leader only (say: tokenize, validate a request), its JSON-able result
  broadcast to every process. A JaxspecError it raises is raised on every process, so a bad
  input stops all of them with the leader's message instead of leaving them waiting."""
  result = None
  if is_leader():
    try:
      result = {"value": fn()}
    except errors.JaxspecError as e:
      result = {"error": str(e), "kind": type(e).__name__}
  result = broadcast(result)
  if "error" in result:
    error = getattr(errors, result["kind"], errors.JaxspecError)
    raise error(result["error"])
  return result["value"]


def _gather_one(x: Any) -> np.ndarray:
  if isinstance(x, jax.Array) and not (x.is_fully_addressable or x.is_fully_replicated):
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))
  return np.asarray(jax.device_get(x))


def gather(tree: Any) -> Any:
  """Host (numpy) copies of a tree of arrays, whole, on every process: arrays sharded over
  several processes' devices are all-gathered, the others read locally. Every process must
  call it on the same arrays (the gather is a collective)."""
  return jax.tree_util.tree_map(_gather_one, tree)


def mesh_of(tree: Any) -> Mesh | None:
  """The mesh the arrays of `tree` are placed on: the first leaf with a NamedSharding over
  more than one device, else None (single-device or host arrays)."""
  for leaf in jax.tree_util.tree_leaves(tree):
    s = getattr(leaf, "sharding", None)
    if isinstance(s, NamedSharding) and s.mesh.size > 1:
      return s.mesh
  return None


def put(tree: Any, mesh: Mesh, logical_axes: Any = None, rules: Any = None) -> Any:
  """Global arrays on `mesh` from host values that every process holds in full, each leaf
  sharded by its logical axes (None: replicated; dimensions that do not divide their mesh
  axes stay replicated). The host → device step of a multi-process program."""
  if logical_axes is None:
    logical_axes = jax.tree_util.tree_map(lambda _: PartitionSpec(), tree)
  return sharding_lib.shard_tree(
    jax.tree_util.tree_map(np.asarray, tree), logical_axes, mesh, rules
  )


def kv_client() -> Any:
  """The jax.distributed client of this process (its `key_value_set`, `blocking_key_value_get`
  and `key_value_delete` reach the coordinator's store): host-side messages that, unlike a
  broadcast, leave no process waiting inside a collective. ConfigError outside a
  multi-process run."""
  from jax._src import distributed as jax_distributed  # pylint: disable=import-outside-toplevel

  client = jax_distributed.global_state.client
  if client is None:
    raise ConfigError("no multi-process run: call jaxspec.distributed.initialize first")
  return client


__all__ = [
  "ENV",
  "HEARTBEAT_TIMEOUT_S",
  "DistributedConfig",
  "broadcast",
  "config_from_flags",
  "define_flags",
  "gather",
  "initialize",
  "is_leader",
  "joined",
  "kv_client",
  "mesh_of",
  "on_leader",
  "put",
  "resolve",
]
