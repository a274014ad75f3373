"""Streaming client for OpenAI-compatible servers: /v1/completions and /v1/chat/completions."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import httpx

from tandem.loadtest.bench.clients import (
    PREFLIGHT_TIMEOUT_S,
    ClientOptions,
    Target,
    TargetError,
    finish_output_count,
)
from tandem.loadtest.bench.workloads import BenchRequest
from tandem.services.protocol.bench_records import RequestRecord


class HttpClient:
    def __init__(self, target: Target, options: ClientOptions) -> None:
        self.target = target
        self.options = options
        self.model = options.model
        self._http = httpx.AsyncClient(
            timeout=httpx.Timeout(options.request_timeout_s, connect=PREFLIGHT_TIMEOUT_S),
            # The pool must never be what limits concurrency.
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=None),
            trust_env=False,  # no proxies: the target is addressed directly
        )
        self._headers = ({"Authorization": f"Bearer {options.api_key}"} if options.api_key
                         else {})

    async def preflight(self) -> str:
        url = f"{self.target.address}/models"
        try:
            response = await self._http.get(url, headers=self._headers,
                                            timeout=PREFLIGHT_TIMEOUT_S)
        except httpx.HTTPError as exc:
            raise TargetError(f"cannot reach {self.target.address}: {_describe(exc)}") from exc
        if response.status_code in (401, 403):
            raise TargetError(f"{self.target.address} rejected the request "
                              f"(HTTP {response.status_code}): check --api-key")
        if self.model is None:
            try:
                self.model = str(response.raise_for_status().json()["data"][0]["id"])
            except (httpx.HTTPError, ValueError, LookupError, TypeError) as exc:
                raise TargetError(f"{url} lists no model ({_describe(exc)}): pass --model"
                                  ) from exc
        return self.model

    async def aclose(self) -> None:
        await self._http.aclose()

    def _payload(self, request: BenchRequest) -> dict[str, Any]:
        payload: dict[str, Any] = {
            "model": self.model, "max_tokens": request.max_tokens, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": self.options.ignore_eos,
            "temperature": self.options.temperature,
        }
        if self.options.endpoint == "chat":
            if request.messages is None:
                raise ValueError(f"request {request.index} has no chat messages")
            payload["messages"] = [m.as_dict() for m in request.messages]
        else:
            if request.prompt is None:
                raise ValueError(f"request {request.index} has no prompt text")
            payload["prompt"] = request.prompt
        return payload

    async def send(self, request: BenchRequest, origin: float) -> RequestRecord:
        chat = self.options.endpoint == "chat"
        url = f"{self.target.address}/{'chat/completions' if chat else 'completions'}"
        payload = self._payload(request)
        record = RequestRecord(request.index, request.kind, request.group,
                               request.prompt_tokens, start_s=time.perf_counter() - origin)
        try:
            async with asyncio.timeout(self.options.request_timeout_s):
                async with self._http.stream("POST", url, json=payload,
                                             headers=self._headers) as response:
                    if response.status_code != 200:
                        body = (await response.aread()).decode(errors="replace")
                        record.error = f"HTTP {response.status_code}: {_error_message(body)}"
                        record.rejected = response.status_code == 429
                        return record
                    record.admitted = True
                    await self._read_events(response, record, origin, chat)
        except TimeoutError:
            record.error = f"timed out after {self.options.request_timeout_s:g} s"
        except httpx.HTTPError as exc:
            record.error = _describe(exc)
        return record

    async def _read_events(self, response: httpx.Response, record: RequestRecord,
                           origin: float, chat: bool) -> None:
        text: list[str] = []
        usage_tokens: int | None = None
        done = False
        async for line in response.aiter_lines():
            if not line.startswith("data:"):
                continue  # blank separators, ": keep-alive" comments, event/id fields
            data = line[5:].strip()
            now = time.perf_counter() - origin
            if data == "[DONE]":
                done = True
                break
            try:
                event = json.loads(data)
            except json.JSONDecodeError:
                record.error = f"invalid SSE data: {data[:200]}"
                return
            if "error" in event and not event.get("choices"):
                record.error = f"server error in stream: {_error_message(json.dumps(event))}"
                return
            piece = _chunk_text(event, chat)
            if piece:
                if record.first_token_s is None:
                    record.first_token_s = now
                record.chunk_times_s.append(now)
                text.append(piece)
            usage = event.get("usage")
            if isinstance(usage, dict):
                usage_tokens = _int_or_none(usage.get("completion_tokens"))
                record.server_prompt_tokens = _int_or_none(usage.get("prompt_tokens"))
                details = usage.get("prompt_tokens_details")
                if isinstance(details, dict):
                    record.cached_tokens = _int_or_none(details.get("cached_tokens"))
        record.end_s = time.perf_counter() - origin
        finish_output_count(record, usage_tokens, "".join(text), self.options)
        if not done:
            record.error = "the stream ended before [DONE]"
        elif record.first_token_s is None:
            record.error = "the stream carried no output"


def _chunk_text(event: dict[str, Any], chat: bool) -> str:
    # A chunk counts as output when it carries text; role-only and usage-only chunks do not.
    choices = event.get("choices")
    if not choices:
        return ""
    choice = choices[0]
    if not chat:
        return str(choice.get("text") or "")
    delta = choice.get("delta") or {}
    return str(delta.get("content") or delta.get("reasoning_content") or "")


def _int_or_none(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _error_message(body: str) -> str:
    try:
        error = json.loads(body).get("error")
        if isinstance(error, dict) and error.get("message"):
            return str(error["message"])
        if isinstance(error, str):
            return error
    except (ValueError, AttributeError):
        pass
    return body.strip()[:300] or "(empty body)"


def _describe(exc: BaseException) -> str:
    detail = str(exc) or repr(exc)
    return f"{type(exc).__name__}: {detail}"
