"""A stand-in OpenAI server, a real HTTP server process, that fails on a plan: each request
names its plan in the body's ``user`` field, ``"<name>:<answer>,<answer>,..."``, the answer to
its first try, its second, ... (the last repeats). An answer is a status (``200`` a completion,
``429`` and ``503`` with ``Retry-After: 0``, any other its OpenAI error body), ``close`` (the
connection is closed, no answer) or ``hang`` (no answer ever). ``GET /v1/models`` answers;
``GET /tries`` gives the tries each plan got so far.

Run as a script (``python flaky_server.py``): it prints its port once listening."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

TRIES: Counter[str] = Counter()
COUNT = threading.Lock()
NEVER = threading.Event()


class Handler(BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        if self.path == "/v1/models":
            self._answer(200, {"object": "list", "data": []})
        elif self.path == "/tries":
            with COUNT:
                self._answer(200, dict(TRIES))
        else:
            self._answer(404, {"error": {"message": "not found"}})

    def do_POST(self) -> None:  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        plan = body["user"]
        with COUNT:
            TRIES[plan] += 1
            tries = TRIES[plan]
        answers = plan.split(":", 1)[1].split(",")
        answer = answers[min(tries, len(answers)) - 1]
        if answer == "close":
            self.close_connection = True
        elif answer == "hang":
            NEVER.wait()
        elif answer == "200":
            self._answer(200, {"id": f"cmpl-{plan}-{tries}", "object": "text_completion",
                               "choices": [{"index": 0, "text": " fine",
                                            "finish_reason": "length"}],
                               "usage": {"prompt_tokens": 3, "completion_tokens": 1,
                                         "total_tokens": 4}})
        else:
            self._answer(int(answer), {"error": {"message": f"planned {answer}",
                                                 "type": "planned", "code": None}})

    def _answer(self, status: int, body: object) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        if status in (429, 503):
            self.send_header("Retry-After", "0")
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002
        pass


@contextmanager
def flaky_server() -> Iterator[str]:
    """The server's process, for the block: its URL."""
    server = subprocess.Popen([sys.executable, __file__], stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout is not None
        port = server.stdout.readline().strip()
        assert port.isdigit(), f"the flaky server did not start (exit {server.poll()})"
        yield f"http://127.0.0.1:{port}"
    finally:
        server.kill()
        server.wait(timeout=30)


if __name__ == "__main__":
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    httpd.daemon_threads = True
    print(httpd.server_address[1], flush=True)
    httpd.serve_forever()
