"""``GenerationRequest``: one request, as every layer after parsing sees it, and its
``SamplingParams`` (validated on construction).

The gateway builds it once from a validated client request (services/gateway/core.py) and
hands it to its backend; the disaggregated backend sends it as it is to the prefill replica
and then, with P's ``PrefillResult`` set, to the decode replica. Everything a request carries
through P and D lives here, so a new field is one edit here and one where it is used. No
torch, no Ray.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

from tandem.services.protocol.handoff import PrefillResult

# Below this a temperature is greedy (as vLLM's _SAMPLING_EPS): logits / 1e-40 overflow to inf.
GREEDY_TEMPERATURE = 1e-5
# OpenAI's bounds (vLLM's for repetition_penalty, which OpenAI lacks, is only > 0).
MAX_LOGIT_BIAS = 100.0
MAX_PENALTY = 2.0
MAX_REPETITION_PENALTY = 10.0
STRUCTURED_KINDS = ("json", "regex", "choice", "grammar")
MAX_SPEC_CHARS = 64 * 1024


@dataclass(frozen=True)
class StructuredOutput:
    """``kind`` json: ``spec`` is a JSON schema (as JSON text); regex: a regular expression;
    choice: a JSON list of strings, the output is one of them; grammar: a Lark grammar
    (llguidance's dialect, with a ``start`` rule) or a GBNF one (``root ::= ...``)."""

    kind: str
    spec: str

    def __post_init__(self) -> None:
        if self.kind not in STRUCTURED_KINDS:
            raise ValueError(f"structured_output kind must be one of {STRUCTURED_KINDS}, "
                             f"got {self.kind!r}")
        if not isinstance(self.spec, str) or len(self.spec) > MAX_SPEC_CHARS:
            raise ValueError(f"structured_output spec must be a string of at most "
                             f"{MAX_SPEC_CHARS} characters")


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # None: none; 0: the sampled token's; n: plus the top n
    # The prompt's logprobs (each prompt token after the first, given those before it), in the
    # request's first output: None: none; 0: the prompt token's; n: plus the top n. Such a
    # request computes its whole prompt (no prefix-cache hits: a cached block has no logits).
    prompt_logprobs: int | None = None
    speculative: bool = True  # use the engine's speculative decoding, if it has one
    num_speculative_tokens: int | None = None  # cap on draft tokens per step; None: engine's
    # Logits controls (engine/logits_controls.py), applied before greedy and sampled draws:
    min_tokens: int = 0  # EOS and stop_token_ids cannot end the output before this many tokens
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit), id order
    presence_penalty: float = 0.0  # minus this from each token already in the output
    frequency_penalty: float = 0.0  # minus this times its count in the output
    repetition_penalty: float = 1.0  # tokens of prompt or output: logit / it if > 0, else * it
    min_p: float = 0.0  # sampled draws: drop tokens below min_p x the most likely's probability
    # Only tokens that keep the output within this constraint (engine/grammar.py).
    structured_output: StructuredOutput | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if self.temperature < GREEDY_TEMPERATURE:
            object.__setattr__(self, "temperature", 0.0)
        if not 0.0 < self.top_p <= 1.0:  # NaN fails this too
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or not 0 <= value <= 20):
                raise ValueError(f"{name} must be between 0 and 20, got {value!r}")
        if self.num_speculative_tokens is not None and not 1 <= self.num_speculative_tokens <= 16:
            raise ValueError(f"num_speculative_tokens must be between 1 and 16, got "
                             f"{self.num_speculative_tokens}")
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be token ids >= 0, got {self.stop_token_ids}")
        if not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be an integer between 0 and max_tokens "
                             f"({self.max_tokens}), got {self.min_tokens!r}")
        bias = tuple(sorted((int(t), float(b)) for t, b in self.logit_bias))
        if any(t < 0 or not -MAX_LOGIT_BIAS <= b <= MAX_LOGIT_BIAS for t, b in bias):
            raise ValueError(f"logit_bias must map token ids >= 0 to numbers between "
                             f"-{MAX_LOGIT_BIAS:g} and {MAX_LOGIT_BIAS:g}")
        if len({t for t, _ in bias}) != len(bias):
            raise ValueError("logit_bias names a token twice")
        object.__setattr__(self, "logit_bias", bias)
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -MAX_PENALTY <= value <= MAX_PENALTY:  # NaN fails this too
                raise ValueError(f"{name} must be between -{MAX_PENALTY:g} and "
                                 f"{MAX_PENALTY:g}, got {value}")
        if not 0.0 < self.repetition_penalty <= MAX_REPETITION_PENALTY:
            raise ValueError(f"repetition_penalty must be in (0, {MAX_REPETITION_PENALTY:g}], "
                             f"got {self.repetition_penalty}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if isinstance(self.structured_output, dict):  # from the control channel's JSON
            object.__setattr__(self, "structured_output",
                               StructuredOutput(**self.structured_output))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def adjusts_logits(self) -> bool:
        """Whether the logits are changed before the draw (``logits_controls``)."""
        return bool(self.structured_output or self.min_tokens or self.logit_bias
                    or self.presence_penalty or self.frequency_penalty
                    or self.repetition_penalty != 1.0)


DEFAULT_TENANT = "default"  # requests without API keys, and a bare key's (gateway/tenants.py)
UNKNOWN_TENANT = "unknown"  # a refused request's metrics label when its key was missing or wrong


@dataclass(frozen=True)
class GenerationRequest:
    request_id: str  # the server's id (a client's id is never used as a key)
    prompt_token_ids: list[int]
    params: SamplingParams
    stop: tuple[str, ...] = ()  # stop strings, applied by the gateway
    cache_salt: str | None = None
    arrival_time: float = field(default_factory=time.monotonic)  # the gateway's clock
    trace: dict[str, str] | None = None  # W3C trace context of the gateway's request span
    prefill: PrefillResult | None = None  # P's result, forwarded to D as it came; None: no P
    deadline: float | None = None  # time.time() by which it must end (clocks of every process)
    # Tokens it already generated (a stream migrated after its decode worker failed): the next
    # worker recomputes them with the prompt (or finds them cached) and goes on from there.
    output_token_ids: tuple[int, ...] = ()
    tenant: str = DEFAULT_TENANT  # whose API key sent it; its cache_salt is derived from it
    # The client's session name (prompt_cache_key / session_id): the router keeps a tenant's
    # session on one decode worker while it can (router/sessions.py); None: no session.
    session: str | None = None

    def remaining_s(self) -> float | None:
        """Seconds until the deadline (negative once past); None: no deadline."""
        return None if self.deadline is None else self.deadline - time.time()

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)
