"""The OpenAPI 3.1 document of the server, generated from the pydantic request models."""

from __future__ import annotations

from pydantic.json_schema import models_json_schema

from server.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest

_ERROR_SCHEMA = {
    "type": "object",
    "required": ["error"],
    "properties": {"error": {
        "type": "object",
        "required": ["message", "type"],
        "properties": {
            "message": {"type": "string"},
            "type": {"type": "string"},
            "param": {"type": ["string", "null"]},
            "code": {"type": ["string", "null"]},
        },
    }},
}

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
}
_ERROR_STATUSES = {"400": "Invalid request", "401": "Missing or wrong API key", "404": "Unknown model",
                   "413": "Body too large", "429": "Waiting queue full", "503": "Draining"}


def openapi_document(version: str) -> dict:
    refs, definitions = models_json_schema(
        [(model, "validation") for model, _ in _POST_ROUTES.values()],
        ref_template="#/components/schemas/{model}",
    )
    schemas = dict(definitions.get("$defs", {}))
    schemas["ErrorResponse"] = _ERROR_SCHEMA
    error_responses = {
        status: {"description": text,
                 "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}}
        for status, text in _ERROR_STATUSES.items()
    }
    paths: dict = {}
    for path, (model, summary) in _POST_ROUTES.items():
        paths[path] = {"post": {
            "summary": summary,
            "operationId": path.strip("/").replace("/", "_").replace(".", "_"),
            "requestBody": {"required": True,
                            "content": {"application/json": {"schema": refs[(model, "validation")]}}},
            "responses": {"200": {"description": "Success"}, **error_responses},
        }}
    for path, summary in _GET_ROUTES.items():
        paths[path] = {"get": {
            "summary": summary,
            "operationId": path.strip("/").replace("/", "_").replace(".", "_"),
            "responses": {"200": {"description": "Success"}},
        }}
    return {
        "openapi": "3.1.0",
        "info": {"title": "jaxserve", "version": version,
                 "description": "OpenAI-compatible LLM serving on JAX/XLA"},
        "paths": paths,
        "components": {
            "schemas": schemas,
            "securitySchemes": {"bearerAuth": {"type": "http", "scheme": "bearer"}},
        },
    }
