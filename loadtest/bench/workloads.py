"""Benchmark workloads: the requests to send, deterministic per seed, with exact prompt lengths.

- random: independent prompts, input/output lengths fixed or uniform in a range.
- prefix: N tenants, each with a long system prompt shared by its requests; tenants drawn with
  Zipf popularity (tenant k has weight 1/(k+1)^s).
- chat: multi-turn conversations; turn t sends the whole history (earlier user turns plus
  synthetic assistant replies of the requested output length) and waits for turn t-1.
- mix: short interactive prompts with a fixed fraction of long ones among them.

``input_len`` is the prompt length the server sees (template and BOS included), except in chat
where it is the length of each user message. ``prompt_tokens`` on each request is exact.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from tandem.loadtest.bench.prompts import ChatMessage, PromptMaker, fit

WORKLOADS = ("random", "prefix", "chat", "mix")
Endpoint = Literal["completions", "chat"]


@dataclass(frozen=True)
class LengthRange:
    """A token length: fixed (low == high) or uniform over [low, high]."""

    low: int
    high: int

    def __post_init__(self) -> None:
        if not 1 <= self.low <= self.high:
            raise ValueError(f"a length range needs 1 <= low <= high, got {self}")

    @classmethod
    def parse(cls, text: str) -> LengthRange:
        """``"256"`` or ``"128:512"``."""
        low, _, high = text.partition(":")
        try:
            return cls(int(low), int(high or low))
        except ValueError as exc:
            raise ValueError(f"invalid length {text!r}: use N or LOW:HIGH, "
                             f"positive integers ({exc})") from None

    def draw(self, rng: np.random.Generator) -> int:
        return int(rng.integers(self.low, self.high + 1))

    @property
    def mean(self) -> int:
        return (self.low + self.high) // 2

    def __str__(self) -> str:
        return str(self.low) if self.low == self.high else f"{self.low}:{self.high}"


@dataclass(frozen=True)
class BenchRequest:
    index: int
    kind: str  # what the report groups by: random, prefix, chat, short, long
    prompt_tokens: int  # exact, as the target's tokenizer counts it
    max_tokens: int
    prompt: str | None = None  # completions
    messages: tuple[ChatMessage, ...] | None = None  # chat
    group: str = ""  # tenant or conversation
    after: int | None = None  # index of the request that must finish first (the previous turn)


@dataclass(frozen=True)
class WorkloadSpec:
    name: str = "random"
    endpoint: Endpoint = "completions"
    num_requests: int = 100
    input_len: LengthRange = LengthRange(256, 256)
    output_len: LengthRange = LengthRange(64, 64)
    prefix_len: int = 512
    num_tenants: int = 8
    zipf_s: float = 1.0
    num_turns: int = 4
    long_fraction: float = 0.1
    long_input_len: LengthRange = LengthRange(2048, 2048)
    long_output_len: LengthRange | None = None  # None: output_len

    def check(self) -> None:
        problems = []
        if self.name not in WORKLOADS:
            problems.append(f"unknown workload {self.name!r}; choose one of {', '.join(WORKLOADS)}")
        if self.num_requests < 1:
            problems.append("--num-requests must be >= 1")
        if self.name == "chat" and self.endpoint != "chat":
            problems.append("the chat workload sends message histories: use --endpoint chat")
        if self.name == "prefix" and (self.prefix_len < 1 or self.num_tenants < 1):
            problems.append("--prefix-len and --num-tenants must be >= 1")
        if self.zipf_s < 0:
            problems.append("--zipf-s must be >= 0")
        if self.num_turns < 1:
            problems.append("--num-turns must be >= 1")
        if not 0.0 <= self.long_fraction <= 1.0:
            problems.append("--long-fraction must be within [0, 1]")
        if problems:
            raise ValueError("; ".join(problems))


@dataclass
class Workload:
    spec: WorkloadSpec
    seed: int
    requests: list[BenchRequest] = field(default_factory=list)


def build_workload(spec: WorkloadSpec, maker: PromptMaker, seed: int) -> Workload:
    spec.check()
    rng = np.random.default_rng(seed)
    builders: dict[str, Callable[[WorkloadSpec, PromptMaker, np.random.Generator],
                                 list[BenchRequest]]] = {
        "random": _random, "prefix": _prefix, "chat": _chat, "mix": _mix,
    }
    return Workload(spec, seed, builders[spec.name](spec, maker, rng))


def _single(maker: PromptMaker, rng: np.random.Generator, endpoint: Endpoint, index: int,
            kind: str, input_len: int, max_tokens: int, prefix: str = "", system: str | None = None,
            group: str = "") -> BenchRequest:
    """One request whose whole prompt is ``input_len`` tokens (a shared prefix included)."""
    words = maker.draw(rng, input_len)
    what = f"request {index} ({kind})"
    if endpoint == "completions":
        text = fit(lambda n: prefix + "".join(words[:n]), maker.count_text, input_len, what)
        return BenchRequest(index, kind, input_len, max_tokens, prompt=text, group=group)
    head = (ChatMessage("system", system),) if system is not None else ()
    messages = fit(lambda n: (*head, ChatMessage("user", "".join(words[:n]))),
                   maker.count_chat, input_len, what)
    return BenchRequest(index, kind, input_len, max_tokens, messages=messages, group=group)


def _random(spec: WorkloadSpec, maker: PromptMaker, rng: np.random.Generator
            ) -> list[BenchRequest]:
    return [_single(maker, rng, spec.endpoint, i, "random", spec.input_len.draw(rng),
                    spec.output_len.draw(rng)) for i in range(spec.num_requests)]


def zipf_weights(n: int, s: float) -> np.ndarray:
    weights = 1.0 / np.arange(1, n + 1, dtype=np.float64) ** s
    return weights / weights.sum()


def _prefix(spec: WorkloadSpec, maker: PromptMaker, rng: np.random.Generator
            ) -> list[BenchRequest]:
    system_prompts = ["".join(maker.draw(rng, spec.prefix_len)) for _ in range(spec.num_tenants)]
    tenants = rng.choice(spec.num_tenants, size=spec.num_requests,
                         p=zipf_weights(spec.num_tenants, spec.zipf_s))
    requests = []
    for i, tenant in enumerate(tenants):
        shared = system_prompts[int(tenant)]
        total = spec.prefix_len + spec.input_len.draw(rng)
        max_tokens = spec.output_len.draw(rng)
        if spec.endpoint == "completions":
            req = _single(maker, rng, "completions", i, "prefix", total, max_tokens,
                          prefix=shared, group=f"tenant-{tenant}")
        else:
            req = _single(maker, rng, "chat", i, "prefix", total, max_tokens, system=shared,
                          group=f"tenant-{tenant}")
        requests.append(req)
    return requests


def _chat(spec: WorkloadSpec, maker: PromptMaker, rng: np.random.Generator
          ) -> list[BenchRequest]:
    turns = spec.num_turns
    conversations = math.ceil(spec.num_requests / turns)
    history: list[list[ChatMessage]] = [[] for _ in range(conversations)]
    requests: list[BenchRequest] = []
    index_of: dict[tuple[int, int], int] = {}
    # Turn-major order: every conversation's turn t is queued before any turn t+1.
    for turn in range(turns):
        for conv in range(conversations):
            index = len(requests)
            if index == spec.num_requests:
                break
            user = ChatMessage("user", "".join(maker.draw(rng, spec.input_len.draw(rng))))
            reply_len = spec.output_len.draw(rng)
            messages = (*history[conv], user)
            requests.append(BenchRequest(
                index, "chat", maker.count_chat(messages), reply_len, messages=messages,
                group=f"conversation-{conv}", after=index_of.get((conv, turn - 1))))
            index_of[(conv, turn)] = index
            # The reply stands in for the server's answer, so prompts are known in advance.
            reply = ChatMessage("assistant", "".join(maker.draw(rng, reply_len)))
            history[conv] = [*messages, reply]
    return requests


def _mix(spec: WorkloadSpec, maker: PromptMaker, rng: np.random.Generator
         ) -> list[BenchRequest]:
    n_long = round(spec.long_fraction * spec.num_requests)
    long_ids = set(rng.choice(spec.num_requests, size=n_long, replace=False).tolist())
    long_out = spec.long_output_len or spec.output_len
    requests = []
    for i in range(spec.num_requests):
        if i in long_ids:
            req = _single(maker, rng, spec.endpoint, i, "long", spec.long_input_len.draw(rng),
                          long_out.draw(rng))
        else:
            req = _single(maker, rng, spec.endpoint, i, "short", spec.input_len.draw(rng),
                          spec.output_len.draw(rng))
        requests.append(req)
    return requests
