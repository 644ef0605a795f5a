"""The server's OpenAPI 3.1 document (GET /openapi.json): what it accepts, as it validates it.

The routes read their bodies themselves (so that every error is OpenAI's error shape), so
FastAPI cannot derive their schemas; this module builds them from the request models in
`protocol` (pydantic's JSON Schema), then states what those models check in validators as
schema where JSON Schema can say it: the one model name served, the most choices (the slots),
nullable optional parameters (null means unset), token-id keys of logit_bias, non-empty stop
strings, and the parameters accepted only with one value (echo, suffix, tools,
response_format). Constraints between fields (best_of ≥ n, stream_options only with stream,
top_logprobs only with logprobs) and the engine's capacity are checked at request time (400).

A client generator or an API fuzzer (schemathesis, tests/test_serve_fuzz.py) reads it: data
valid by it never gets a 5xx, and data invalid by it gets a 4xx in OpenAI's error shape.
"""

from __future__ import annotations

import copy
from typing import Any

from pydantic.json_schema import models_json_schema

from jaxspec.penalties import MAX_LOGIT_BIAS
from jaxspec.serve import protocol

REF = "#/components/schemas/{model}"
ERROR_STATUSES = {
  "400": "Bad JSON or parameters, an unknown model, or a request over the engine's capacity.",
  "401": "A missing or wrong API key.",
  "413": "A body over the size limit.",
  "429": "The queue is full (Retry-After).",
  "503": "Draining or shutting down (Retry-After).",
  "504": "The request did not finish within the server's deadline.",
}

# Constraints the request models check in validators (protocol._need), as JSON Schema.
_COMMON = {
  "n": {"type": "integer", "minimum": 1},
  "stop": {
    "anyOf": [
      {"type": "string", "minLength": 1},
      {"type": "array", "items": {"type": "string", "minLength": 1}},
    ]
  },
  "logit_bias": {
    "type": "object",
    "propertyNames": {"pattern": "^[0-9]+$"},
    "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100},
    "maxProperties": MAX_LOGIT_BIAS,
  },
}
_REFINED = {
  "CompletionRequest": {
    **_COMMON,
    "logprobs": {"type": "integer", "minimum": 0, "maximum": 5},
    "echo": {"type": "boolean", "const": False},
    "suffix": {"type": "null"},
    "best_of": {"type": "integer", "minimum": 1},
  },
  "ChatRequest": {
    **_COMMON,
    "top_logprobs": {"type": "integer", "minimum": 0, "maximum": 20},
    "tools": {"type": "array", "maxItems": 0},
    "response_format": {
      "type": "object",
      "properties": {"type": {"const": "text"}},
      "required": ["type"],
    },
  },
}

_ERROR = {
  "type": "object",
  "required": ["error"],
  "properties": {
    "error": {
      "type": "object",
      "required": ["message", "type", "param", "code"],
      "properties": {
        "message": {"type": "string"},
        "type": {"type": "string"},
        "param": {"type": ["string", "null"]},
        "code": {"type": ["string", "null"]},
      },
    }
  },
}
_REPLY = {
  "type": "object",
  "required": ["id", "object", "created", "model", "choices"],
  "properties": {
    "id": {"type": "string"},
    "object": {"type": "string"},
    "created": {"type": "integer"},
    "model": {"type": "string"},
    "choices": {"type": "array", "items": {"type": "object"}},
    "usage": {"type": "object"},
  },
}

# A property's keys that describe it rather than constrain it (kept when it is restated).
_ANNOTATIONS = ("default", "title", "description")
# One server-sent event: its data is a JSON chunk (or an error), the last one "[DONE]".
_EVENT = {"type": "object", "required": ["data"], "properties": {"data": {"type": "string"}}}


