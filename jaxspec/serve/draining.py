"""A uvicorn server that drains before it stops, as an orchestrator's rolling restart expects.

uvicorn on SIGTERM closes its socket at once: new clients get a refused connection, which no
OpenAI client retries as "the server is going away". `DrainingServer` keeps listening instead:
the first SIGINT/SIGTERM (or `drain()`) makes the app (`app.Drain`) answer new generation
requests 503 with Retry-After and /health 503 "draining", lets the requests in flight finish
up to `drain_timeout_s`, calls `on_timeout` if some were still running then (the caller
cancels them: their clients get a 503 error rather than a cut connection), and only then
stops the way uvicorn stops. A second signal stops at once (uvicorn's own handling).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from types import FrameType

import uvicorn

from jaxspec.serve.app import Drain


class DrainingServer(uvicorn.Server):
  """uvicorn.Server whose first stop signal drains the app before the server stops."""

  def __init__(
    self,
    config: uvicorn.Config,
    drain: Drain,
    drain_timeout_s: float,
    on_timeout: Callable[[], None] | None = None,
  ):
    super().__init__(config)
    self.drain_state = drain
    self.drain_timeout_s = drain_timeout_s
    self.on_timeout = on_timeout
    self.drain_seconds: float | None = None  # how long the drain took, once it ended
    self.drained_idle: bool | None = None  # whether every request finished in time
    self._drainer: threading.Thread | None = None

  def handle_exit(self, sig: int, frame: FrameType | None) -> None:
    if self._drainer is None and not self.should_exit:
      self.drain()
    else:
      super().handle_exit(sig, frame)

  def drain(self) -> None:
    """Begins draining (once) in a thread; the server stops when it is idle or at the deadline."""
    if self._drainer is not None:
      return
    self.drain_state.begin()
    self._drainer = threading.Thread(target=self._drain_then_stop, name="drain", daemon=True)
    self._drainer.start()

  def _drain_then_stop(self) -> None:
    start = time.monotonic()
    self.drained_idle = self.drain_state.wait(self.drain_timeout_s)
    if not self.drained_idle and self.on_timeout is not None:
      self.on_timeout()
    self.drain_seconds = time.monotonic() - start
    self.should_exit = True

  def wait_drained(self, timeout: float | None = None) -> bool:
    """Blocks until the drain has ended (the server is then stopping); False on timeout."""
    if self._drainer is None:
      return False
    self._drainer.join(timeout)
    return not self._drainer.is_alive()


__all__ = ["DrainingServer"]
