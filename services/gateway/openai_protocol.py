"""The OpenAI wire format: request bodies (what Tandem serves), validated with pydantic, and the
response objects (JSON-ready dicts) and SSE events built from the pipeline's deltas.

Nothing a client sends is silently ignored: every field either works or the request is refused
with a 400 naming it. Fields of OpenAI's and vLLM's APIs that Tandem does not implement are
listed in ``NOT_SUPPORTED`` and refused by name unless they hold their default (what the client
would get anyway); any other unknown field is refused as unknown.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

from tandem.services.gateway.core import MAX_CHOICES, SamplingOptions, template_message
from tandem.services.gateway.errors import GatewayError, bad_request, unsupported
from tandem.services.gateway.pipeline import Delta, Usage
from tandem.services.gateway.token_text import TokenText
from tandem.services.gateway.tools import CallDelta, Function, ToolCall, assistant_calls_text
from tandem.services.gateway.tools import constraint as tool_constraint
from tandem.services.protocol.outputs import TokenLogprobs
from tandem.services.protocol.request import StructuredOutput


def _integral(value: object) -> object:
    """JSON Schema's integers include 8.0 (what the OpenAPI document promises): take it as 8."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


Int = Annotated[int, BeforeValidator(_integral)]
OPENAI_COMPLETIONS_MAX_TOKENS = 16  # /v1/completions without max_tokens, as OpenAI and vLLM
MAX_SESSION_CHARS = 256


class _Body(BaseModel):
    # Strict: a value of another JSON type is a 400, not converted (`"seed": true` is not seed 1,
    # nor `"max_tokens": "8"` 8), as OpenAI does; integers are numbers, 8.0 is an integer (`Int`).
    # Unknown fields are refused (the request bodies check theirs against NOT_SUPPORTED).
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, strict=True)


# Request fields of OpenAI's and vLLM's APIs that Tandem does not implement: what each is, and
# the values that ask for nothing (accepted: the client gets what it asked for).
_OFF: tuple[object, ...] = (None,)
_TOOLS = "the deprecated function calling (use tools)"
_STRUCTURED = "this structured output option"
_BEAM = "beam search"
_MULTIMODAL = "multimodal input"
_REASONING = "reasoning controls"
_STORED = "stored completions (store, metadata)"
NOT_SUPPORTED: dict[str, tuple[str, tuple[object, ...]]] = {
    "functions": (_TOOLS, (None, [])),
    "function_call": (_TOOLS, (None, "none", "auto")),
    "guided_decoding_backend": (_STRUCTURED, _OFF),
    "guided_whitespace_pattern": (_STRUCTURED, _OFF),
    "use_beam_search": (_BEAM, (None, False)),
    "length_penalty": (_BEAM, (None, 1.0)),
    "include_stop_str_in_output": ("stop strings kept in the output", (None, False)),
    "skip_special_tokens": ("special tokens in the text", (None, True)),
    "spaces_between_special_tokens": ("special-token spacing", (None, True)),
    "truncate_prompt_tokens": ("prompt truncation", _OFF),
    "truncation_side": ("prompt truncation", _OFF),
    "prompt_logprobs": ("prompt logprobs", _OFF),
    "logprob_token_ids": ("logprobs of chosen token ids", _OFF),
    "allowed_token_ids": ("allowed_token_ids", _OFF),
    "bad_words": ("bad_words", (None, [])),
    "add_generation_prompt": ("add_generation_prompt=false", (None, True)),
    "continue_final_message": ("continue_final_message", (None, False)),
    "documents": ("documents for the chat template", _OFF),
    "chat_template": ("a per-request chat template", _OFF),
    "media_io_kwargs": (_MULTIMODAL, _OFF),
    "mm_processor_kwargs": (_MULTIMODAL, _OFF),
    "mm_payload": (_MULTIMODAL, (None, "tensors")),
    "return_mm_kwargs": (_MULTIMODAL, (None, False)),
    "prompt_embeds": ("prompt embeddings", _OFF),
    "audio": ("audio output", _OFF),
    "modalities": ("output modalities other than text", (None, ["text"])),
    "prediction": ("predicted outputs", _OFF),
    "priority": ("request priorities", (None, 0)),
    "request_id": ("a client request id over HTTP", _OFF),
    "return_tokens_as_token_ids": ("tokens as token ids", (None, False)),
    "return_token_offsets": ("token offsets", (None, False)),
    "return_prompt_text": ("the prompt's text", (None, False)),
    "routed_experts_prompt_start": ("expert routing", (None, 0)),
    "kv_transfer_params": ("external KV transfer", _OFF),
    "ec_transfer_params": ("external encoder-cache transfer", _OFF),
    "vllm_xargs": ("vllm_xargs", (None, {})),
    "repetition_detection": ("repetition detection", _OFF),
    "stream_interval": ("stream_interval", (None, 1)),
    "watermarking": ("watermarking", _OFF),
    "thinking_token_budget": (_REASONING, _OFF),
    "include_reasoning": (_REASONING, (None, True)),
    "verbosity": ("verbosity", (None, "medium")),
    "web_search_options": ("web search", _OFF),
    "store": (_STORED, (None, False)),
    "metadata": (_STORED, (None, {})),
    "service_tier": ("service tiers", (None, "auto", "default")),
}


