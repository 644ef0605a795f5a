"""The OpenAI-compatible HTTP API over a `Scheduler`: FastAPI routes, SSE streaming, errors.

Routes: POST /v1/completions, POST /v1/chat/completions, GET /v1/models (the /v1 routes need
the Bearer key when one is set), GET /health, GET /metrics (Prometheus text), GET
/openapi.json (the request bodies' schemas, `openapi.document`). Every error is OpenAI's JSON
`{"error": {"message", "type", "param", "code"}}`: bad JSON or parameters, a request over the
engine's capacity or an unknown model → 400, a missing or wrong key → 401, a body over
`max_body_bytes` → 413, a full queue → 429 and draining or shutting down → 503 (both with
Retry-After), a request past `request_timeout_s` → 504.

Shutting down drains (`Drain`): new generation requests get 503, /health answers 503
"draining" so a balancer stops sending, and the requests in flight finish.

A request's tokens come from its `RequestHandle`; `text.TextStream` turns them into text, and a
stop string cancels the request in the scheduler. A client that goes away (mid-stream, or
while a non-streaming request is being generated) cancels its request, which frees its slot.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import hmac
import json
import threading
from collections.abc import AsyncIterator
from typing import Any

import fastapi
from fastapi import responses
from starlette import background
from starlette import exceptions as starlette_exceptions

from jaxspec.errors import InputError
from jaxspec.serve import openapi, protocol, text
from jaxspec.serve.handles import QueueFull, SamplingOptions, SchedulerClosed

SSE_DONE = b"data: [DONE]\n\n"
GENERATION_ROUTES = ("/v1/completions", "/v1/chat/completions")
ROUTES = GENERATION_ROUTES + ("/v1/models", "/health", "/metrics", "/openapi.json")
RETRY_AFTER_S = {429: 1, 503: 5}  # a full queue clears quickly; a draining server goes away

# scheduler.metrics() key → (Prometheus type, help). Keys not listed are exported as gauges.
SCHEDULER_METRICS = {
  "requests_total": ("counter", "Requests queued by the scheduler."),
  "requests_finished_total": ("counter", "Requests that ended with a stop or the length."),
  "requests_cancelled_total": ("counter", "Requests cancelled (client gone, stop string)."),
  "steps_total": ("counter", "Compiled engine steps run."),
  "requests_running": ("gauge", "Requests holding a slot."),
  "requests_waiting": ("gauge", "Requests in the waiting queue."),
  "tokens_generated_total": ("counter", "Tokens committed across all requests."),
  "target_passes_total": ("counter", "Target forward passes (verify steps)."),
  "acceptance_length": ("gauge", "Mean tokens committed per target pass."),
  "step_seconds_avg": ("gauge", "Mean seconds per compiled step."),
  "batch_occupancy": ("gauge", "Fraction of slots holding a request."),
  "slots": ("gauge", "Slots (the engine's batch size)."),
  "preemptions_total": ("counter", "Requests preempted when the KV pool ran out (resumed later)."),
  "admission_reserve": ("gauge", "Share of running requests' remaining tokens kept in pages."),
  "prompt_tokens_prefilled_total": ("counter", "Prompt tokens the target prefilled (n > 1: once)."),
  "kv_pages": ("gauge", "Pages in the paged K/V pool (0: contiguous K/V)."),
  "kv_pages_used": ("gauge", "Pages of the pool held by requests."),
  "prefix_cache_hit_tokens_total": ("counter", "Prompt tokens read from cached pages."),
  "prefix_cache_pages": ("gauge", "Pool pages the prefix cache keeps (evictable when idle)."),
  "prefix_cache_evictions_total": ("counter", "Cached pages evicted for new pages."),
  "speculation_budget": ("gauge", "The last tick's draft budget (--speculation=auto picks it)."),
  "row_bucket": ("gauge", "The rows the last tick's steps ran (the live rows' bucket)."),
}


class ApiError(Exception):
  """An error response: HTTP status and OpenAI's error fields."""

  def __init__(
    self, status: int, message: str, type_: str, param: str | None = None, code: str | None = None
  ):
    super().__init__(message)
    self.status, self.message, self.type, self.param, self.code = (
      status,
      message,
      type_,
      param,
      code,
    )

  def body(self) -> dict[str, Any]:
    """OpenAI's error body: a response's, or a stream's last event."""
    return protocol.error_body(self.message, self.type, self.param, self.code)


