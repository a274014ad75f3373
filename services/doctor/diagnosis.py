"""The numbers the questions and levers are built from, computed once from the ``Evidence``.

Where the time of a mean request goes (seconds; docs/operations.md "Doctor"):

- ``queue_s``: waiting to be scheduled on the engine that computes the prompt, by Little's law
  (``wait_s``: the mean number of sequences waiting on prefill or colocated engines over the
  request rate), at most TTFT (a colocated engine's preempted sequences wait again later);
- ``prefill_s``: the rest of TTFT (TTFT is queue + prefill: the first token is streamed as soon
  as the prompt is computed);
- ``transfer_s``: the mean KV pull of a decode worker (after the first token, before the second);
- ``decode_s``: the rest of E2E (E2E − TTFT − transfer).
"""

from __future__ import annotations

from dataclasses import dataclass

from tandem.services.doctor.evidence import DECODING_ROLES, PREFILLING_ROLES, Evidence, GaugeStats

KV_FULL = 0.9  # KV usage from which an engine is out of memory for new or growing sequences


@dataclass(frozen=True)
class Diagnosis:
    window_s: float
    requests: float  # ended in the window
    request_rate: float  # per second
    # latency, seconds (means unless named)
    ttft_s: float
    ttft_p99_s: float | None
    e2e_s: float
    itl_s: float
    wait_s: float  # all waiting on prefill or colocated engines, re-waits after preemption too
    queue_s: float  # of it, before the first token (at most TTFT)
    prefill_s: float
    transfer_s: float
    decode_s: float
    decode_wait_s: float  # of decode_s: waiting on a decode engine (disaggregated)
    # per request
    prompt_tokens: float
    output_tokens: float
    # prefix cache, fractions of prompt tokens (hit_rate) or of routed prompt blocks
    hit_rate: float | None  # achieved, on prefill (or colocated) engines
    reachable: float | None  # cached on any prefill worker when routed (router's count)
    chosen: float | None  # cached on the chosen prefill worker when routed
    # batch and memory, on the engines that decode
    running: GaugeStats
    waiting: GaugeStats
    kv_usage: GaugeStats
    kv_blocks: float  # per decoding engine
    block_size: int
    max_num_seqs: int
    preemptions: float
    # speculative decoding
    spec_draft: float
    spec_accepted: float
    spec_steps: float
    kv_over_tcp: bool  # kv_transport tcp, or auto fallen back to TCP
    config: dict[str, str]

    @property
    def colocated(self) -> bool:
        return self.config.get("colocated") == "true"

    @property
    def preemptions_per_request(self) -> float:
        return self.preemptions / self.requests if self.requests else 0.0

    @property
    def memory_bound(self) -> bool:
        """The decoding engines ran out of KV: they preempted, or filled it with work waiting."""
        return self.preemptions > 0 or (self.kv_usage.peak >= KV_FULL and self.waiting.peak > 0)

    @property
    def batch_fill(self) -> float:
        """How full the decode batch ran, 0..1: the mean running sequences per engine over
        what the engine could hold (``max_num_seqs``; all of it once KV ran out)."""
        if self.memory_bound:
            return 1.0
        return min(1.0, self.running.mean / self.max_num_seqs) if self.max_num_seqs else 0.0

    @property
    def acceptance(self) -> float | None:
        return self.spec_accepted / self.spec_draft if self.spec_draft else None

    def share(self, seconds: float) -> float:
        """``seconds`` as a fraction of the mean request's E2E (at most all of it)."""
        return min(1.0, seconds / self.e2e_s) if self.e2e_s > 0 else 0.0

    @property
    def prefill_s_per_token(self) -> float:
        """Prefill time per prompt token computed (not found in the cache)."""
        computed = self.prompt_tokens * (1 - (self.hit_rate or 0.0))
        return self.prefill_s / computed if computed > 0 else 0.0


class NoTraffic(Exception):
    """No request ended in the window: nothing to diagnose."""


def diagnose(evidence: Evidence) -> Diagnosis:
    """Raises ``NoTraffic`` when no request ended in the window."""
    e = evidence
    requests = e.delta("tandem_request_success_total")
    if requests <= 0:
        raise NoTraffic(f"no request ended in the {e.window_s:.1f} s window: send traffic "
                        f"during it, or use --window 0 (since the gateway started)")
    window = e.window_s if e.window_s > 0 else None
    ttft = e.histogram("tandem_time_to_first_token_seconds")
    e2e = e.histogram("tandem_e2e_request_latency_seconds")
    itl = e.histogram("tandem_inter_token_latency_seconds")
    transfer = e.histogram("tandem_kv_transfer_seconds").mean or 0.0
    ttft_s, e2e_s = ttft.mean or 0.0, e2e.mean or 0.0
    # Little's law needs the arrival rate, which one read (--window 0) does not give: the
    # queue then counts as prefill.
    rate = requests / window if window else 0.0
    waiting_prefill = e.gauge("tandem_num_requests_waiting", PREFILLING_ROLES).sum_mean
    waiting_decode = e.gauge("tandem_num_requests_waiting", ("decode",)).sum_mean
    wait_s = waiting_prefill / rate if rate else 0.0
    queue_s = min(ttft_s, wait_s)
    decode_s = max(0.0, e2e_s - ttft_s - transfer)
    queries = e.delta("tandem_prefix_cache_queries_total", PREFILLING_ROLES)
    routed = e.delta("tandem_router_prompt_blocks_total")
    config = e.config
    blocks = e.last.per_worker("tandem_kv_cache_blocks", DECODING_ROLES)
    return Diagnosis(
        window_s=e.window_s, requests=requests, request_rate=rate,
        ttft_s=ttft_s, ttft_p99_s=ttft.quantile(0.99), e2e_s=e2e_s, itl_s=itl.mean or 0.0,
        wait_s=wait_s, queue_s=queue_s, prefill_s=max(0.0, ttft_s - queue_s),
        transfer_s=transfer,
        decode_s=decode_s,
        decode_wait_s=min(decode_s, waiting_decode / rate) if rate else 0.0,
        prompt_tokens=e.delta("tandem_prompt_tokens_total") / requests,
        output_tokens=e.delta("tandem_generation_tokens_total") / requests,
        hit_rate=(e.delta("tandem_prefix_cache_hits_total", PREFILLING_ROLES) / queries
                  if queries else None),
        reachable=(e.delta("tandem_router_cached_blocks_total", on="any") / routed
                   if routed else None),
        chosen=(e.delta("tandem_router_cached_blocks_total", on="chosen") / routed
                if routed else None),
        running=e.gauge("tandem_num_requests_running", DECODING_ROLES),
        waiting=e.gauge("tandem_num_requests_waiting", DECODING_ROLES),
        kv_usage=e.gauge("tandem_kv_cache_usage_perc", DECODING_ROLES),
        kv_blocks=sum(blocks.values()) / len(blocks) if blocks else 0.0,
        block_size=int(config.get("block_size") or 16),
        max_num_seqs=int(config.get("max_num_seqs") or 0),
        preemptions=e.delta("tandem_num_preemptions_total", DECODING_ROLES),
        spec_draft=e.delta("tandem_spec_decode_draft_tokens_total", DECODING_ROLES),
        spec_accepted=e.delta("tandem_spec_decode_accepted_tokens_total", DECODING_ROLES),
        spec_steps=e.delta("tandem_spec_decode_steps_total", DECODING_ROLES),
        kv_over_tcp=(config.get("kv_transport") == "tcp"
                     or e.last.total("tandem_kv_transport_fallback") > 0),
        config=config)
