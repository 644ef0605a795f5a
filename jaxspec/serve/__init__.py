"""Serving: continuous batching over the engine's slots (scheduler.py)."""

from jaxspec.serve.handles import (
  Delta,
  QueueFull,
  RequestHandle,
  SamplingOptions,
  SchedulerClosed,
)
from jaxspec.serve.scheduler import Scheduler

__all__ = ["Delta", "QueueFull", "RequestHandle", "SamplingOptions", "Scheduler", "SchedulerClosed"]
