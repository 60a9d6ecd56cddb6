"""The control channel: small JSON messages over HTTP between a decode and a prefill instance.

The prefill side runs `ControlServer` (a stdlib threading HTTP server on its own port, so it
needs nothing from the serving event loop):

    POST /kv_transfer/claim    {"transfer_id": ...}                  -> 200 {"ok": true} | 410 {"error": ...}
    POST /kv_transfer/release  {"transfer_id": ..., "status": "pulled" | "abort"} -> 200 {"ok": bool}

The decode side (and the proxy, for a client that left between the two legs) calls `post_json`.
No pickle: bodies are JSON objects, anything else is a 400.
"""

from __future__ import annotations

import json
import logging
import threading
import urllib.error
import urllib.request
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

log = logging.getLogger("jaxserve.kv_transfer")

Handler = Callable[[dict], tuple[int, dict]]


class ControlServer:
    """Routes POST paths to handlers `body -> (status, reply)` on a background thread."""

    def __init__(self, host: str, port: int, routes: dict[str, Handler]):
        routes = dict(routes)

        class _Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 - http.server's naming
                handler = routes.get(self.path)
                try:
                    length = int(self.headers.get("Content-Length") or 0)
                    body = json.loads(self.rfile.read(length) or b"null")
                    if handler is None:
                        status, reply = 404, {"error": f"no route {self.path}"}
                    elif not isinstance(body, dict):
                        status, reply = 400, {"error": "body must be a JSON object"}
                    else:
                        status, reply = handler(body)
                except (ValueError, UnicodeDecodeError) as err:
                    status, reply = 400, {"error": f"bad request: {err}"}
                data = json.dumps(reply).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
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


def post_json(url: str, body: dict, timeout: float) -> tuple[int, dict]:
    """POST `body` as JSON; -> (status, reply). Connection errors raise OSError."""
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, json.loads(response.read() or b"{}")
    except urllib.error.HTTPError as err:
        try:
            return err.code, json.loads(err.read() or b"{}")
        except ValueError:
            return err.code, {"error": "non-JSON reply"}
