"""A misbehaving S3 endpoint for tests: an HTTP proxy on loopback in front of the real test S3
server (``tests/conftest.py``'s ``s3_server``) that forwards every request unchanged, except those
a rule picks, which it answers itself: an HTTP error with an S3 XML body, or a connection closed
without any answer (what botocore sees of a reset or a dead server).

The server itself cannot be made to do this (a 409 ConditionalRequestConflict needs two AWS
conditional writes in flight at once; a reset needs a network fault), so the client under test
talks to this proxy with its real botocore stack, and everything the rules let through reaches
the real server. SigV4 signs the ``Host`` header, which the proxy forwards as the client sent it.
"""

from __future__ import annotations

import http.client
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable
from urllib.parse import urlsplit

#: what a rule returns: None (forward), ("error", status, code) or ("reset",).
Action = tuple | None


@dataclass
class Rule:
    """Answer requests for which ``match(method, path, headers)`` is true with ``action``, at most
    ``times`` times (None: always); ``hits`` counts the answers given."""

    match: Callable[[str, str, dict], bool]
    action: tuple
    times: int | None = None
    hits: int = 0


@dataclass
class FaultProxy:
    """``endpoint_url`` to give the client; ``rules`` are tried in order; ``stop()`` when done."""

    upstream: str
    rules: list[Rule] = field(default_factory=list)
    seen: list[tuple[str, str]] = field(default_factory=list)

    def start(self) -> "FaultProxy":
        proxy = self
        up = urlsplit(self.upstream)
        lock = threading.Lock()

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *_args):  # quiet
                pass

            def _body(self) -> bytes:
                if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
                    raw = b""
                    while True:
                        line = self.rfile.readline()
                        raw += line
                        size = int(line.split(b";")[0].strip() or b"0", 16)
                        if size == 0:
                            while True:  # trailers up to the empty line
                                t = self.rfile.readline()
                                raw += t
                                if t in (b"\r\n", b"\n", b""):
                                    return raw
                        raw += self.rfile.read(size + 2)
                return self.rfile.read(int(self.headers.get("Content-Length") or 0))

            def _handle(self) -> None:
                body = self._body()
                headers = {k: v for k, v in self.headers.items()}
                with lock:
                    proxy.seen.append((self.command, self.path))
                    action = None
                    for rule in proxy.rules:
                        if (rule.times is None or rule.hits < rule.times) and rule.match(self.command, self.path, headers):
                            rule.hits += 1
                            action = rule.action
                            break
                if action and action[0] == "reset":
                    self.close_connection = True
                    self.connection.close()
                    return
                if action and action[0] == "error":
                    status, code = action[1], action[2]
                    xml = (f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{code}</Code>'
                           f"<Message>injected by tests/faultproxy.py</Message></Error>").encode()
                    self.send_response(status)
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(xml) if self.command != "HEAD" else 0))
                    self.end_headers()
                    if self.command != "HEAD":
                        self.wfile.write(xml)
                    return
                conn = http.client.HTTPConnection(up.hostname, up.port, timeout=60)
                try:
                    try:
                        conn.request(self.command, self.path, body=body, headers=headers)
                        resp = conn.getresponse()
                        data = resp.read()
                    except OSError:  # the server is down (a test stopped it): the client's connection drops, as
                        self.close_connection = True  # before, without socketserver's traceback on the suite's output
                        self.connection.close()
                        return
                    self.send_response(resp.status, resp.reason)
                    for k, v in resp.getheaders():
                        if k.lower() not in ("transfer-encoding", "content-length", "connection"):
                            self.send_header(k, v)
                    # A HEAD has no body but reports the object's size: pass the server's length on.
                    length = resp.getheader("Content-Length") if self.command == "HEAD" else None
                    self.send_header("Content-Length", length or str(len(data)))
                    self.end_headers()
                    if self.command != "HEAD":
                        self.wfile.write(data)
                finally:
                    conn.close()

            do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _handle

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.endpoint_url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def proxied_settings(bucket, proxy: FaultProxy, **extra):
    """The bucket fixture's Settings with the endpoint replaced by the proxy's."""
    return bucket.settings.model_copy(update={"s3_endpoint_url": proxy.endpoint_url, **extra})
