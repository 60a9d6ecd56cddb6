"""The middleware that owns the cross-cutting rules of every route.

Request ids (`X-Request-ID`, echoed and logged, never an engine key), the API key (401 +
`WWW-Authenticate`), draining (503), body limits (413), `Content-Type: application/json` on
POST (415; a web page cannot send that cross-origin without a CORS preflight) and turning every
error into OpenAI's JSON error shape: a 405 carries `Allow`, a 500 says only "internal error"
and the request id (the details go to the log).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import re
import uuid

from aiohttp import web

from server.protocol import RequestError, internal_error
from server.state import REQUEST_ID, STATE

logger = logging.getLogger("jaxserve.server")

_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")
_PROTECTED_PREFIXES = ("/v1/", "/tokenize", "/detokenize")
_ALWAYS_OPEN = ("/metrics", "/version")  # still answered while draining


def _error_response(err: RequestError, request_id: str | None) -> web.Response:
    headers = dict(err.headers)
    if request_id:
        headers["X-Request-ID"] = request_id
    return web.json_response(err.body(), status=err.status, headers=headers)


_HTTP_ERRORS = {
    404: ("invalid_request_error", "route_not_found"),
    405: ("invalid_request_error", "method_not_allowed"),
    413: ("invalid_request_error", "request_too_large"),
}
JSON_CONTENT_TYPE = "application/json"


@web.middleware
async def errors_and_policy(request: web.Request, handler) -> web.StreamResponse:
    state = request.app[STATE]
    request_id = request.headers.get("X-Request-ID")
    try:
        if request_id is not None and not _REQUEST_ID.match(request_id):
            request_id = None
            raise RequestError(400, "X-Request-ID: must be 1-128 characters of [A-Za-z0-9._:-]", param="X-Request-ID")
        request_id = request_id or uuid.uuid4().hex
        request[REQUEST_ID] = request_id
        path = request.path
        if state.draining and path not in _ALWAYS_OPEN:
            raise RequestError(503, "The server is shutting down", code="draining", error_type="service_unavailable")
        if state.config.api_key and path.startswith(_PROTECTED_PREFIXES):
            _check_api_key(request, state.config.api_key)
        if request.content_length is not None and request.content_length > state.config.max_body_bytes:
            raise RequestError(
                413,
                f"The request body ({request.content_length} bytes) exceeds the limit of "
                f"{state.config.max_body_bytes} bytes",
                code="request_too_large",
            )
        route_exists = request.match_info.http_exception is None  # else the 404/405 comes first
        if request.method == "POST" and route_exists and request.content_type.lower() != JSON_CONTENT_TYPE:
            raise RequestError(
                415,
                f"Content-Type must be {JSON_CONTENT_TYPE}, got {request.headers.get('Content-Type', 'none')!r}",
                code="unsupported_media_type",
            )
        state.in_flight += 1
        state.idle.clear()
        try:
            response = await handler(request)
        finally:
            state.in_flight -= 1
            if state.in_flight == 0:
                state.idle.set()
        response.headers.setdefault("X-Request-ID", request_id)
        return response
    except RequestError as err:
        state.metrics.rejected_requests.labels(status=str(err.status)).inc()
        if err.status >= 500 and err.status != 503:
            logger.error("request %s failed: %s", request_id, err.message)
        return _error_response(err, request_id)
    except web.HTTPException as err:
        if err.status < 400:
            raise
        error_type, code = _HTTP_ERRORS.get(err.status, ("invalid_request_error", None))
        message = f"{request.method} {request.path}: {err.reason}"
        if err.status == 413:
            message = f"The request body exceeds the limit of {state.config.max_body_bytes} bytes"
        headers = {"Allow": err.headers["Allow"]} if "Allow" in err.headers else None
        state.metrics.rejected_requests.labels(status=str(err.status)).inc()
        return _error_response(
            RequestError(err.status, message, code=code, error_type=error_type, headers=headers), request_id
        )
    except (ConnectionResetError, asyncio.CancelledError):
        raise
    except Exception:  # a bug: log it with its traceback, tell the client only that it happened
        logger.exception("request %s: unhandled error", request_id)
        state.metrics.rejected_requests.labels(status="500").inc()
        return _error_response(internal_error(request_id), request_id)


def _check_api_key(request: web.Request, api_key: str) -> None:
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), api_key.encode()):
        raise RequestError(
            401,
            "Missing or invalid API key: send 'Authorization: Bearer <key>'",
            code="invalid_api_key",
            headers={"WWW-Authenticate": 'Bearer realm="jaxserve"'},
        )
