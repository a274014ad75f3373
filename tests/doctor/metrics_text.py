"""Prometheus texts of a gateway's /metrics, written series by series for the doctor's tests,
and the three states it must tell apart, with round numbers to check by hand."""

from __future__ import annotations

from dataclasses import dataclass, field

from tandem.services.doctor.evidence import Evidence, Scrape
from tandem.services.gateway.metrics import E2E_BUCKETS, TTFT_BUCKETS

TRANSFER_BUCKETS = (0.001, 0.01, 0.1, 1.0)


@dataclass
class Metrics:
    """One read of /metrics: the config, the workers' roles, then any series."""

    config: dict[str, str]
    roles: dict[str, str]  # worker -> role
    lines: list[str] = field(default_factory=list)

    def add(self, name: str, value: float, **labels: str) -> Metrics:
        text = ",".join(f'{k}="{v}"' for k, v in {"model_name": "m", **labels}.items())
        self.lines.append(f"{name}{{{text}}} {value}")
        return self

    def histogram(self, name: str, count: int, mean: float, bounds: tuple[float, ...],
                  **labels: str) -> Metrics:
        """``count`` observations, all of them ``mean``."""
        for bound in (*bounds, float("inf")):
            le = "+Inf" if bound == float("inf") else str(bound)
            self.add(f"{name}_bucket", count if mean <= bound else 0, le=le, **labels)
        self.add(f"{name}_count", count, **labels)
        return self.add(f"{name}_sum", count * mean, **labels)

    def text(self) -> str:
        head = ['tandem_config_info{model_name="m",'
                + ",".join(f'{k}="{v}"' for k, v in self.config.items()) + "} 1"]
        head += [f'tandem_worker_info{{model_name="m",worker="{w}",role="{r}"}} 1'
                 for w, r in self.roles.items()]
        return "\n".join([*head, *self.lines]) + "\n"

    def scrape(self) -> Scrape:
        return Scrape.parse(self.text())


DISAGG = {"colocated": "false", "prefill_replicas": "2", "decode_replicas": "1",
          "routing_policy": "round_robin", "spec": "none", "spec_k": "4", "max_num_seqs": "32",
          "max_num_batched_tokens": "512", "block_size": "16", "num_kv_blocks": "",
          "kv_cache_memory_gb": "0.25", "kv_transport": "tcp"}


def requests(m: Metrics, count: int, ttft: float, e2e: float, prompt: int, output: int
             ) -> Metrics:
    m.add("tandem_request_success_total", count, finished_reason="length")
    m.histogram("tandem_time_to_first_token_seconds", count, ttft, TTFT_BUCKETS)
    m.histogram("tandem_e2e_request_latency_seconds", count, e2e, E2E_BUCKETS)
    m.add("tandem_prompt_tokens_total", count * prompt)
    return m.add("tandem_generation_tokens_total", count * output)


def engine(m: Metrics, worker: str, running: float = 0, waiting: float = 0, kv: float = 0.0,
           blocks: int = 1000, queries: float = 0, hits: float = 0, preemptions: float = 0
           ) -> Metrics:
    m.add("tandem_num_requests_running", running, worker=worker)
    m.add("tandem_num_requests_waiting", waiting, worker=worker)
    m.add("tandem_kv_cache_usage_perc", kv, worker=worker)
    m.add("tandem_kv_cache_blocks", blocks, worker=worker, role=m.roles[worker])
    m.add("tandem_prefix_cache_queries_total", queries, worker=worker)
    m.add("tandem_prefix_cache_hits_total", hits, worker=worker)
    return m.add("tandem_num_preemptions_total", preemptions, worker=worker)


def evidence(last: Metrics, gauges: Metrics, window_s: float = 10.0) -> Evidence:
    """From a read with every counter at zero to ``last``; the gauges (running, waiting, KV
    usage) read ``gauges`` in between and ``last``."""
    first = Metrics(last.config, last.roles)
    for worker in last.roles:
        engine(first, worker)
    return Evidence(first.scrape(), last.scrape(), window_s, (gauges.scrape(), last.scrape()))


