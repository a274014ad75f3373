"""``GenerationRequest``: one request, as every layer after parsing sees it.

The gateway builds it once from a validated client request (services/gateway/inputs.py) and
hands it to its backend; the disaggregated backend sends it as it is to the prefill replica
and then, with P's ``PrefillResult`` set, to the decode replica. Everything a request carries
through P and D lives here, so a new field is one edit here and one where it is used. No
torch, no Ray.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from tandem.services.protocol.handoff import PrefillResult
from tandem.services.protocol.sampling_params import SamplingParams

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

    def remaining_s(self) -> float | None:
        """Seconds until the deadline (negative once past); None: no deadline."""
        return None if self.deadline is None else self.deadline - time.time()

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)
