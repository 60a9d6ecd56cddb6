"""The OpenAPI 3.1 document of the server.

Request bodies are generated from the pydantic models that validate them (so the value
ranges stated are the ones enforced); response bodies are described by the small schemas
below (checked by schemathesis in tests/test_server_schemathesis.py).
"""

from __future__ import annotations

from pydantic.json_schema import models_json_schema

from server.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest

_ERROR_SCHEMA = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "null"]},
            },
        }
    },
}

_INT = {"type": "integer"}
_STR = {"type": "string"}
_NULLABLE_OBJECT = {"type": ["object", "null"]}
_FINISH_REASON = {"enum": ["stop", "length", "tool_calls", "abort", "error", None]}
_STOP_REASON = {"type": ["integer", "string", "null"]}
_USAGE = {
    "type": "object",
    "required": ["prompt_tokens", "completion_tokens", "total_tokens"],
    "properties": {
        "prompt_tokens": _INT,
        "completion_tokens": _INT,
        "total_tokens": _INT,
        "prompt_tokens_details": {
            "type": "object",
            "required": ["cached_tokens"],
            "properties": {"cached_tokens": _INT},
        },
    },
}


def _response_body(object_name: str, choice: dict) -> dict:
    return {
        "type": "object",
        "required": ["id", "object", "created", "model", "choices", "usage", "system_fingerprint"],
        "properties": {
            "id": _STR,
            "object": {"const": object_name},
            "created": _INT,
            "model": _STR,
            "choices": {
                "type": "array",
                "items": {
                    "type": "object",
                    "required": ["index", "finish_reason"],
                    "properties": {
                        "index": _INT,
                        "finish_reason": _FINISH_REASON,
                        "stop_reason": _STOP_REASON,
                        **choice,
                    },
                },
            },
            "usage": _USAGE,
            "system_fingerprint": _STR,
        },
    }


_COMPLETION = _response_body("text_completion", {"text": _STR, "logprobs": _NULLABLE_OBJECT})
_CHAT_COMPLETION = _response_body(
    "chat.completion",
    {
        "message": {
            "type": "object",
            "required": ["role", "content"],
            "properties": {"role": {"const": "assistant"}, "content": {"type": ["string", "null"]}},
        },
        "logprobs": _NULLABLE_OBJECT,
    },
)
_RESPONSES = {  # route -> schema of its 200 JSON body
    "/v1/completions": _COMPLETION,
    "/v1/chat/completions": _CHAT_COMPLETION,
    "/tokenize": {
        "type": "object",
        "required": ["count", "max_model_len", "tokens"],
        "properties": {"count": _INT, "max_model_len": _INT, "tokens": {"type": "array", "items": _INT}},
    },
    "/detokenize": {"type": "object", "required": ["prompt"], "properties": {"prompt": _STR}},
    "/v1/models": {
        "type": "object",
        "required": ["object", "data"],
        "properties": {
            "object": {"const": "list"},
            "data": {
                "type": "array",
                "items": {
                    "type": "object",
                    "required": ["id", "object"],
                    "properties": {"id": _STR, "object": {"const": "model"}},
                },
            },
        },
    },
    "/health": {"type": "object", "required": ["status"], "properties": {"status": _STR}},
    "/version": {"type": "object", "required": ["version"], "properties": {"version": _STR}},
    "/tokenizer_info": {"type": "object", "required": ["tokenizer_class"], "properties": {"tokenizer_class": _STR}},
    "/openapi.json": {"type": "object", "required": ["openapi", "paths"]},
}
_SSE_EVENT = {"type": "object", "required": ["data"], "properties": {"data": _STR}}  # JSON chunks, then [DONE]
_STREAMING = ("/v1/completions", "/v1/chat/completions")  # also answer text/event-stream

_POST_ROUTES = {
    "/v1/completions": (CompletionRequest, "Create a text completion (JSON, or SSE when stream is true)"),
    "/v1/chat/completions": (ChatCompletionRequest, "Create a chat completion (JSON, or SSE when stream is true)"),
    "/tokenize": (TokenizeRequest, "Tokenize a prompt or chat messages"),
    "/detokenize": (DetokenizeRequest, "Turn token ids back into text"),
}
_GET_ROUTES = {
    "/v1/models": "List the served model",
    "/health": "200 when serving, 503 while draining or once the engine loop has died",
    "/metrics": "Prometheus metrics (text exposition format)",
    "/version": "Server version",
    "/openapi.json": "This document",
    "/tokenizer_info": "The tokenizer's configuration (vLLM's shape)",
}
_ERROR_STATUSES = {
    "400": "Invalid request",
    "401": "Missing or wrong API key",
    "404": "Unknown model",
    "408": "Body not received in time",
    "413": "Body too large",
    "415": "Content-Type is not application/json",
    "429": "Waiting queue full",
    "503": "Draining",
}
_GET_ERROR_STATUSES = ("401", "503")


def _success(path: str) -> dict:
    if path == "/metrics":
        return {"description": "Success", "content": {"text/plain": {"schema": _STR}}}
    content = {"application/json": {"schema": _RESPONSES[path]}}
    if path in _STREAMING:
        content["text/event-stream"] = {"schema": _SSE_EVENT}
    return {
        "description": "Success (an SSE stream when stream is true)" if path in _STREAMING else "Success",
        "content": content,
    }


def openapi_document(version: str) -> dict:
    refs, definitions = models_json_schema(
        [(model, "validation") for model, _ in _POST_ROUTES.values()],
        ref_template="#/components/schemas/{model}",
    )
    schemas = dict(definitions.get("$defs", {}))
    schemas["ErrorResponse"] = _ERROR_SCHEMA
    error_responses = {
        status: {
            "description": text,
            "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}},
        }
        for status, text in _ERROR_STATUSES.items()
    }
    paths: dict = {}
    for path, (model, summary) in _POST_ROUTES.items():
        paths[path] = {
            "post": {
                "summary": summary,
                "operationId": path.strip("/").replace("/", "_").replace(".", "_"),
                "requestBody": {
                    "required": True,
                    "content": {"application/json": {"schema": refs[(model, "validation")]}},
                },
                "responses": {"200": _success(path), **error_responses},
            }
        }
    for path, summary in _GET_ROUTES.items():
        paths[path] = {
            "get": {
                "summary": summary,
                "operationId": path.strip("/").replace("/", "_").replace(".", "_"),
                "responses": {
                    "200": _success(path),
                    **{status: error_responses[status] for status in _GET_ERROR_STATUSES},
                },
            }
        }
    return {
        "openapi": "3.1.0",
        "info": {"title": "jaxserve", "version": version, "description": "OpenAI-compatible LLM serving on JAX/XLA"},
        "paths": paths,
        "components": {
            "schemas": schemas,
            "securitySchemes": {"bearerAuth": {"type": "http", "scheme": "bearer"}},
        },
    }
