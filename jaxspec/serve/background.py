"""An app served by uvicorn on a loopback port in a background thread (tests, load test).

`launch/serve.py` runs uvicorn in the main thread, where it handles SIGINT/SIGTERM; this is for
a process that drives its own server, so it only ever binds a loopback address.
"""

from __future__ import annotations

import ipaddress
import socket
import threading
import time
from typing import Any

import uvicorn

from jaxspec.errors import ConfigError
from jaxspec.serve.draining import DrainingServer


class BackgroundServer:
  """Serves an ASGI app on `host` (loopback only; port 0 = a free one) in a thread.

  Use as a context manager: entering waits until the server accepts connections; leaving
  stops it gracefully: an app of `app.create_app` drains (`draining.DrainingServer`: new
  requests get 503, those in flight finish, up to `grace_s`), any other app stops listening and
  lets its requests finish, up to `grace_s`.
  """

  def __init__(self, app: Any, host: str = "127.0.0.1", port: int = 0, grace_s: float = 30):
    if not ipaddress.ip_address(host).is_loopback:
      raise ConfigError(f"a background server binds loopback addresses only, not {host!r}")
    self._sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    self._sock.bind((host, port))
    self.port = self._sock.getsockname()[1]
    self.url = f"http://{host if ':' not in host else f'[{host}]'}:{self.port}"
    config = uvicorn.Config(
      app, log_level="warning", lifespan="off", timeout_graceful_shutdown=grace_s
    )
    drain = getattr(getattr(app, "state", None), "drain", None)  # create_app's apps have one
    self.server = (
      DrainingServer(config, drain, grace_s) if drain is not None else uvicorn.Server(config)
    )
    self._grace_s = grace_s
    self._thread = threading.Thread(
      target=self.server.run, kwargs={"sockets": [self._sock]}, daemon=True
    )

  def __enter__(self) -> BackgroundServer:
    self._thread.start()
    deadline = time.monotonic() + 30
    while not self.server.started:
      if not self._thread.is_alive() or time.monotonic() > deadline:
        raise RuntimeError("the HTTP server did not start")
      time.sleep(0.01)
    return self

  def __exit__(self, *exc: Any) -> None:
    if isinstance(self.server, DrainingServer):
      self.server.drain()  # new requests get 503 while the ones in flight finish
    else:
      self.server.should_exit = True
    self._thread.join(timeout=self._grace_s + 60)
    self._sock.close()
