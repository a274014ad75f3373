"""OpenAI batch files: the input's requests, checked up front; the output's lines, appended one
per finished request and read back to resume.

Input, one JSON object a line (blank lines are skipped)::

    {"custom_id": "q1", "method": "POST", "url": "/v1/chat/completions", "body": {...}}

Output, one line per request, in the order requests finish::

    {"id": "batch_req_...", "custom_id": "q1",
     "response": {"status_code": 200, "request_id": "chatcmpl-...", "body": {...}}, "error": null}

A line holds the server's answer (any status, a 400 included) in ``response`` and a null
``error``; or, for a request that got no answer after its retries (a 5xx or 429, a timeout, a
lost connection), an ``error`` (``code``, ``message``; ``response`` holds the last 5xx, or is
null). A request that got neither yet has no line (the next run sends it). With
``--retry-failed`` a request whose line has an ``error`` is sent again and its new line
appended: the last line of a ``custom_id`` is its result.
"""

from __future__ import annotations

import fcntl
import json
import os
import threading
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SUPPORTED_URLS = ("/v1/chat/completions", "/v1/completions")
# Lines written are fsynced this often (and when the output is closed): a crash of the machine
# loses at most the last second's lines.
FSYNC_INTERVAL_S = 1.0


class BatchFileError(ValueError):
    """A batch file that cannot be used; the message names the file, the line and the field."""

    def __init__(self, path: Path, line: int, field: str | None, problem: str) -> None:
        where = f"{path}:{line}" + (f": {field}" if field else "")
        super().__init__(f"{where}: {problem}")