def _same(value: object, default: object) -> bool:
    """JSON equality: true is not 1, 1 is 1.0."""
    if isinstance(value, bool) or isinstance(default, bool):
        return value is default
    return value == default


def refused_extra(extra: dict[str, Any] | None) -> GatewayError | None:
    """The first field of ``extra`` (fields no model declares) that asks for something."""
    for name, value in (extra or {}).items():
        if name not in NOT_SUPPORTED:
            return bad_request(f"Unknown field {name!r}", param=name, code="unknown_field")
        what, defaults = NOT_SUPPORTED[name]
        if not any(_same(value, d) for d in defaults):
            return unsupported(name, f"{name}={value!r}: {what}")
    return None


def _constraint(key: str, value: object, param: str) -> StructuredOutput:
    """vLLM's spelling of a constraint (``json``: a schema, as an object or as JSON text;
    ``regex``, ``grammar``: text; ``choice``: a list of strings; ``json_object``: true)."""
    if key == "json_object":
        return StructuredOutput("json", '{"type": "object"}')
    if key == "json":
        if isinstance(value, str):
            return StructuredOutput("json", value)
        if isinstance(value, dict):
            return StructuredOutput("json", json.dumps(value))
    elif key == "choice":
        if isinstance(value, list) and value and all(isinstance(c, str) and c for c in value):
            return StructuredOutput("choice", json.dumps(value))
    elif isinstance(value, str):
        return StructuredOutput(key, value)
    raise bad_request(f"{param} has the wrong type", param=param)


class RequestBody(_Body):
    # Top level: unknown fields land in model_extra and are checked against NOT_SUPPORTED. The
    # OpenAPI document promises no more than the declared fields.
    model_config = ConfigDict(extra="allow", json_schema_extra={"additionalProperties": False})


class StreamOptions(_Body):
    include_usage: bool = False


