"""Serving: continuous batching over the engine's slots (scheduler.py)."""

from jaxspec.serve.scheduler import (
  Delta,
  QueueFull,
  RequestHandle,
  SamplingOptions,
  Scheduler,
  SchedulerClosed,
)

__all__ = ["Delta", "QueueFull", "RequestHandle", "SamplingOptions", "Scheduler", "SchedulerClosed"]