class _EngineFailure(Exception):
  """The scheduler ended a request with "error", or with "cancelled" that no client asked for
  (a shutdown without draining); `status` is the HTTP status of a non-streaming reply."""

  def __init__(self, message: str, status: int = 500):
    super().__init__(message)
    self.status = status


def _error_response(e: ApiError) -> responses.JSONResponse:
  return responses.JSONResponse(e.body(), status_code=e.status, headers=_error_headers(e.status))


def _error_headers(status: int) -> dict[str, str]:
  """401 names the scheme; 429 and 503 say when to come back (clients such as openai's retry
  after the time given)."""
  if status == 401:
    return {"WWW-Authenticate": "Bearer"}
  if status in RETRY_AFTER_S:
    return {"Retry-After": str(RETRY_AFTER_S[status])}
  return {}


def _draining_error() -> ApiError:
  return ApiError(
    503, "the server is draining for shutdown", "service_unavailable", code="shutting_down"
  )


class Drain:
  """Shutdown's first phase: generation requests in flight are counted; once `begin` is called
  new ones are refused (503) and `wait` returns when the last one has finished.

  Thread-safe: the HTTP loop enters and leaves; a signal handler's thread begins and waits.
  """

  def __init__(self):
    self._cv = threading.Condition()
    self._in_flight = 0
    self.started = False

  def enter(self) -> bool:
    """Counts a new request in; False (refuse it) once draining."""
    with self._cv:
      if self.started:
        return False
      self._in_flight += 1
      return True

  def leave(self) -> None:
    with self._cv:
      self._in_flight -= 1
      self._cv.notify_all()

  def begin(self) -> None:
    with self._cv:
      self.started = True
      self._cv.notify_all()

  def wait(self, timeout: float | None = None) -> bool:
    """True once no request is in flight; False if `timeout` seconds passed first."""
    with self._cv:
      return self._cv.wait_for(lambda: self._in_flight == 0, timeout)

  @property
  def in_flight(self) -> int:
    return self._in_flight


# The engine's argument names (InputError.param) as the API names the fields.
API_PARAMS = {"max_new_tokens": "max_tokens"}


def _bad_request(e: InputError, prompt_field: str = "prompt") -> ApiError:
  """400 naming the field at fault; the engine's "prompt" is chat's `messages`."""
  param = getattr(e, "param", None)
  param = prompt_field if param == "prompt" else API_PARAMS.get(param, param)
  return ApiError(400, str(e), "invalid_request_error", param)


def _sse(obj: dict[str, Any]) -> bytes:
  return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


class _StatusCounter:
  """Pure-ASGI middleware counting responses by route and status (for /metrics), and the
  generation requests in flight (`Drain`: refused with 503 once draining).

  Pure ASGI rather than a BaseHTTPMiddleware so the app's own `receive` (which reports a client
  disconnect) and streaming responses pass through untouched; the app's call returns once the
  response (a stream included) has been sent, so a request counts until its last byte.
  """

  def __init__(self, app: Any, counts: collections.Counter, drain: Drain):
    self.app, self.counts, self.drain = app, counts, drain

  async def __call__(self, scope, receive, send):
    if scope["type"] != "http":
      return await self.app(scope, receive, send)
    route = scope["path"] if scope["path"] in ROUTES else "other"

    async def counting_send(message):
      if message["type"] == "http.response.start":
        self.counts[(route, message["status"])] += 1
      await send(message)

    if route not in GENERATION_ROUTES:
      return await self.app(scope, receive, counting_send)
    if not self.drain.enter():
      return await _error_response(_draining_error())(scope, receive, counting_send)
    try:
      return await self.app(scope, receive, counting_send)
    finally:
      self.drain.leave()


@dataclasses.dataclass
class _Job:
  """One admitted request: its handle, how its text is made, and how it is reported."""

  handle: Any
  stream: text.TextStream
  rid: str
  created: int
  chat: bool
  logprobs: bool
  stream_wanted: bool
  include_usage: bool
  index: int = 0  # the choice (n > 1: one job per choice)
  keep: int = 1  # choices returned: n (best_of > n samples more and keeps the best n)
  score: float = float("-inf")  # best_of: the choice's mean log-prob per token, once collected
  finished: bool = False  # the scheduler's stream ended (or a stop string ended the request)

  def release(self) -> None:
    """Cancels the request unless it has finished: its client is gone or stopped reading."""
    if not self.finished:
      self.handle.cancel()


