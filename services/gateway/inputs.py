"""From a client's prompt and options to a validated, tokenized ``GenerationRequest``.

Both front ends go through here, so HTTP and gRPC accept and reject exactly the same things.
"""

from __future__ import annotations

import math
import secrets
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from jinja2 import TemplateError

from tandem.services.engine.tokenizer import TEMPLATE_VARIABLES, Tokenizer
from tandem.services.gateway.errors import bad_request
from tandem.services.protocol.request import (
    DEFAULT_TENANT,
    GenerationRequest,
    SamplingParams,
    StructuredOutput,
)

MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 1024
MAX_STOP_TOKEN_IDS = 64
MAX_LOGIT_BIAS_TOKENS = 1024
MAX_CHOICES = 16  # n and best_of: each choice is a request of its own (core.start_choices)
_INT64 = (-(2**63), 2**64 - 1)  # what torch.Generator.manual_seed accepts


@dataclass(frozen=True)
class SamplingOptions:
    """Sampling as a client states it; None means the default."""

    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # 0 or -1: off
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # None: none; 0: the sampled token's; n: plus the top n
    prompt_logprobs: int | None = None  # the prompt's, likewise (completions echo + logprobs)
    speculative: bool = True  # speculative decoding, where the server runs it
    num_speculative_tokens: int | None = None  # cap on draft tokens per step
    timeout_s: float | None = None  # the client's deadline for the whole request, if any
    # Logits controls (engine/logits_controls.py); None or empty: off.
    stop_token_ids: tuple[int, ...] = ()
    min_tokens: int | None = None
    logit_bias: dict[int, float] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    min_p: float | None = None
    structured_output: StructuredOutput | None = None  # checked by the gateway (Grammars)


# The chat roles both front ends accept; "developer" is OpenAI's newer name for "system".
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


def template_message(role: str, content: str, reasoning: str | None = None
                     ) -> dict[str, str]:
    """A message as the chat template reads it (templates know "system", not "developer");
    an assistant turn's reasoning as ``reasoning_content`` (what templates that show it read)."""
    message = {"role": "system" if role == "developer" else role, "content": content}
    if reasoning:
        message["reasoning_content"] = reasoning
    return message


