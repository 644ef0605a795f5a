"""Scalar metrics as TensorBoard event files, written with tensorboardX (no TensorFlow).

Each `MetricsWriter` opens a new event file `<logdir>/events.out.tfevents.*` and appends to
`<logdir>/metrics.jsonl`, a JSON-lines copy for scripts and tests. `tensorboard --logdir
<workdir>/tb` reads the events.

The events are `tensorboardX.proto` messages framed by `tensorboardX.RecordWriter`, which
writes synchronously: `flush()` puts every event written so far on disk, as the trainer needs
before each checkpoint. `tensorboardX.SummaryWriter` hands its events to a background thread
through a queue, and its `flush()` does not write what is still queued.

A run resumed from the checkpoint of step s repeats the steps after s, which an earlier process
may already have logged. The writer then drops the rows past s from `metrics.jsonl` (rewritten
atomically) and opens its event file with a SessionLog START event at step s + 1, the marker
`SummaryWriter(purge_step=s + 1)` writes; TensorBoard, as after a restart of TensorFlow's own
writers, discards the events of step > s read before it (`purge_orphaned_data`). Every step is
thus logged once.
"""

from __future__ import annotations

import json
import os
import socket
import time
from typing import Mapping

import tensorboardX
from tensorboardX.proto import event_pb2, summary_pb2


def drop_rows_after(path: str, step: int) -> int:
  """Removes the rows of the JSON-lines file `path` whose step is beyond `step`, and any
  unreadable (say, half-written) line; rewrites the file atomically. Returns the rows dropped."""
  if not os.path.exists(path):
    return 0
  kept, dropped = [], 0
  with open(path, encoding="utf-8") as f:
    for line in f:
      try:
        keep = line.endswith("\n") and int(json.loads(line)["step"]) <= step
      except (ValueError, KeyError, TypeError):
        keep = False
      if keep:
        kept.append(line)
      else:
        dropped += 1
  if dropped:
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
      f.writelines(kept)
      f.flush()
      os.fsync(f.fileno())
    os.replace(tmp, path)
  return dropped


def _new_event_file(logdir: str) -> str:
  """The path of a new event file in `logdir`.

  TensorBoard reads a folder's event files in name order, so the name starts with the time; the
  process id, and a counter when a writer of this process took the name in the same second,
  keep two writers from sharing (and truncating) a file.
  """
  host, pid = socket.gethostname(), os.getpid()
  base = os.path.join(logdir, f"events.out.tfevents.{int(time.time())}.{host}.{pid}")
  path, n = base, 0
  while os.path.exists(path):
    n += 1
    path = f"{base}.{n:03d}"
  return path


class MetricsWriter:
  """Appends scalar summaries to `<logdir>/events.out.tfevents.*` and `<logdir>/metrics.jsonl`.

  A resumed run opens a new event file in the same folder; TensorBoard merges them by step.
  `resume_step`: the step a run (re)starts from, its restored checkpoint's (0: a fresh run);
  what earlier processes logged past it is dropped (see the module docstring). None appends to
  whatever is there.
  """

  def __init__(self, logdir: str, resume_step: int | None = None):
    os.makedirs(logdir, exist_ok=True)
    self.logdir = logdir
    self.dropped_rows = 0
    jsonl = os.path.join(logdir, "metrics.jsonl")
    if resume_step is not None:
      self.dropped_rows = drop_rows_after(jsonl, int(resume_step))
    self.path = _new_event_file(logdir)
    self._events = tensorboardX.RecordWriter(self.path)
    self._jsonl = open(jsonl, "a", encoding="utf-8")
    self._write_event(event_pb2.Event(step=0, file_version="brain.Event:2"))
    if resume_step is not None:
      # TensorBoard drops the events of steps ≥ this one that it read before this event.
      start = event_pb2.SessionLog(status=event_pb2.SessionLog.START)
      self._write_event(event_pb2.Event(step=int(resume_step) + 1, session_log=start))
    self._events.flush()

  def _write_event(self, event: event_pb2.Event) -> None:
    event.wall_time = time.time()
    self._events.write(event.SerializeToString())

  def write_scalars(self, step: int, scalars: Mapping[str, float]) -> None:
    """Writes one event holding every scalar of `scalars` at `step`."""
    scalars = {k: float(v) for k, v in scalars.items()}
    values = [summary_pb2.Summary.Value(tag=k, simple_value=v) for k, v in scalars.items()]
    self._write_event(event_pb2.Event(step=int(step), summary=summary_pb2.Summary(value=values)))
    self._jsonl.write(json.dumps({"step": int(step), **scalars}) + "\n")

  def flush(self) -> None:
    """Puts what was written so far on disk (the event file is also fsynced)."""
    self._events.flush()
    self._jsonl.flush()

  def close(self) -> None:
    """Flushes, then closes both files."""
    self.flush()
    self._events.close()
    self._jsonl.close()

  def __enter__(self) -> "MetricsWriter":
    return self

  def __exit__(self, *exc) -> None:
    self.close()
