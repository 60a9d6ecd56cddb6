"""The control channel: small JSON messages over HTTP between a decode and a prefill instance.

The prefill side runs `ControlServer` (a stdlib threading HTTP server on its own port, so it
needs nothing from the serving event loop):

    POST /kv_transfer/claim    {"transfer_id", "token_digest", "model_fingerprint"}
                               -> 200 {"ok": true, "transfer_address"} | 409 | 410 {"error": ...}
    POST /kv_transfer/release  {"transfer_id": ..., "status": "pulled" | "abort"} -> 200 {"ok": bool}

The decode side (and the proxy, for a client that left between the two legs) calls `post_json`.
Both ends are bounded: a body or reply over `MAX_BODY_BYTES`, a peer slower than its deadline,
more than `MAX_CONNECTIONS` connections at once — each is refused, never waited on. With a
token configured every request must carry it (`X-KV-Transfer-Token`, compared in constant
time). The client follows no redirects and uses no proxy from the environment. No pickle:
bodies are JSON objects, anything else is a 400.
"""

from __future__ import annotations

import hmac
import http.client
import json
import logging
import threading
import time
import urllib.parse
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

log = logging.getLogger("jaxserve.kv_transfer")

Handler = Callable[[dict], tuple[int, dict]]
TOKEN_HEADER = "X-KV-Transfer-Token"
MAX_BODY_BYTES = 64 * 1024  # a claim or release is ~200 bytes
MAX_CONNECTIONS = 64
READ_TIMEOUT_S = 5.0  # a peer that sends its request slower than this is dropped


def token_matches(presented: str | None, token: str | None) -> bool:
    """True when no token is configured, or `presented` equals it (constant-time)."""
    if token is None:
        return True
    return presented is not None and hmac.compare_digest(presented.encode(), token.encode())


class ControlServer:
    """Routes POST paths to handlers `body -> (status, reply)` on a background thread."""

    def __init__(self, host: str, port: int, routes: dict[str, Handler], token: str | None = None):
        routes = dict(routes)
        slots = threading.BoundedSemaphore(MAX_CONNECTIONS)

        class _Handler(BaseHTTPRequestHandler):
            timeout = READ_TIMEOUT_S  # per socket read: a silent or trickling peer frees its thread

            def do_POST(self):
                if not slots.acquire(blocking=False):
                    return self._reply(503, {"error": "too many control connections"})
                try:
                    self._reply(*self._handle())
                finally:
                    slots.release()

            def _handle(self) -> tuple[int, dict]:
                if not token_matches(self.headers.get(TOKEN_HEADER), token):
                    return 401, {"error": f"missing or wrong {TOKEN_HEADER}"}
                handler = routes.get(self.path)
                if handler is None:
                    return 404, {"error": f"no route {self.path}"}
                try:
                    length = int(self.headers.get("Content-Length") or 0)
                except ValueError:
                    return 400, {"error": "bad Content-Length"}
                if not 0 <= length <= MAX_BODY_BYTES:
                    return 413, {"error": f"body over {MAX_BODY_BYTES} bytes"}
                try:
                    body = json.loads(self.rfile.read(length) or b"null")
                except (ValueError, UnicodeDecodeError) as err:
                    return 400, {"error": f"bad request: {err}"}
                if not isinstance(body, dict):
                    return 400, {"error": "body must be a JSON object"}
                return handler(body)

            def _reply(self, status: int, reply: dict) -> None:
                data = json.dumps(reply).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.send_header("Connection", "close")
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):  # quiet: the connector logs what matters
                pass

        self._server = ThreadingHTTPServer((host, port), _Handler)
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, name="jaxserve-kv-control", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def post_json(url: str, body: dict, timeout: float, token: str | None = None) -> tuple[int, dict]:
    """POST `body` as JSON to an `http://host:port/path` URL; -> (status, reply).

    The whole exchange ends within `timeout` seconds (a slow peer is cut, not waited on); no
    redirect is followed; a reply over MAX_BODY_BYTES or not a JSON object is an error.
    Connection errors and deadlines raise OSError."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme != "http" or not parts.hostname or parts.username or parts.password:
        raise OSError(f"control URL must be http://host:port/..., got {url!r}")
    deadline = time.monotonic() + timeout
    conn = http.client.HTTPConnection(parts.hostname, parts.port or 80, timeout=timeout)
    try:
        conn.connect()
        watchdog = threading.Timer(max(deadline - time.monotonic(), 0.0), _cut, (conn.sock,))
        watchdog.daemon = True  # a peer trickling bytes is cut at the deadline
        watchdog.start()
        try:
            headers = {"Content-Type": "application/json", "Connection": "close"}
            if token is not None:
                headers[TOKEN_HEADER] = token
            conn.request("POST", parts.path or "/", body=json.dumps(body).encode(), headers=headers)
            response = conn.getresponse()
            data = b""
            while len(data) <= MAX_BODY_BYTES:
                chunk = response.read1(16 * 1024)
                if not chunk:
                    break
                data += chunk
        finally:
            watchdog.cancel()
        if time.monotonic() >= deadline:
            raise TimeoutError(f"control exchange with {parts.hostname}:{parts.port} exceeded {timeout:g} s")
        if len(data) > MAX_BODY_BYTES:
            raise OSError(f"control reply over {MAX_BODY_BYTES} bytes")
        try:
            reply = json.loads(data or b"{}")
        except ValueError:
            reply = None
        return response.status, reply if isinstance(reply, dict) else {"error": "non-JSON reply"}
    except http.client.HTTPException as err:
        if time.monotonic() >= deadline:
            raise TimeoutError(f"control exchange with {parts.hostname}:{parts.port} exceeded {timeout:g} s") from None
        raise OSError(f"bad control reply: {err!r}") from None
    finally:
        conn.close()


def _cut(sock) -> None:
    try:
        sock.shutdown(2)
    except OSError:
        pass