class _Server:
  """The state behind the routes: scheduler, tokenizer, template, limits."""

  def __init__(
    self, scheduler, model_name, api_key, max_body_bytes, chat_template, request_timeout_s
  ):
    tokenizer = scheduler.engine.target.tokenizer
    if tokenizer is None:
      raise InputError("serving needs the model's tokenizer (tokenizer.json)")
    self.scheduler = scheduler
    self.tokenizer = tokenizer
    self.model_name = model_name
    self.api_key = api_key
    self.max_body_bytes = max_body_bytes
    self.request_timeout_s = request_timeout_s
    if chat_template is None:
      chat_template = text.chat_template_of(tokenizer)
    self.chat_template = chat_template
    self.started = protocol.now()

  # ---- request intake ----------------------------------------------------------------------

  def authorize(self, request: fastapi.Request) -> None:
    if self.api_key is None:
      return
    scheme, _, key = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(
      key.strip().encode(), self.api_key.encode()
    ):
      raise ApiError(
        401,
        "missing or wrong API key (Authorization: Bearer <key>)",
        "authentication_error",
        code="invalid_api_key",
      )

  async def read_json(self, request: fastapi.Request) -> Any:
    """The body as JSON, refused with 413 past the size limit (checked while reading)."""
    too_big = ApiError(
      413,
      f"request body over {self.max_body_bytes} bytes",
      "invalid_request_error",
      code="request_too_large",
    )
    body = bytearray()
    async for chunk in request.stream():
      body += chunk
      if len(body) > self.max_body_bytes:
        raise too_big
    try:
      return json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
      raise ApiError(400, f"the body is not valid JSON: {e}", "invalid_request_error") from None
    except RecursionError:  # [[[[…]]]] past the interpreter's recursion limit
      raise ApiError(400, "the body nests too deeply", "invalid_request_error") from None

  def check_model(self, model: str) -> None:
    if model != self.model_name:
      raise ApiError(
        400,
        f"model {model!r} is not served here (serving {self.model_name!r})",
        "invalid_request_error",
        "model",
        "model_not_found",
      )

  def submit(self, ids: list[int], options: SamplingOptions, req: Any, **job: Any) -> list[_Job]:
    """The request's jobs: one per choice (`n`, or best_of candidates), submitted together
    (one prefill)."""
    count = getattr(req, "candidates", req.n)
    if count > self.scheduler.slots:
      name = "best_of" if count > req.n else "n"
      raise ApiError(
        400,
        f"{name}={count}: this server samples 1 to {self.scheduler.slots} choices (its slots)",
        "invalid_request_error",
        name,
      )
    if count > req.n:  # best_of ranks the candidates by their log-probs
      options = dataclasses.replace(options, logprobs=True)
    try:
      handles = self.scheduler.submit_n(ids, options, count)
    except QueueFull as e:
      raise ApiError(429, f"the server is busy: {e}", "rate_limit_error", code="queue_full")
    except SchedulerClosed as e:
      raise ApiError(
        503, f"the server is shutting down: {e}", "service_unavailable", code="shutting_down"
      )
    except InputError as e:
      raise _bad_request(e, "messages" if job["chat"] else "prompt") from None
    created = protocol.now()
    return [
      _Job(
        handle,
        text.TextStream(self.tokenizer, ids, req.stop_strings, logprobs=options.logprobs),
        created=created,
        logprobs=req.want_logprobs,
        stream_wanted=req.stream,
        include_usage=req.include_usage,
        index=i,
        keep=req.n,
        **job,
      )
      for i, handle in enumerate(handles)
    ]

  def options(self, req: Any, max_tokens: int) -> SamplingOptions:
    return SamplingOptions(
      max_tokens=max_tokens,
      temperature=req.temperature,
      top_p=req.top_p,
      top_k=req.top_k,
      seed=req.seed,
      stop_token_ids=tuple(req.stop_token_ids or ()),
      logprobs=req.want_logprobs,
      top_logprobs=req.top_count,
      presence_penalty=req.presence_penalty,
      frequency_penalty=req.frequency_penalty,
      repetition_penalty=req.repetition_penalty,
      logit_bias=req.logit_bias_ids,
    )

  def completion_job(self, body: Any) -> list[_Job]:
    req = protocol.parse(protocol.CompletionRequest, body)
    self.check_model(req.model)
    prompt = req.prompt_input()
    if isinstance(prompt, str):
      ids = self.tokenizer.encode(prompt, split_special_tokens=True)
    else:
      ids = list(prompt)
    return self.submit(
      ids, self.options(req, req.max_tokens), req, rid=protocol.new_id("cmpl"), chat=False
    )

  def chat_job(self, body: Any) -> list[_Job]:
    req = protocol.parse(protocol.ChatRequest, body)
    self.check_model(req.model)
    prompt = self.chat_template.render(req.message_dicts())
    # A template's own markers (<|im_start|>, ...) are control tokens, so special-token
    # strings are parsed here, as HF's apply_chat_template does.
    ids = self.tokenizer.encode(prompt, split_special_tokens=False)
    max_tokens = req.token_limit
    if max_tokens is None:
      max_tokens = self.default_chat_tokens(len(ids))
    return self.submit(
      ids, self.options(req, max_tokens), req, rid=protocol.new_id("chatcmpl"), chat=True
    )

  def default_chat_tokens(self, prompt_len: int) -> int:
    """Chat without max_tokens: the room left in the slot after the prompt, as OpenAI runs to
    the context's end (`SpecEngine.max_new_tokens_for`); a prompt with no room gets 1 and
    the capacity check's 400."""
    return max(1, self.scheduler.engine.max_new_tokens_for(prompt_len))

  # ---- generation --------------------------------------------------------------------------

  async def pieces(self, job: _Job) -> AsyncIterator[tuple[text.Piece, str | None]]:
    """(piece, finish_reason) per scheduler delta; the last one has a finish reason."""
    async for delta in job.handle:
      values = delta.logprobs
      if values is not None and delta.top_logprobs is not None:  # travel with their tokens
        values = list(zip(values, delta.top_logprobs))
      piece = job.stream.add(delta.token_ids, values)
      if piece.stopped:
        job.handle.cancel()  # a stop string: the rest is not wanted
        job.finished = True
        yield piece, "stop"
        return
      if delta.finish_reason is None:
        yield piece, None
        continue
      job.finished = True
      if delta.finish_reason == "error":
        raise _EngineFailure(delta.error or "the engine failed on this request")
      if delta.finish_reason == "cancelled":  # the client is still here: the server stopped it
        reason = delta.error or "the server cancelled the request (shutting down)"
        raise _EngineFailure(reason, status=503)
      yield piece, None
      yield job.stream.finish(), delta.finish_reason
      return
    raise _EngineFailure("the request's stream ended without a finish reason")

  def token_strings(self, ids: list[int]) -> list[str]:
    return [self.tokenizer.decode([i]) for i in ids]

  def logprobs(self, job: _Job, piece: text.Piece) -> dict | None:
    if not job.logprobs:
      return None
    tokens = self.token_strings(piece.token_ids)
    values, top = piece.logprobs, None
    if job.handle.options.top_logprobs:  # (log-prob, alternatives) per token
      values, alternatives = [v for v, _ in values], [a for _, a in values]
      top = [[(self.tokenizer.decode([i]), i, lp) for i, lp in alts] for alts in alternatives]
    if job.chat:
      raw = [text.token_bytes(self.tokenizer, i) for i in piece.token_ids]
      if top is not None:
        top = [[(s, text.token_bytes(self.tokenizer, i), lp) for s, i, lp in a] for a in top]
      return protocol.chat_logprobs(tokens, raw, values, top)
    if top is not None:
      top = [[(s, lp) for s, _, lp in a] for a in top]
    return protocol.completion_logprobs(tokens, values, piece.offsets, top=top)

  def usage(self, jobs: list[_Job]) -> dict[str, int]:
    """The prompt once, the completion tokens of every choice."""
    completion = sum(job.stream.completion_tokens for job in jobs)
    return protocol.usage(jobs[0].handle.prompt_tokens, completion)

  async def collect(self, job: _Job) -> dict[str, Any]:
    """The whole response of a non-streaming request."""
    parts, ids, lps, offsets, finish = [], [], [], [], None
    async for piece, finish in self.pieces(job):
      parts.append(piece.text)
      ids += piece.token_ids
      lps += piece.logprobs or []
      offsets += piece.offsets
    whole = text.Piece("".join(parts), ids, lps, offsets)
    if lps:  # best_of's ranking: the mean log-prob per token (values, or (value, top) pairs)
      values = [v[0] if isinstance(v, tuple) else v for v in lps]
      job.score = sum(values) / len(values)
    args = (job.rid, job.created, self.model_name, whole.text, finish, self.logprobs(job, whole))
    build = protocol.chat_completion if job.chat else protocol.completion
    return _indexed(build(*args, self.usage([job])), job.index)

  async def collect_all(self, jobs: list[_Job]) -> dict[str, Any]:
    """The whole response of a non-streaming request: every choice, in order of index; with
    best_of > n, the n candidates of the highest mean log-prob per token, best first (usage
    counts every candidate, as OpenAI bills them)."""
    replies = await asyncio.gather(*(self.collect(job) for job in jobs))
    choices = [r["choices"][0] for r in replies]
    if len(jobs) > jobs[0].keep:
      best = sorted(range(len(jobs)), key=lambda i: -jobs[i].score)[: jobs[0].keep]
      choices = [dict(choices[i], index=rank) for rank, i in enumerate(best)]
    reply = replies[0]
    reply["choices"] = choices
    reply["usage"] = self.usage(jobs)
    return reply

  async def choice_events(self, job: _Job) -> AsyncIterator[dict]:
    """One choice's chunks (its index set); an engine failure ends them with an error."""
    if job.chat:
      yield self.chunk(job, {"role": "assistant", "content": ""}, None, None)
    async for piece, finish in self.pieces(job):
      if piece.text or piece.token_ids or finish is not None:
        yield self.chunk(job, piece.text, finish, self.logprobs(job, piece))

  async def events(self, jobs: list[_Job]) -> AsyncIterator[bytes]:
    """The SSE stream of a streaming request, the choices' chunks as they come; leaving early
    (a disconnect) cancels every choice."""
    merged: asyncio.Queue = asyncio.Queue()

    async def pump(job: _Job) -> None:
      try:
        async for chunk in self.choice_events(job):
          await merged.put(chunk)
      except _EngineFailure as e:
        await merged.put(protocol.error_body(str(e), "server_error", code="engine_error"))
      finally:
        await merged.put(None)

    tasks = [asyncio.ensure_future(pump(job)) for job in jobs]
    loop = asyncio.get_running_loop()
    deadline = None if self.request_timeout_s is None else loop.time() + self.request_timeout_s
    try:
      failed, running = False, len(tasks)
      while running:
        try:
          left = None if deadline is None else max(0.0, deadline - loop.time())
          chunk = await asyncio.wait_for(merged.get(), left)
        except TimeoutError:  # the deadline: the choices still running are cancelled below
          yield _sse(self.timed_out().body())
          failed = True
          break
        if chunk is None:
          running -= 1
          continue
        failed = failed or "error" in chunk
        yield _sse(chunk)
      if jobs[0].include_usage and not failed:
        job = jobs[0]
        obj = "chat.completion.chunk" if job.chat else "text_completion"
        yield _sse(
          protocol.usage_chunk(job.rid, obj, job.created, self.model_name, self.usage(jobs))
        )
    finally:
      for task in tasks:
        task.cancel()
      for job in jobs:
        job.release()
    yield SSE_DONE

  def chunk(self, job: _Job, content: Any, finish: str | None, logprobs: dict | None) -> dict:
    if job.chat:
      delta = content if isinstance(content, dict) else ({"content": content} if content else {})
      made = protocol.chat_chunk(job.rid, job.created, self.model_name, delta, finish, logprobs)
    else:
      made = protocol.completion(job.rid, job.created, self.model_name, content, finish, logprobs)
    return _indexed(made, job.index)

  def timed_out(self) -> ApiError:
    return ApiError(
      504,
      f"the request did not finish within {self.request_timeout_s} s",
      "server_error",
      code="request_timeout",
    )

  async def respond(self, request: fastapi.Request, jobs: list[_Job]) -> fastapi.Response:
    collect = asyncio.ensure_future(self.collect_all(jobs))
    gone = asyncio.ensure_future(_disconnected(request))
    try:
      done, _ = await asyncio.wait(
        (collect, gone), timeout=self.request_timeout_s, return_when=asyncio.FIRST_COMPLETED
      )
    finally:
      gone.cancel()
      if not collect.done():  # the client left, the deadline passed, or this handler was cancelled
        for job in jobs:
          job.release()
        collect.cancel()
    if collect not in done:
      if gone in done:
        return fastapi.Response(status_code=499)  # nobody reads it
      raise self.timed_out()
    try:
      return responses.JSONResponse(collect.result())
    except _EngineFailure as e:
      for job in jobs:
        job.release()
      raise ApiError(e.status, str(e), "server_error", code="engine_error") from None

  # ---- /metrics ------------------------------------------------------------------------------

  def prometheus(self, counts: collections.Counter) -> str:
    lines = []
    for key, value in sorted(self.scheduler.metrics().items()):
      kind, doc = SCHEDULER_METRICS.get(key, ("gauge", key.replace("_", " ")))
      name = f"jaxspec_{key}"
      lines += [f"# HELP {name} {doc}", f"# TYPE {name} {kind}", f"{name} {float(value)!r}"]
    name = "jaxspec_http_requests_total"
    lines += [f"# HELP {name} HTTP responses by route and status.", f"# TYPE {name} counter"]
    for (route, status), n in sorted(counts.items()):
      lines.append(f'{name}{{endpoint="{route}",status="{status}"}} {n}')
    return "\n".join(lines) + "\n"