def _nullable(prop: dict[str, Any]) -> dict[str, Any]:
  """`prop` or null (the models drop null parameters: OpenAI's defaults apply)."""
  options = prop.get("anyOf", [prop])
  if any(o.get("type") == "null" for o in options):
    return prop
  rest = {k: v for k, v in prop.items() if k in _ANNOTATIONS}
  inner = {k: v for k, v in prop.items() if k not in rest}
  return {"anyOf": [*inner.get("anyOf", [inner]), {"type": "null"}], **rest}


def request_schemas(model_name: str, max_choices: int) -> dict[str, Any]:
  """The request bodies' schemas (and the ones they reference), keyed by model name."""
  _, top = models_json_schema(
    [(protocol.CompletionRequest, "validation"), (protocol.ChatRequest, "validation")],
    ref_template=REF,
  )
  schemas = copy.deepcopy(top["$defs"])
  for name, refined in _REFINED.items():
    props = schemas[name]["properties"]
    for key, value in refined.items():
      kept = {k: v for k, v in props[key].items() if k in _ANNOTATIONS}
      props[key] = {**value, **kept}
    props["model"] = {"type": "string", "enum": [model_name], "title": "Model"}
    props["n"]["maximum"] = max_choices
    if "best_of" in props:
      props["best_of"]["maximum"] = max_choices
    required = set(schemas[name].get("required", ()))
    for key in props:
      if key not in required:
        props[key] = _nullable(props[key])
  return schemas


def _operation(summary: str, schema: str, secured: bool) -> dict[str, Any]:
  responses = {
    "200": {
      "description": "The reply; with stream=true, server-sent events ending in [DONE].",
      "content": {
        "application/json": {"schema": _REPLY},
        "text/event-stream": {"schema": _EVENT},
      },
    }
  }
  for status, why in ERROR_STATUSES.items():
    if status != "401" or secured:
      responses[status] = {
        "description": why,
        "content": {"application/json": {"schema": {"$ref": REF.format(model="Error")}}},
      }
  op = {
    "summary": summary,
    "requestBody": {
      "required": True,
      "content": {"application/json": {"schema": {"$ref": REF.format(model=schema)}}},
    },
    "responses": responses,
  }
  if secured:
    op["security"] = [{"bearer": []}]
  return op


def document(model_name: str, max_choices: int, secured: bool = False) -> dict[str, Any]:
  """The OpenAPI 3.1 document of a server of `model_name` with `max_choices` slots (`secured`:
  the /v1 routes need a Bearer key)."""
  schemas = request_schemas(model_name, max_choices)
  schemas["Error"] = _ERROR
  json_ok = {"application/json": {"schema": {"type": "object"}}}
  models = {
    "summary": "The model served.",
    "responses": {"200": {"description": "A list.", "content": json_ok}},
  }
  if secured:
    models["security"] = [{"bearer": []}]
    models["responses"]["401"] = {
      "description": ERROR_STATUSES["401"],
      "content": {"application/json": {"schema": {"$ref": REF.format(model="Error")}}},
    }
  doc = {
    "openapi": "3.1.0",
    "info": {"title": "jaxspec", "version": "1", "description": "OpenAI-compatible subset."},
    "paths": {
      "/v1/completions": {"post": _operation("A text completion.", "CompletionRequest", secured)},
      "/v1/chat/completions": {"post": _operation("A chat completion.", "ChatRequest", secured)},
      "/v1/models": {"get": models},
      "/health": {
        "get": {
          "summary": "ok, or 503 while draining.",
          "responses": {
            "200": {"description": "Serving.", "content": json_ok},
            "503": {"description": "Draining.", "content": json_ok},
          },
        }
      },
      "/metrics": {
        "get": {
          "summary": "Prometheus text.",
          "responses": {
            "200": {
              "description": "Metrics.",
              "content": {"text/plain": {"schema": {"type": "string"}}},
            }
          },
        }
      },
    },
    "components": {"schemas": schemas},
  }
  if secured:
    doc["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
  return doc


__all__ = ["ERROR_STATUSES", "document", "request_schemas"]
