"""OpenAI request bodies (the subset Tandem serves), validated with pydantic.

Unknown fields are ignored, as OpenAI-compatible servers do; fields that would change the
result but are not implemented are rejected by ``unsupported_fields`` instead of ignored.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

from services.gateway.errors import GatewayError, unsupported
from services.gateway.inputs import SamplingOptions


def _integral(value: object) -> object:
    """JSON Schema's integers include 8.0 (what the OpenAPI document promises): take it as 8."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


Int = Annotated[int, BeforeValidator(_integral)]


class _Body(BaseModel):
    # Strict: a value of another JSON type is a 400, not converted (`"seed": true` is not seed 1,
    # nor `"max_tokens": "8"` 8), as OpenAI does; integers are numbers, 8.0 is an integer (`Int`).
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False, strict=True)


class StreamOptions(_Body):
    include_usage: bool = False


class _CommonRequest(_Body):
    model: str | None = None  # missing: the served model
    max_tokens: Int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: Int | None = Field(None, ge=-1)  # extension; 0 or -1: off
    seed: Int | None = None
    stop: str | list[str] | None = None
    n: Int = Field(1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # accepted, not used: end users may share cached prefixes
    cache_salt: str | None = None  # extension: per-tenant prefix-cache isolation
    ignore_eos: bool = False  # extension
    # Extensions: speculative decoding (when the server runs it) per request.
    speculative: bool = True  # false: decode this request without drafts
    num_speculative_tokens: Int | None = Field(None, ge=1, le=16)  # cap on drafts per step
    return_token_ids: bool = False  # extension: token ids in every choice (and the prompt's)
    # Extension: seconds the whole request may take (504 after); the server's limit caps it.
    timeout: float | None = Field(None, gt=0.0)
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None

    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def salt(self) -> str | None:
        return self.cache_salt or None

    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def _common_unsupported(self) -> GatewayError | None:
        if self.n != 1:
            return unsupported("n", f"n={self.n} (only n=1)")
        if self.presence_penalty or self.frequency_penalty:
            return unsupported("presence_penalty" if self.presence_penalty
                               else "frequency_penalty", "a presence or frequency penalty")
        if self.logit_bias:
            return unsupported("logit_bias", "logit_bias")
        if self.stream_options is not None and not self.stream:
            return GatewayError(400, "stream_options is only allowed with stream=true",
                                param="stream_options")
        return None


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart | dict[str, Any]] | None = None

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = []
        for part in self.content:
            if not isinstance(part, TextPart):
                kind = part.get("type", "unknown")
                raise unsupported("messages", f"a content part of type {kind!r}")
            parts.append(part.text)
        return "".join(parts)


class ChatCompletionRequest(_CommonRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: Int | None = Field(None, ge=0, le=20)
    tools: list[dict[str, Any]] | None = None
    response_format: dict[str, Any] | None = None

    def unsupported_fields(self) -> GatewayError | None:
        if self.tools:
            return unsupported("tools", "tool calling")
        if self.response_format and self.response_format.get("type", "text") != "text":
            return unsupported("response_format", "a response_format other than text")
        if self.top_logprobs and not self.logprobs:
            return GatewayError(400, "top_logprobs requires logprobs=true", param="top_logprobs")
        return self._common_unsupported()

    def chat_messages(self) -> list[dict[str, str]]:
        # The system prompt by its newer name: templates know "system".
        return [{"role": "system" if m.role == "developer" else m.role, "content": m.text()}
                for m in self.messages]

    def sampling_options(self) -> SamplingOptions:
        return SamplingOptions(
            max_tokens=self.max_completion_tokens or self.max_tokens,
            temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, seed=self.seed,
            stop=self.stop_strings(), ignore_eos=self.ignore_eos,
            logprobs=(self.top_logprobs or 0) if self.logprobs else None,
            speculative=self.speculative, num_speculative_tokens=self.num_speculative_tokens,
            timeout_s=self.timeout)


class CompletionRequest(_CommonRequest):
    prompt: str | list[str] | list[Int] | list[list[Int]]
    logprobs: Int | None = Field(None, ge=0, le=20)
    echo: bool = False
    suffix: str | None = None
    best_of: Int | None = None

    def unsupported_fields(self) -> GatewayError | None:
        if self.echo:
            return unsupported("echo", "echo")
        if self.suffix:
            return unsupported("suffix", "suffix")
        if self.best_of not in (None, 1):
            return unsupported("best_of", f"best_of={self.best_of} (only 1)")
        if isinstance(self.prompt, list) and len(self.prompt) != 1 and not all(
                isinstance(p, int) for p in self.prompt):
            return unsupported("prompt", "more than one prompt per request")
        return self._common_unsupported()

    def single_prompt(self) -> str | list[int]:
        """The prompt as text or as token ids (a one-element batch is unwrapped)."""
        prompt = self.prompt
        if isinstance(prompt, list) and len(prompt) == 1 and not isinstance(prompt[0], int):
            return prompt[0]  # type: ignore[return-value]
        return prompt  # type: ignore[return-value]

    def sampling_options(self) -> SamplingOptions:
        return SamplingOptions(
            max_tokens=self.max_tokens, temperature=self.temperature, top_p=self.top_p,
            top_k=self.top_k, seed=self.seed, stop=self.stop_strings(),
            ignore_eos=self.ignore_eos, logprobs=self.logprobs, speculative=self.speculative,
            num_speculative_tokens=self.num_speculative_tokens, timeout_s=self.timeout)


class ErrorDetail(BaseModel):
    """What went wrong: ``param`` names the offending field where there is one."""

    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """OpenAI's error body, the shape of every error response (``GatewayError.to_json``); it is
    only described in the OpenAPI document, not built."""

    error: ErrorDetail