def _indexed(reply: dict[str, Any], index: int) -> dict[str, Any]:
  """A one-choice response or chunk as choice `index` of its request."""
  for choice in reply.get("choices", ()):
    choice["index"] = index
  return reply


async def _disconnected(request: fastapi.Request) -> None:
  """Returns when the client disconnects (the body has been read, so nothing else arrives)."""
  while (await request.receive())["type"] != "http.disconnect":
    pass


def create_app(
  scheduler: Any,
  model_name: str,
  *,
  api_key: str | None = None,
  max_body_bytes: int = 1 << 20,
  chat_template: text.ChatTemplate | None = None,
  request_timeout_s: float | None = None,
) -> fastapi.FastAPI:
  """The FastAPI app serving `scheduler` (already started) as the model `model_name`.

  `chat_template`: None = the tokenizer's own (its directory's chat_template.jinja, else
  tokenizer_config.json's; a GGUF file's), else text.DEFAULT_CHAT_TEMPLATE.
  `request_timeout_s`: a generation request still running after this long is cancelled and
  answered 504 (a stream: an error event); None = no deadline. The caller owns the scheduler:
  it starts it before serving and shuts it down after the HTTP server stops; `app.state.drain`
  (a `Drain`) refuses new requests and waits for those in flight before that
  (`draining.DrainingServer`).
  """
  server = _Server(scheduler, model_name, api_key, max_body_bytes, chat_template, request_timeout_s)
  counts: collections.Counter = collections.Counter()
  drain = Drain()
  app = fastapi.FastAPI(title="jaxspec", docs_url=None, redoc_url=None, openapi_url=None)
  app.state.drain = drain
  app.add_middleware(_StatusCounter, counts=counts, drain=drain)
  auth = [fastapi.Depends(server.authorize)]
  document = openapi.document(model_name, scheduler.slots, secured=api_key is not None)

  @app.exception_handler(ApiError)
  async def _api_error(_request, e: ApiError):
    return _error_response(e)

  @app.exception_handler(InputError)
  async def _input_error(_request, e: InputError):
    return _error_response(_bad_request(e))

  @app.exception_handler(starlette_exceptions.HTTPException)
  async def _http_error(_request, e: starlette_exceptions.HTTPException):
    kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
    return _error_response(ApiError(e.status_code, str(e.detail), kind))

  @app.exception_handler(Exception)
  async def _bug(_request, e: Exception):
    return _error_response(ApiError(500, f"internal error: {type(e).__name__}", "server_error"))

  async def serve(request: fastapi.Request, make_job) -> fastapi.Response:
    body = await server.read_json(request)
    jobs = make_job(body)
    if jobs[0].stream_wanted:
      headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}

      def release() -> None:
        for job in jobs:
          job.release()

      # The background task also runs when the client left before the stream began.
      return responses.StreamingResponse(
        server.events(jobs),
        media_type="text/event-stream",
        headers=headers,
        background=background.BackgroundTask(release),
      )
    return await server.respond(request, jobs)

  @app.post("/v1/completions", dependencies=auth)
  async def completions(request: fastapi.Request):
    return await serve(request, server.completion_job)

  @app.post("/v1/chat/completions", dependencies=auth)
  async def chat_completions(request: fastapi.Request):
    return await serve(request, server.chat_job)

  @app.get("/v1/models", dependencies=auth)
  async def models():
    return protocol.model_list(model_name, server.started)

  @app.get("/health")
  async def health():
    if drain.started:  # a balancer's health check takes the server out of rotation
      return responses.JSONResponse({"status": "draining"}, status_code=503)
    return {"status": "ok"}

  @app.get("/openapi.json")
  async def openapi_document():
    return document

  @app.get("/metrics")
  async def metrics():
    return responses.PlainTextResponse(
      server.prometheus(counts), media_type="text/plain; version=0.0.4"
    )

  return app