def new_request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def text_chars(value: Any) -> int:
    """The characters of every string in ``value`` (a prompt, or chat messages and their
    parts)."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, dict):
        return sum(text_chars(v) for v in value.values())
    if isinstance(value, list | tuple):
        return sum(text_chars(v) for v in value)
    return 0


def check_prompt_size(chars: int, max_model_len: int, max_token_chars: int, param: str) -> None:
    """400 before any tokenizing for a text too long to fit the context whatever its tokens
    (each stands for at most ``max_token_chars`` characters)."""
    limit = max_model_len * max_token_chars
    if chars > limit:
        raise bad_request(
            f"{param} has {chars} characters: more than the {max_model_len} tokens of this "
            f"model's context could hold (at most {max_token_chars} characters a token, "
            f"{limit} in all)", param=param, code="context_length_exceeded")


def tokenize_prompt(tokenizer: Tokenizer, prompt: str, add_special_tokens: bool = True
                    ) -> list[int]:
    if not prompt:
        raise bad_request("prompt is empty", param="prompt")
    return tokenizer.encode(prompt, add_special_tokens)


def tokenize_chat(tokenizer: Tokenizer, messages: Sequence[dict[str, Any]],
                  tools: Sequence[dict[str, Any]] | None = None,
                  template_kwargs: dict[str, Any] | None = None,
                  add_special_tokens: bool = False) -> list[int]:
    if not messages:
        raise bad_request("messages is empty: send at least one message", param="messages")
    clash = sorted(set(template_kwargs or ()) & set(TEMPLATE_VARIABLES))
    if clash:
        raise bad_request(f"chat_template_kwargs cannot set {clash[0]!r}: the server does",
                          param="chat_template_kwargs")
    try:
        return tokenizer.encode_chat(messages, tools, template_kwargs, add_special_tokens)
    except (ValueError, TemplateError) as exc:  # no template, or the template rejected them
        raise bad_request(f"cannot apply the chat template: {exc}", param="messages") from exc


def check_token_ids(token_ids: Sequence[int], vocab_size: int, param: str = "prompt"
                    ) -> list[int]:
    ids = list(token_ids)
    if not ids:
        raise bad_request("the prompt has no tokens", param=param)
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise bad_request(f"token id {bad} is outside the vocabulary [0, {vocab_size})",
                          param=param)
    return ids


def build_request(request_id: str, prompt_token_ids: list[int], options: SamplingOptions,
                  max_model_len: int, cache_salt: str | None = None,
                  default_max_tokens: int | None = None, arrival_time: float | None = None,
                  prompt_param: str = "prompt", max_timeout_s: float | None = None,
                  vocab_size: int | None = None, tenant: str = DEFAULT_TENANT
                  ) -> GenerationRequest:
    """Check the request against the context length (and the token ids it names against
    ``vocab_size``) and turn options into SamplingParams. Its deadline is the client's
    ``timeout_s`` or ``max_timeout_s`` (the server's limit), whichever is sooner."""
    num_prompt = len(prompt_token_ids)
    room = max_model_len - num_prompt
    if room < 1:
        raise bad_request(
            f"This model's maximum context length is {max_model_len} tokens, but the prompt has "
            f"{num_prompt} tokens (prompt + at least 1 generated token must fit).",
            param=prompt_param, code="context_length_exceeded")
    max_tokens = options.max_tokens
    if max_tokens is not None and max_tokens >= 1 and num_prompt + max_tokens > max_model_len:
        raise bad_request(
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {num_prompt + max_tokens} tokens ({num_prompt} in the prompt, "
            f"{max_tokens} for the completion). Reduce the prompt or max_tokens.",
            param="max_tokens", code="context_length_exceeded")
    if max_tokens is None:
        max_tokens = min(room, default_max_tokens) if default_max_tokens else room
    _check_stop(options.stop)
    _check_ranges(options)
    _check_token_controls(options, vocab_size)
    if options.seed is not None and not _INT64[0] <= options.seed <= _INT64[1]:
        raise bad_request(f"seed must fit in 64 bits, got {options.seed}", param="seed")
    top_k = options.top_k if options.top_k is not None else 0
    if top_k == -1:  # vLLM's spelling of "off"
        top_k = 0
    seed = options.seed
    if seed is None and options.temperature != 0:
        # Chosen here, once: prefill, decode and any worker a stream migrates to draw the
        # request's tokens from it (engine/sampler.py).
        seed = secrets.randbits(63)
    try:
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if options.temperature is None else options.temperature,
            top_k=top_k,
            top_p=1.0 if options.top_p is None else options.top_p,
            seed=seed,
            ignore_eos=options.ignore_eos,
            logprobs=options.logprobs,
            prompt_logprobs=options.prompt_logprobs,
            speculative=options.speculative,
            num_speculative_tokens=options.num_speculative_tokens,
            stop_token_ids=options.stop_token_ids,
            min_tokens=options.min_tokens or 0,
            logit_bias=tuple((options.logit_bias or {}).items()),
            presence_penalty=options.presence_penalty or 0.0,
            frequency_penalty=options.frequency_penalty or 0.0,
            repetition_penalty=(1.0 if options.repetition_penalty is None
                                else options.repetition_penalty),
            min_p=options.min_p or 0.0,
            structured_output=options.structured_output,
        )
    except ValueError as exc:  # SamplingParams names the field first in its messages
        field_name = str(exc).split(" ", 1)[0]
        raise bad_request(str(exc), param=field_name) from exc
    timeouts = [t for t in (options.timeout_s, max_timeout_s) if t is not None]
    deadline = time.time() + min(timeouts) if timeouts else None
    return GenerationRequest(request_id, prompt_token_ids, params, options.stop, cache_salt or None,
                             time.monotonic() if arrival_time is None else arrival_time,
                             deadline=deadline, tenant=tenant)


# The same bounds for every front end (HTTP's pydantic models state them too).
MAX_TEMPERATURE = 2.0


def _check_ranges(options: SamplingOptions) -> None:
    t, p = options.temperature, options.top_p
    if t is not None and not (math.isfinite(t) and 0.0 <= t <= MAX_TEMPERATURE):
        raise bad_request(f"temperature must be a number between 0 and {MAX_TEMPERATURE}, "
                          f"got {t}", param="temperature")
    if p is not None and not (math.isfinite(p) and 0.0 < p <= 1.0):
        raise bad_request(f"top_p must be a number in (0, 1], got {p}", param="top_p")
    if options.top_k is not None and options.top_k < -1:
        raise bad_request(f"top_k must be >= -1 (0 or -1: off), got {options.top_k}",
                          param="top_k")
    if options.timeout_s is not None and not (math.isfinite(options.timeout_s)
                                              and options.timeout_s > 0):
        raise bad_request(f"timeout must be a number of seconds > 0, got {options.timeout_s}",
                          param="timeout")
    if options.max_tokens is not None and options.max_tokens < 1:
        raise bad_request(f"max_tokens must be >= 1, got {options.max_tokens}",
                          param="max_tokens")


def _check_stop(stop: Sequence[str]) -> None:
    if len(stop) > MAX_STOP_STRINGS:
        raise bad_request(f"at most {MAX_STOP_STRINGS} stop strings are allowed, got {len(stop)}",
                          param="stop")
    for s in stop:
        if len(s) > MAX_STOP_STRING_CHARS:
            raise bad_request(f"a stop string is longer than {MAX_STOP_STRING_CHARS} characters",
                              param="stop")


def _check_token_controls(options: SamplingOptions, vocab_size: int | None) -> None:
    named = [("stop_token_ids", list(options.stop_token_ids), MAX_STOP_TOKEN_IDS),
             ("logit_bias", list(options.logit_bias or ()), MAX_LOGIT_BIAS_TOKENS)]
    for param, ids, most in named:
        if len(ids) > most:
            raise bad_request(f"{param} may name at most {most} tokens, got {len(ids)}",
                              param=param)
        bad = next((t for t in ids if t < 0 or (vocab_size is not None and t >= vocab_size)),
                   None)
        if bad is not None:
            raise bad_request(f"{param}: token id {bad} is outside the vocabulary "
                              f"[0, {vocab_size})", param=param)
