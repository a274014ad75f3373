"""``tandem chat``: a terminal client that streams replies from a running server."""

from __future__ import annotations

import json
import sys
from typing import TextIO

import httpx

from tandem.services.serving.up_stats import bearer, ca_context


def stream_reply(client: httpx.Client, url: str, messages: list[dict[str, str]],
                 max_tokens: int, temperature: float, out: TextIO) -> str:
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": temperature,
            "stream": True}
    reply = []
    with client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            response.read()
            message = response.json().get("error", {}).get("message", response.text)
            raise RuntimeError(f"HTTP {response.status_code}: {message}")
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: "):])
            if "error" in chunk:
                raise RuntimeError(chunk["error"].get("message", "stream failed"))
            for choice in chunk.get("choices", ()):
                text = choice.get("delta", {}).get("content") or ""
                reply.append(text)
                out.write(text)
                out.flush()
    out.write("\n")
    return "".join(reply)


CONNECT_TIMEOUT_S = 5.0


def run(url: str, max_tokens: int, temperature: float, system: str | None,
        prompt: str | None = None, inp: TextIO = sys.stdin, out: TextIO = sys.stdout,
        api_key: str | None = None, cacert: str | None = None, timeout_s: float = 60.0) -> int:
    """One question (``prompt``) or an interactive loop; history is kept for the session.
    ``api_key``: sent as Bearer; ``cacert``: whom to trust for an https URL; ``timeout_s``: the
    longest wait for the server's answer or its next chunk (a ``TimeoutError`` after it)."""
    messages = [{"role": "system", "content": system}] if system else []
    url = url.rstrip("/").removesuffix("/v1")
    with httpx.Client(timeout=httpx.Timeout(timeout_s, connect=CONNECT_TIMEOUT_S),
                      headers=bearer(api_key), verify=ca_context(cacert) or True) as client:
        while True:
            if prompt is None:
                out.write("> ")
                out.flush()
                line = inp.readline()
                if not line:
                    return 0
                question = line.strip()
                if not question:
                    continue
            else:
                question = prompt
            messages.append({"role": "user", "content": question})
            try:
                answer = stream_reply(client, url, messages, max_tokens, temperature, out)
            except httpx.TimeoutException as exc:
                raise TimeoutError(f"{url} sent nothing for {timeout_s:g} s (--timeout)"
                                   if isinstance(exc, httpx.ReadTimeout) else
                                   f"cannot reach {url}: timed out") from exc
            messages.append({"role": "assistant", "content": answer})
            if prompt is not None:
                return 0