class _CommonRequest(RequestBody):
    model: str | None = None  # missing: the served model
    max_tokens: Int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: Int | None = Field(None, ge=-1)  # extension; 0 or -1: off
    seed: Int | None = None
    stop: str | list[str] | None = None
    n: Int = Field(1, ge=1, le=MAX_CHOICES)  # choices, each streamed with its index
    stream: bool = False
    stream_options: StreamOptions | None = None
    cache_salt: str | None = None  # extension: per-tenant prefix-cache isolation
    # A session (OpenAI's prompt_cache_key, vLLM's session_id; one name, or both the same): the
    # router keeps its requests on the same decode worker while that worker is healthy and not
    # overloaded (router/sessions.py). Scoped by tenant; never a cache key of its own.
    prompt_cache_key: str | None = Field(None, min_length=1, max_length=MAX_SESSION_CHARS)
    session_id: str | None = Field(None, min_length=1, max_length=MAX_SESSION_CHARS)
    # True: the tokenizer's BOS before the prompt where the model has one (completions'
    # default); chat's default is false (the chat template writes the special tokens).
    add_special_tokens: bool | None = None
    ignore_eos: bool = False  # extension
    # Extensions: speculative decoding (when the server runs it) per request.
    speculative: bool = True  # false: decode this request without drafts
    num_speculative_tokens: Int | None = Field(None, ge=1, le=16)  # cap on drafts per step
    return_token_ids: bool = False  # extension: token ids in every choice (and the prompt's)
    # Extension: seconds the whole request may take (504 after); the server's limit caps it.
    timeout: float | None = Field(None, gt=0.0)
    user: str | None = None  # accepted, not used: end users may share cached prefixes
    safety_identifier: str | None = None  # accepted, not used (as user)
    # Logits controls (engine/logits_controls.py); OpenAI's bounds, vLLM's extensions.
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None  # token id (as a string) -> -100..100
    repetition_penalty: float | None = Field(None, gt=0.0, le=10.0)  # extension
    min_p: float | None = Field(None, ge=0.0, le=1.0)  # extension
    min_tokens: Int | None = Field(None, ge=0)  # extension
    stop_token_ids: list[Int] | None = None  # extension
    # Structured output (engine/grammar.py): OpenAI's response_format, vLLM's
    # structured_outputs and its older guided_* fields; at most one constraint.
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def salt(self) -> str | None:
        return self.cache_salt or None

    def session(self) -> str | None:
        if (self.prompt_cache_key and self.session_id
                and self.prompt_cache_key != self.session_id):
            raise bad_request("prompt_cache_key and session_id name different sessions; give "
                              "one", param="session_id")
        return self.prompt_cache_key or self.session_id

    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def token_bias(self) -> dict[int, float] | None:
        """``logit_bias`` keyed by token id (JSON keys are strings)."""
        if self.logit_bias is None:
            return None
        bias = {}
        for key, value in self.logit_bias.items():
            if not key.strip().lstrip("-").isdigit():
                raise bad_request(f"logit_bias keys must be token ids, got {key!r}",
                                  param="logit_bias")
            bias[int(key)] = value
        return bias

    def structured_output(self) -> StructuredOutput | None:
        found = self.structured_output_field()
        return found[1] if found else None

    def structured_output_field(self) -> tuple[str, StructuredOutput] | None:
        """The request's constraint and the field that states it (400 if several do)."""
        try:
            found = [(name, c) for name, c in (("response_format", self._response_format()),
                                               ("structured_outputs", self._structured_outputs()),
                                               *self._guided()) if c is not None]
        except ValueError as exc:  # StructuredOutput's own checks (the spec's size)
            raise bad_request(str(exc), param="structured_output") from None
        if len(found) > 1:
            raise bad_request(f"{found[0][0]} and {found[1][0]} both constrain the output; "
                              "give one", param=found[1][0])
        return found[0] if found else None

    def _response_format(self) -> StructuredOutput | None:
        rf = self.response_format
        if rf is None:
            return None
        kind = rf.get("type")
        if kind == "text":
            return None
        if kind == "json_object":
            return StructuredOutput("json", '{"type": "object"}')
        if kind == "json_schema":
            spec = rf.get("json_schema")
            if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict | bool):
                raise bad_request("response_format json_schema needs json_schema.schema, a "
                                  "JSON schema", param="response_format.json_schema")
            return StructuredOutput("json", json.dumps(spec["schema"]))
        raise bad_request(f"response_format type must be text, json_object or json_schema, "
                          f"got {kind!r}", param="response_format.type")

    def _structured_outputs(self) -> StructuredOutput | None:
        so = self.structured_outputs
        if so is None:
            return None
        given = {k: v for k, v in so.items() if v is not None and v is not False}
        unknown = sorted(set(given) - {"json", "regex", "choice", "grammar", "json_object"})
        if unknown:
            raise unsupported(f"structured_outputs.{unknown[0]}",
                              f"structured_outputs.{unknown[0]}")
        if len(given) != 1:
            raise bad_request("structured_outputs takes exactly one of json, regex, choice, "
                              "grammar, json_object", param="structured_outputs")
        (key, value), = given.items()
        return _constraint(key, value, f"structured_outputs.{key}")

    def _guided(self) -> list[tuple[str, StructuredOutput | None]]:
        return [(f"guided_{key}", None if value is None
                 else _constraint(key, value, f"guided_{key}"))
                for key, value in (("json", self.guided_json), ("regex", self.guided_regex),
                                   ("choice", self.guided_choice),
                                   ("grammar", self.guided_grammar))]

    def controls(self) -> dict[str, Any]:
        """The logits controls as ``SamplingOptions`` fields."""
        return {"stop_token_ids": tuple(self.stop_token_ids or ()),
                "min_tokens": self.min_tokens, "logit_bias": self.token_bias(),
                "presence_penalty": self.presence_penalty,
                "frequency_penalty": self.frequency_penalty,
                "repetition_penalty": self.repetition_penalty, "min_p": self.min_p}

    def _common_unsupported(self) -> GatewayError | None:
        if error := refused_extra(self.model_extra):
            return error
        if self.stream_options is not None and not self.stream:
            return GatewayError(400, "stream_options is only allowed with stream=true",
                                param="stream_options")
        return None