def prefix_state() -> Evidence:
    """Round-robin prefill over 2 workers; half the prompt blocks were cached on the other
    worker. 20 requests in 10 s: TTFT 500 ms, E2E 600 ms, KV pull 20 ms; 0.2 prompts waiting
    on average (Little: 100 ms of queueing)."""
    roles = {"p0": "prefill", "p1": "prefill", "d0": "decode"}

    def read(waiting: float, running: float) -> Metrics:
        m = Metrics(dict(DISAGG), roles)
        engine(m, "p0", waiting=waiting / 2, queries=1940)
        engine(m, "p1", waiting=waiting / 2, queries=1940)
        return engine(m, "d0", running=running, kv=0.1)

    last = requests(read(0.2, 1), 20, ttft=0.5, e2e=0.6, prompt=194, output=2)
    last.histogram("tandem_kv_transfer_seconds", 20, 0.02, TRANSFER_BUCKETS, worker="d0",
                   role="decode")
    last.add("tandem_router_prompt_blocks_total", 240)
    last.add("tandem_router_cached_blocks_total", 120, on="any")
    last.add("tandem_router_cached_blocks_total", 0, on="chosen")
    return evidence(last, read(0.2, 1))


def kv_state() -> Evidence:
    """One colocated engine with 24 KV blocks: 10 requests in 10 s, 5 preemptions; 0.5
    sequences waiting on average (500 ms of queueing); TTFT 1 s, E2E 5 s; prompts of 100
    tokens, outputs of 64."""
    config = {**DISAGG, "colocated": "true", "num_kv_blocks": "24", "routing_policy": "prefix",
              "prefill_replicas": "1"}
    roles = {"colocated": "colocated"}

    def read() -> Metrics:
        return engine(Metrics(config, roles), "colocated", running=3, waiting=0.5, kv=0.95,
                      blocks=24, queries=1000, preemptions=5)

    last = requests(read(), 10, ttft=1.0, e2e=5.0, prompt=100, output=64)
    return evidence(last, read())


def decode_state() -> Evidence:
    """Speculation off, long outputs: 5 requests in 10 s, TTFT 200 ms, E2E 4 s, KV pull
    10 ms, 2 sequences running of max_num_seqs 32, no queue, nothing shared."""
    config = {**DISAGG, "prefill_replicas": "1"}
    roles = {"p0": "prefill", "d0": "decode"}

    def read() -> Metrics:
        m = engine(Metrics(config, roles), "p0", queries=100)
        return engine(m, "d0", running=2, kv=0.05)

    last = requests(read(), 5, ttft=0.2, e2e=4.0, prompt=20, output=200)
    last.histogram("tandem_kv_transfer_seconds", 5, 0.01, TRANSFER_BUCKETS, worker="d0",
                   role="decode")
    last.add("tandem_router_prompt_blocks_total", 5)
    last.add("tandem_router_cached_blocks_total", 0, on="any")
    last.add("tandem_router_cached_blocks_total", 0, on="chosen")
    return evidence(last, read())


def full_decode_state() -> Evidence:
    """The decode batch at 30 of max_num_seqs 32 with KV to spare and 2 sequences waiting for
    a slot: 10 requests in 10 s, TTFT 300 ms, E2E 6 s, KV pull 10 ms; prefix routing on."""
    config = {**DISAGG, "prefill_replicas": "1", "routing_policy": "prefix"}
    roles = {"p0": "prefill", "d0": "decode"}

    def read() -> Metrics:
        m = engine(Metrics(config, roles), "p0", queries=1000)
        return engine(m, "d0", running=30, waiting=2, kv=0.5)

    last = requests(read(), 10, ttft=0.3, e2e=6.0, prompt=100, output=100)
    last.histogram("tandem_kv_transfer_seconds", 10, 0.01, TRANSFER_BUCKETS, worker="d0",
                   role="decode")
    return evidence(last, read())