@dataclass(frozen=True)
class BatchRequest:
    line: int  # 1-based line number in the input file
    custom_id: str
    url: str
    body: dict[str, Any]

    def prefix_key(self) -> tuple[str, str]:
        """Orders requests so that those sharing a prompt prefix run together: the endpoint,
        then the prompt as the chat template sees it (tools, then messages, serialised
        canonically) or the completion's prompt."""
        if self.url == "/v1/chat/completions":
            prompt: object = [self.body.get("tools"), self.body.get("messages")]
        else:
            prompt = self.body.get("prompt")
        text = prompt if isinstance(prompt, str) else json.dumps(
            prompt, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
        return self.url, text


def read_requests(path: Path) -> list[BatchRequest]:
    """Every request of an input file, or ``BatchFileError`` for the first bad line: not a
    JSON object, a missing or repeated ``custom_id``, a method other than POST, an endpoint
    other than completions or chat completions, a body that is not an object, streaming."""
    requests: list[BatchRequest] = []
    seen: dict[str, int] = {}
    with path.open(encoding="utf-8") as lines:
        for number, text in enumerate(lines, start=1):
            if not text.strip():
                continue
            request = _parse_request(path, number, text)
            if request.custom_id in seen:
                raise BatchFileError(path, number, "custom_id",
                                     f"{request.custom_id!r} is already used on line "
                                     f"{seen[request.custom_id]}")
            seen[request.custom_id] = number
            requests.append(request)
    return requests


def _parse_request(path: Path, number: int, text: str) -> BatchRequest:
    try:
        line = json.loads(text)
    except json.JSONDecodeError as exc:
        raise BatchFileError(path, number, None, f"not valid JSON ({exc.msg} at column "
                                                 f"{exc.colno})") from None
    if not isinstance(line, dict):
        raise BatchFileError(path, number, None, "must be a JSON object")
    custom_id = line.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        raise BatchFileError(path, number, "custom_id", "must be a non-empty string"
                             if "custom_id" in line else "is missing")
    if line.get("method") != "POST":
        raise BatchFileError(path, number, "method", f"must be \"POST\", got "
                                                     f"{line.get('method')!r}")
    url = line.get("url")
    if url not in SUPPORTED_URLS:
        raise BatchFileError(path, number, "url", f"must be one of {', '.join(SUPPORTED_URLS)}"
                                                  f", got {url!r}")
    body = line.get("body")
    if not isinstance(body, dict):
        raise BatchFileError(path, number, "body", "must be a JSON object")
    if body.get("stream"):
        raise BatchFileError(path, number, "body.stream",
                             "streaming is not supported in a batch (each result is one line)")
    unknown = sorted(set(line) - {"custom_id", "method", "url", "body"})
    if unknown:
        raise BatchFileError(path, number, unknown[0], "unknown field")
    return BatchRequest(number, custom_id, url, body)


def read_done(path: Path, expected: set[str]) -> tuple[set[str], set[str]]:
    """The ``custom_id``s an output file already holds: those answered, and those whose last
    line is an ``error`` (sent again with ``--retry-failed``). The last line of a
    ``custom_id`` is its result; the lines before it must be errors. A last line cut short
    (the run was killed while writing it) is removed from the file, so appending goes on
    cleanly. A complete line that does not parse, names a ``custom_id`` not in ``expected``
    (the input's), or follows an answer of the same ``custom_id`` is a ``BatchFileError``: the
    file is not this batch's output."""
    if not path.exists():
        return set(), set()
    data = path.read_bytes()
    complete = data.rfind(b"\n") + 1
    if complete < len(data):
        with path.open("r+b") as out:
            out.truncate(complete)
    answered: set[str] = set()
    errors: set[str] = set()
    for number, text in enumerate(data[:complete].decode("utf-8").splitlines(), start=1):
        try:
            line = json.loads(text)
            custom_id, error = line["custom_id"], line.get("error")
        except (json.JSONDecodeError, TypeError, KeyError):
            raise BatchFileError(path, number, None, "not a batch output line; is it this "
                                                     "batch's output?") from None
        if custom_id not in expected:
            raise BatchFileError(path, number, "custom_id",
                                 f"{custom_id!r} is not in the input; is it this batch's "
                                 f"output? (--restart starts it over)")
        if custom_id in answered:
            raise BatchFileError(path, number, "custom_id", f"{custom_id!r} is answered twice")
        errors.discard(custom_id)
        (answered if error is None else errors).add(custom_id)
    return answered, errors


def response_line(custom_id: str, status_code: int, body: Any) -> dict[str, Any]:
    """The output line of a request the server answered."""
    line_id = _line_id()
    request_id = body.get("id") if isinstance(body, dict) else None
    return {"id": line_id, "custom_id": custom_id,
            "response": {"status_code": status_code,
                         "request_id": request_id if isinstance(request_id, str) else line_id,
                         "body": body},
            "error": None}


def error_line(custom_id: str, code: str, message: str, status_code: int | None = None,
               body: Any = None) -> dict[str, Any]:
    """The output line of a request that got no answer after its retries: the last 5xx (its
    ``status_code`` and ``body``) or none (a timeout, a lost connection), and the ``error``."""
    line_id = _line_id()
    response = (None if status_code is None else
                {"status_code": status_code, "request_id": line_id, "body": body})
    return {"id": line_id, "custom_id": custom_id, "response": response,
            "error": {"code": code, "message": message}}


def _line_id() -> str:
    return f"batch_req_{uuid.uuid4().hex}"


class OutputLocked(ValueError):
    """Another run holds the output's lock (the CLI's usage error, exit 2)."""


class Output:
    """The output file of one run, held under an exclusive ``flock`` until closed (another
    run on the same file is refused at once; the lock goes with the process, killed too).
    Lines are appended whole and flushed to the OS, so a killed run loses at most the line
    being written (a torn last line, which ``read_done`` removes); a thread fsyncs them every
    ``FSYNC_INTERVAL_S`` and ``close`` once more, so a crash of the machine loses at most the
    last interval's."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        created = not path.exists()
        self.path = path
        self._file = path.open("a", encoding="utf-8")
        try:
            fcntl.flock(self._file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._file.close()
            raise OutputLocked(f"{path}: another tandem batch run is writing this output (it "
                               f"holds the file's lock); wait for it to end or stop it, or "
                               f"choose another --output") from None
        if created:  # the file's name too survives a crash
            directory = os.open(path.parent, os.O_RDONLY)
            try:
                os.fsync(directory)
            finally:
                os.close(directory)
        self.unsynced_lines = 0
        self._count = threading.Lock()
        self._closing = threading.Event()
        self._syncer = threading.Thread(target=self._sync_every_interval, daemon=True,
                                        name="batch-output-fsync")
        self._syncer.start()

    def empty(self) -> None:
        """Remove every line (``--restart``)."""
        self._file.truncate(0)

    def write(self, line: dict[str, Any]) -> None:
        self._file.write(json.dumps(line, ensure_ascii=False) + "\n")
        self._file.flush()
        with self._count:
            self.unsynced_lines += 1

    def sync(self) -> None:
        """fsync, if lines were written since the last."""
        with self._count:
            unsynced, self.unsynced_lines = self.unsynced_lines, 0
        if unsynced:
            os.fsync(self._file.fileno())

    def _sync_every_interval(self) -> None:
        while not self._closing.wait(FSYNC_INTERVAL_S):
            self.sync()

    def close(self) -> None:
        """The last fsync; the lock is released."""
        self._closing.set()
        self._syncer.join()
        try:
            self.sync()
        finally:
            self._file.close()

    def __enter__(self) -> Output:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