class TextPart(_Body):
    type: Literal["text"]
    text: str
    # Anthropic-style prompt-caching marker: accepted; every prefix is cached here anyway.
    cache_control: dict[str, Any] | None = None


class FunctionCall(_Body):
    name: str
    arguments: str  # JSON text


class ToolCallMessage(_Body):
    """An earlier assistant turn's tool call (as the API returned it)."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionDef(_Body):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; none: any object
    strict: bool | None = None  # the arguments always validate here (tool_choice required)


class Tool(_Body):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: NamedFunction


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart | dict[str, Any]] | None = None
    name: str | None = None  # accepted; the chat templates Tandem renders do not show it
    tool_calls: list[ToolCallMessage] | None = None  # assistant: the calls it made
    tool_call_id: str | None = None  # tool: the call this result answers
    # An earlier assistant turn as the API returned it: a refusal is what the model said (the
    # text when there is no content); annotations are the client's (not shown to the model);
    # its reasoning (vLLM's `reasoning`, or `reasoning_content`) goes to the template, which
    # shows it where the model's format does (e.g. Qwen3's last turn).
    refusal: str | None = None
    annotations: list[dict[str, Any]] | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or self.refusal or ""
        parts = []
        for part in self.content:
            if not isinstance(part, TextPart):
                kind = part.get("type", "unknown")
                raise unsupported("messages", f"a content part of type {kind!r}")
            parts.append(part.text)
        return "".join(parts)


def template_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """As the chat template reads them; earlier tool calls written the way the model calls."""
    rendered = []
    for m in messages:
        text = m.text()
        if m.tool_calls:
            calls = assistant_calls_text([c.model_dump() for c in m.tool_calls])
            text = f"{text}\n{calls}" if text else calls
        rendered.append(template_message(m.role, text, m.reasoning_content or m.reasoning))
    return rendered


class ChatCompletionRequest(_CommonRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: Int | None = Field(None, ge=0, le=20)
    echo: bool = False  # vLLM: the last message's text before the reply; only false
    # More variables for the chat template (e.g. enable_thinking); not the server's own.
    chat_template_kwargs: dict[str, Any] | None = None
    # The template's `reasoning_effort` variable (templates that take it, e.g. gpt-oss's).
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = None
    # Tool calling (gateway/tools.py).
    tools: list[Tool] | None = Field(None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None  # auto may call several; required one

    def unsupported_fields(self) -> GatewayError | None:
        if self.echo:
            return unsupported("echo", "echo on chat completions")
        if self.tool_choice not in (None, "none", "auto") and not self.tools:
            return bad_request("tool_choice needs tools", param="tool_choice")
        if isinstance(self.tool_choice, NamedToolChoice) and self.tools and not any(
                t.function.name == self.tool_choice.function.name for t in self.tools):
            return bad_request(f"tool_choice names {self.tool_choice.function.name!r}, which "
                               "is not among the tools", param="tool_choice")
        if self.top_logprobs and not self.logprobs:
            return GatewayError(400, "top_logprobs requires logprobs=true", param="top_logprobs")
        return self._common_unsupported()

    def chat_messages(self) -> list[dict[str, Any]]:
        return template_messages(self.messages)

    def template_kwargs(self) -> dict[str, Any] | None:
        """``chat_template_kwargs`` with ``reasoning_effort`` (400 if they disagree)."""
        kwargs = self.chat_template_kwargs
        if self.reasoning_effort is None:
            return kwargs
        given = (kwargs or {}).get("reasoning_effort", self.reasoning_effort)
        if given != self.reasoning_effort:
            raise bad_request("reasoning_effort and chat_template_kwargs.reasoning_effort "
                              "differ; give one", param="reasoning_effort")
        return {**(kwargs or {}), "reasoning_effort": self.reasoning_effort}

    def functions(self) -> list[Function]:
        return [Function(t.function.name, t.function.description, t.function.parameters)
                for t in self.tools or ()]

    def tool_mode(self) -> str | None:
        """None (no tools), none, auto, required, or the name of the function to call."""
        if not self.tools:
            return None
        if isinstance(self.tool_choice, NamedToolChoice):
            return self.tool_choice.function.name
        return self.tool_choice or "auto"

    def structured_output_field(self) -> tuple[str, StructuredOutput] | None:
        stated = super().structured_output_field()
        forced = tool_constraint(self.functions(), self.tool_mode()) if self.tools else None
        if forced is None:
            return stated
        if stated is not None:
            raise bad_request(f"tool_choice and {stated[0]} both constrain the output; give "
                              "one", param=stated[0])
        return "tool_choice", forced

    def sampling_options(self) -> SamplingOptions:
        return SamplingOptions(
            max_tokens=self.max_completion_tokens or self.max_tokens,
            temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, seed=self.seed,
            stop=self.stop_strings(), ignore_eos=self.ignore_eos,
            logprobs=(self.top_logprobs or 0) if self.logprobs else None,
            speculative=self.speculative, num_speculative_tokens=self.num_speculative_tokens,
            timeout_s=self.timeout, structured_output=self.structured_output(),
            **self.controls())


class CompletionRequest(_CommonRequest):
    prompt: str | list[str] | list[Int] | list[list[Int]]
    logprobs: Int | None = Field(None, ge=0, le=20)
    echo: bool = False  # the prompt's text before the completion's
    suffix: str | None = None
    # Generate this many choices and return the n with the highest sum of token logprobs.
    best_of: Int | None = Field(None, ge=1, le=MAX_CHOICES)

    def unsupported_fields(self) -> GatewayError | None:
        if self.suffix:
            return unsupported("suffix", "suffix")
        if self.best_of is not None and self.best_of < self.n:
            return bad_request(f"best_of ({self.best_of}) must be >= n ({self.n})",
                               param="best_of")
        if self.stream and self.best_of not in (None, self.n):
            return bad_request("best_of > n cannot be streamed: the best choices are known "
                               "only at the end", param="best_of")
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
            max_tokens=(OPENAI_COMPLETIONS_MAX_TOKENS if self.max_tokens is None
                        else self.max_tokens),
            temperature=self.temperature, top_p=self.top_p,
            top_k=self.top_k, seed=self.seed, stop=self.stop_strings(),
            ignore_eos=self.ignore_eos, logprobs=self.logprobs,
            prompt_logprobs=self.logprobs if self.echo else None, speculative=self.speculative,
            num_speculative_tokens=self.num_speculative_tokens, timeout_s=self.timeout,
            structured_output=self.structured_output(), **self.controls())


class TokenizeRequest(_Body):
    """``POST /tokenize`` (vLLM's): a prompt, or chat messages rendered with the template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None

    def checked(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise bad_request("give one of prompt or messages", param="prompt")
        return self


class DetokenizeRequest(_Body):
    """``POST /detokenize`` (vLLM's): token ids to text."""

    model: str | None = None
    tokens: list[Int]


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


_MIN_LOGPROB = -9999.0  # JSON has no -inf


def sse(data: dict[str, Any] | str) -> bytes:
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False,
                                                             separators=(",", ":"))
    return f"data: {payload}\n\n".encode()


SSE_DONE = sse("[DONE]")


def sse_event(event: dict[str, Any]) -> bytes:
    """A server-sent event named by its ``type`` (the Responses and Messages APIs' streams)."""
    return f"event: {event['type']}\n".encode() + sse(event)


def usage_json(usage: Usage | None) -> dict[str, Any] | None:
    if usage is None:
        return None
    return {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
            "total_tokens": usage.total_tokens,
            "prompt_tokens_details": {"cached_tokens": usage.cached_tokens}}


def _finish(reason: str | None, called: bool) -> str | None:
    """A reply that ended on its own with tool calls finishes as ``tool_calls``."""
    return "tool_calls" if called and reason == "stop" else reason


def _call_delta(delta: CallDelta) -> dict[str, Any]:
    """A streamed ``tool_calls`` entry: the call's id and name with its first."""
    function: dict[str, Any] = {"arguments": delta.arguments}
    entry: dict[str, Any] = {"index": delta.index, "function": function}
    if delta.started:
        entry.update(id=delta.call.id, type="function")
        function["name"] = delta.call.name
    return entry


def _lp(value: float) -> float:
    return max(value, _MIN_LOGPROB)


@dataclass
class ResponseContext:
    """What every response object of one request repeats."""

    id: str
    created: int
    model: str
    token_text: TokenText
    return_token_ids: bool = False

    def envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "choices": choices}

    def with_token_ids(self, choice: dict[str, Any], delta: Delta | None) -> dict[str, Any]:
        if self.return_token_ids:
            choice["token_ids"] = delta.token_ids if delta is not None else []
        return choice

    # -- chat ---------------------------------------------------------------------------

    def chat_logprobs(self, logprobs: list[TokenLogprobs]) -> dict[str, Any]:
        def entry(token_id: int, logprob: float) -> dict[str, Any]:
            return {"token": self.token_text.text(token_id), "logprob": _lp(logprob),
                    "bytes": self.token_text.bytes(token_id)}

        return {"content": [{**entry(lp.token_id, lp.logprob),
                             "top_logprobs": [entry(t, v) for t, v in lp.top]}
                            for lp in logprobs]}

    def chat_choice(self, delta: Delta, want_logprobs: bool, index: int = 0,
                    reply: tuple[str | None, Sequence[ToolCall]] | None = None,
                    reasoning: str | None = None) -> dict[str, Any]:
        """``reply``: the choice's text parsed for tool calls (none: its text); ``reasoning``:
        its reasoning, apart (gateway/reasoning.py)."""
        content, calls = reply if reply is not None else (delta.text, ())
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if reasoning is not None:
            message["reasoning_content"] = reasoning
        if calls:
            message["tool_calls"] = [call.to_json() for call in calls]
        return self.with_token_ids({
            "index": index,
            "message": message,
            "logprobs": self.chat_logprobs(delta.logprobs) if want_logprobs else None,
            "finish_reason": _finish(delta.finish_reason, bool(calls)),
        }, delta)

    def chat_completion(self, choices: list[dict[str, Any]], usage: Usage | None,
                        prompt_token_ids: list[int]) -> dict[str, Any]:
        body = self.envelope("chat.completion", choices)
        body["usage"] = usage_json(usage)
        if self.return_token_ids:
            body["prompt_token_ids"] = prompt_token_ids
        return body

    def chat_chunk(self, delta: Delta | None, want_logprobs: bool, first: bool = False,
                   content: str | None = None, calls: Sequence[CallDelta] = (),
                   called: bool = False, index: int = 0, reasoning: str = "") -> dict[str, Any]:
        """``content``: the delta's content (None: its text); ``calls``: what it adds to the
        reply's tool calls; ``called``: the reply made calls (a stop finishes as
        ``tool_calls``); ``reasoning``: the delta's reasoning text."""
        message: dict[str, Any] = {"role": "assistant", "content": ""} if first else {}
        choice: dict[str, Any] = {"index": index, "delta": message, "logprobs": None,
                                  "finish_reason": None}
        if delta is not None:
            text = delta.text if content is None else content
            if reasoning:
                message["reasoning_content"] = reasoning
            if text:
                message["content"] = text
            if calls:
                message["tool_calls"] = [_call_delta(call) for call in calls]
            if want_logprobs and delta.logprobs:
                choice["logprobs"] = self.chat_logprobs(delta.logprobs)
            choice["finish_reason"] = _finish(delta.finish_reason, called)
        self.with_token_ids(choice, delta)
        return self.envelope("chat.completion.chunk", [choice])

    def usage_chunk(self, obj: str, usage: Usage | None) -> dict[str, Any]:
        body = self.envelope(obj, [])
        body["usage"] = usage_json(usage)
        return body

    # -- completions --------------------------------------------------------------------

    def completion_logprobs(self, delta: Delta) -> dict[str, Any]:
        tt = self.token_text
        return {
            "tokens": [tt.text(lp.token_id) for lp in delta.logprobs],
            "token_logprobs": [_lp(lp.logprob) for lp in delta.logprobs],
            "top_logprobs": [{tt.text(t): _lp(v) for t, v in lp.top} for lp in delta.logprobs],
            "text_offset": delta.text_offsets[:len(delta.logprobs)],
        }

    def echoed_logprobs(self, prompt_token_ids: list[int],
                        prompt_logprobs: Sequence[TokenLogprobs] | None,
                        then: dict[str, Any] | None = None) -> dict[str, Any]:
        """``echo`` with ``logprobs``: the prompt's tokens and logprobs (the first token has
        none), followed by ``then`` (the completion's, offsets already after the prompt)."""
        tt = self.token_text
        texts = [tt.text(t) for t in prompt_token_ids]
        lps = list(prompt_logprobs or ())
        then = then or {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                        "text_offset": []}
        return {
            "tokens": texts + then["tokens"],
            "token_logprobs": [None, *(_lp(lp.logprob) for lp in lps)] + then["token_logprobs"],
            "top_logprobs": [None, *({tt.text(t): _lp(v) for t, v in lp.top} for lp in lps)]
            + then["top_logprobs"],
            "text_offset": list(itertools.accumulate((len(t) for t in texts[:-1]), initial=0))
            + then["text_offset"],
        }

    def completion_choice(self, delta: Delta, want_logprobs: bool, index: int = 0
                          ) -> dict[str, Any]:
        return self.with_token_ids({
            "index": index,
            "text": delta.text,
            "logprobs": self.completion_logprobs(delta) if want_logprobs else None,
            "finish_reason": delta.finish_reason,
        }, delta)

    def completion(self, choices: list[dict[str, Any]], usage: Usage | None,
                   prompt_token_ids: list[int]) -> dict[str, Any]:
        body = self.envelope("text_completion", choices)
        body["usage"] = usage_json(usage)
        if self.return_token_ids:
            body["prompt_token_ids"] = prompt_token_ids
        return body

    def completion_chunk(self, delta: Delta, want_logprobs: bool, index: int = 0
                         ) -> dict[str, Any]:
        return self.envelope("text_completion",
                             [self.completion_choice(delta, want_logprobs, index)])
