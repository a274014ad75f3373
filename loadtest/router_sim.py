"""Router benchmark: a simulated prefill fleet replaying a multi-tenant trace. No model.

    python -m tandem.loadtest.router_sim            # N = 4 and 16, prints Markdown tables
    python -m tandem.loadtest.router_sim --quick    # smaller trace, for a smoke run

Trace: tenants with 1,000-4,000-token system prompts, Zipf popularity, short unique suffixes,
Poisson arrivals. Workers: one FIFO prefill server each, an LRU block cache of fixed size, and
service time = overhead + uncached tokens / rate. Policies:

- prefix-aware: the real ``router.Router`` (in-process bus and registry on the simulated clock),
  fed by KV events the simulated workers emit (delivered after ``event_lag``) and heartbeats;
- round-robin; rendezvous hash of the first blocks (the router's fallback);
- oracle: exact knowledge of every cache and queue, including blocks that queued requests will
  compute, choosing the least ``queued + uncached`` work (the same cost, perfect information).

Hit rate = prompt tokens served from cache / prompt tokens. Imbalance = max / mean over workers
of the time-averaged queued (uncached) tokens. The first ``warmup`` fraction of requests is left
out of both. A separate micro-benchmark times ``Router.route`` on 8k-token prompts.
"""

from __future__ import annotations

import argparse
import gc
import heapq
import itertools
import math
import random
import statistics
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from tandem.router import (
    InProcessEventBus,
    InProcessRegistry,
    Router,
    RouterConfig,
    WorkerEventForwarder,
    WorkerInfo,
    WorkerLoad,
    attach_worker,
)
from tandem.router.router import rendezvous_choose, rendezvous_key, rendezvous_weight
from tandem.services.protocol.block_hash import BlockHash, HashSettings, PromptHasher
from tandem.services.protocol.kv_events import BlockRemoved, BlockStored, KVEvent

SETTINGS = HashSettings(block_size=16, model_id="sim-model")
POLICIES = ("prefix-aware", "round-robin", "rendezvous", "oracle")


@dataclass(frozen=True)
class SimParams:
    tenants: int = 50
    system_tokens: tuple[int, int] = (1000, 4000)
    suffix_tokens: tuple[int, int] = (32, 256)
    zipf_s: float = 1.0
    requests: int = 20_000
    cache_blocks: int = 4096  # per worker
    rate_tokens_s: float = 20_000.0  # prefill throughput of one worker
    overhead_s: float = 0.004  # per request
    # Offered load as a fraction of fleet capacity if every worker cached every prefix.
    load: float = 0.5
    event_lag_s: float = 0.010
    heartbeat_s: float = 0.050
    warmup: float = 0.1
    seed: int = 0
    # Router weights; the oracle uses the same cost with perfect information.
    miss_weight: float = 1.0
    load_weight: float = 1.0


@dataclass(frozen=True)
class Request:
    index: int
    arrival: float
    tenant: int
    num_tokens: int
    hashes: tuple[BlockHash, ...]


# -- trace -------------------------------------------------------------------------------------


def zipf_weights(n: int, s: float) -> list[float]:
    return [1.0 / (rank**s) for rank in range(1, n + 1)]


def make_trace(p: SimParams, num_workers: int) -> list[Request]:
    rng = random.Random(p.seed)
    hasher = PromptHasher(SETTINGS)
    systems = [
        [rng.randrange(32_000) for _ in range(rng.randint(*p.system_tokens))]
        for _ in range(p.tenants)
    ]
    weights = zipf_weights(p.tenants, p.zipf_s)
    tenants = rng.choices(range(p.tenants), weights=weights, k=p.requests)
    suffixes = [rng.randint(*p.suffix_tokens) for _ in range(p.requests)]
    # Ideal work per request: only the unaligned tail of the system prompt and the suffix miss.
    bs = SETTINGS.block_size
    ideal = [
        p.overhead_s + (len(systems[t]) % bs + s) / p.rate_tokens_s
        for t, s in zip(tenants, suffixes, strict=True)
    ]
    arrival_rate = p.load * num_workers / statistics.fmean(ideal)
    now, trace = 0.0, []
    for i, (tenant, suffix) in enumerate(zip(tenants, suffixes, strict=True)):
        now += rng.expovariate(arrival_rate)
        tokens = systems[tenant] + [rng.randrange(32_000) for _ in range(suffix)]
        trace.append(Request(i, now, tenant, len(tokens), tuple(hasher.hashes(tokens))))
    return trace


def ideal_hit_rate(trace: Sequence[Request], warmup: int) -> float:
    """Hit rate with one infinite cache: every block seen before is a hit."""
    seen: set[BlockHash] = set()
    hit = total = 0
    for req in trace:
        cached = 0
        for h in req.hashes:
            if h not in seen:
                break
            cached += 1
        seen.update(req.hashes)
        if req.index >= warmup:
            hit += cached * SETTINGS.block_size
            total += req.num_tokens
    return hit / total


# -- simulated prefill worker ------------------------------------------------------------------


@dataclass
class Job:
    req: Request
    work_tokens: int  # estimate while queued, actual once started
    started: float = -1.0
    cached_blocks: int = 0


@dataclass
class SimWorker:
    worker_id: str
    capacity: int
    p: SimParams
    emit: Callable[[float, list[KVEvent]], None] | None
    cache: OrderedDict[BlockHash, None] = field(default_factory=OrderedDict)
    queue: deque[Job] = field(default_factory=deque)  # queue[0] is in service
    pending: Counter[BlockHash] = field(default_factory=Counter)  # blocks queued jobs compute
    queued_tokens: int = 0
    area: float = 0.0  # integral of queued_tokens over time
    last_t: float = 0.0

    def _account(self, t: float) -> None:
        self.area += self.queued_tokens * (t - self.last_t)
        self.last_t = t

    def cached_prefix(self, hashes: Sequence[BlockHash]) -> int:
        n = 0
        for h in hashes:
            if h not in self.cache:
                break
            n += 1
        return n

    def oracle_prefix(self, hashes: Sequence[BlockHash]) -> int:
        """Leading blocks cached now or computed by a job queued ahead."""
        n = 0
        for h in hashes:
            if h not in self.cache and not self.pending[h]:
                break
            n += 1
        return n

    def enqueue(self, t: float, req: Request) -> float | None:
        """Queue a request; returns its completion time if it starts right away."""
        self._account(t)
        estimate = req.num_tokens - self.oracle_prefix(req.hashes) * SETTINGS.block_size
        job = Job(req, max(estimate, 0))
        self.queue.append(job)
        self.queued_tokens += job.work_tokens
        self.pending.update(req.hashes)
        return self._start(t) if len(self.queue) == 1 else None

    def _start(self, t: float) -> float:
        job = self.queue[0]
        hashes = job.req.hashes
        job.cached_blocks = self.cached_prefix(hashes)
        for h in hashes[: job.cached_blocks]:
            self.cache.move_to_end(h)
        actual = job.req.num_tokens - job.cached_blocks * SETTINGS.block_size
        self.queued_tokens += actual - job.work_tokens
        job.work_tokens, job.started = actual, t
        return t + self.p.overhead_s + actual / self.p.rate_tokens_s

    def complete(self, t: float) -> tuple[Job, float | None]:
        """Finish the job in service; returns it and the next job's completion time, if any."""
        self._account(t)
        job = self.queue.popleft()
        self.queued_tokens -= job.work_tokens
        self.pending.subtract(job.req.hashes)
        stored, removed = [], []
        # Freed in reverse so that a prompt's tail is evicted before its head (as vLLM does).
        for h in reversed(job.req.hashes):
            if h in self.cache:
                self.cache.move_to_end(h)
            else:
                self.cache[h] = None
                stored.append(h)
        while len(self.cache) > self.capacity:
            removed.append(self.cache.popitem(last=False)[0])
        if self.emit is not None:
            events: list[KVEvent] = []
            if stored:
                events.append(BlockStored(tuple(reversed(stored)), None, SETTINGS.block_size))
            if removed:
                events.append(BlockRemoved(tuple(removed)))
            if events:
                self.emit(t + self.p.event_lag_s, events)
        nxt = self._start(t) if self.queue else None
        return job, nxt

    def load(self) -> WorkerLoad:
        return WorkerLoad(
            pending_prefill_blocks=math.ceil(self.queued_tokens / SETTINGS.block_size),
            kv_usage=len(self.cache) / self.capacity,
            running_sequences=len(self.queue),
        )


# -- policies ----------------------------------------------------------------------------------


class Policy:
    def choose(self, req: Request) -> str:
        raise NotImplementedError

    def done(self, req: Request) -> None:
        pass


class RoundRobin(Policy):
    def __init__(self, ids: list[str]) -> None:
        self._cycle = itertools.cycle(ids)

    def choose(self, req: Request) -> str:
        return next(self._cycle)


class Rendezvous(Policy):
    def __init__(self, ids: list[str]) -> None:
        self.ids = ids

    def choose(self, req: Request) -> str:
        return rendezvous_choose(rendezvous_key(req.hashes, 4), self.ids)


class Oracle(Policy):
    def __init__(self, workers: dict[str, SimWorker], p: SimParams) -> None:
        self.workers = workers
        self.p = p

    def choose(self, req: Request) -> str:
        key = rendezvous_key(req.hashes, 4)
        bs = SETTINGS.block_size

        def cost(w: SimWorker) -> tuple[float, float]:
            uncached = req.num_tokens - w.oracle_prefix(req.hashes) * bs
            work = self.p.load_weight * w.queued_tokens + self.p.miss_weight * uncached
            return (work, -rendezvous_weight(key, w.worker_id))

        return min(self.workers.values(), key=cost).worker_id


class PrefixAware(Policy):
    """The real router, on the simulation's clock."""

    def __init__(self, router: Router) -> None:
        self.router = router
        self._ids: dict[int, str] = {}

    def choose(self, req: Request) -> str:
        self.router.sync()
        decision = self.router.route_hashes(req.hashes, req.num_tokens,
                                            request_id=str(req.index))
        assert decision.prefill_worker is not None
        return decision.prefill_worker

    def done(self, req: Request) -> None:
        self.router.release(str(req.index))


# -- the event loop ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Result:
    policy: str
    workers: int
    hit_rate: float
    imbalance: float
    mean_queued_tokens: float
    latency_p50_ms: float
    latency_p99_ms: float
    decisions_s: float  # wall time spent choosing, per decision


def simulate(policy_name: str, trace: Sequence[Request], n: int, p: SimParams) -> Result:
    clock = [0.0]
    heap: list[tuple[float, int, str, object]] = []
    seq = itertools.count()

    def schedule(t: float, kind: str, payload: object) -> None:
        heapq.heappush(heap, (t, next(seq), kind, payload))

    ids = [f"p{i:02d}" for i in range(n)]
    forwarders: dict[str, WorkerEventForwarder] = {}
    emit_for: dict[str, Callable[[float, list[KVEvent]], None] | None] = dict.fromkeys(ids)
    router: Router | None = None
    registry: InProcessRegistry | None = None
    if policy_name == "prefix-aware":
        registry = InProcessRegistry(SETTINGS, ttl_s=1e9, clock=lambda: clock[0])
        bus = InProcessEventBus()
        config = RouterConfig(SETTINGS, miss_weight=p.miss_weight, load_weight=p.load_weight)
        router = Router(config, registry, bus, replica_id="sim", clock=lambda: clock[0])
        for w in ids:
            forwarders[w] = attach_worker(bus, w)
            emit_for[w] = lambda t, events, w=w: schedule(t, "deliver", (w, events))
    workers = {w: SimWorker(w, p.cache_blocks, p, emit_for[w]) for w in ids}
    infos = {
        w: WorkerInfo(w, "prefill", f"{w}:0", SETTINGS.block_size, SETTINGS.model_id,
                      p.cache_blocks)
        for w in ids
    }
    if registry is not None:
        for w in ids:
            registry.register(infos[w], WorkerLoad())
        schedule(p.heartbeat_s, "heartbeat", None)

    policy: Policy
    if router is not None:
        policy = PrefixAware(router)
    elif policy_name == "round-robin":
        policy = RoundRobin(ids)
    elif policy_name == "rendezvous":
        policy = Rendezvous(ids)
    else:
        policy = Oracle(workers, p)

    warmup = int(len(trace) * p.warmup)
    warm_start = trace[warmup].arrival
    hit_tokens = total_tokens = 0
    latencies: list[float] = []
    choose_time = 0.0
    area_at_warm: dict[str, float] = {}

    def advance(until: float) -> None:
        nonlocal hit_tokens, total_tokens
        while heap and heap[0][0] <= until:
            t, _, kind, payload = heapq.heappop(heap)
            clock[0] = t
            if kind == "complete":
                worker = workers[payload]  # type: ignore[index]
                job, nxt = worker.complete(t)
                policy.done(job.req)
                if nxt is not None:
                    schedule(nxt, "complete", worker.worker_id)
                if job.req.index >= warmup:
                    hit_tokens += job.cached_blocks * SETTINGS.block_size
                    total_tokens += job.req.num_tokens
                    latencies.append(t - job.req.arrival)
            elif kind == "deliver":
                w, events = payload  # type: ignore[misc]
                forwarders[w].publish(events)
            elif kind == "heartbeat" and registry is not None:
                for w in ids:
                    registry.register(infos[w], workers[w].load())
                if heap or t < trace[-1].arrival:
                    schedule(t + p.heartbeat_s, "heartbeat", None)
        clock[0] = max(clock[0], until)

    for req in trace:
        if req.index == warmup:
            advance(req.arrival)
            for w in workers.values():
                w._account(req.arrival)
            area_at_warm = {w: workers[w].area for w in ids}
        advance(req.arrival)
        started = time.perf_counter()
        chosen = policy.choose(req)
        choose_time += time.perf_counter() - started
        done_at = workers[chosen].enqueue(req.arrival, req)
        if done_at is not None:
            schedule(done_at, "complete", chosen)
    end = trace[-1].arrival
    advance(end)
    for w in workers.values():
        w._account(end)
    span = end - warm_start
    avg_queued = [(workers[w].area - area_at_warm[w]) / span for w in ids]
    mean_q = statistics.fmean(avg_queued)
    latencies.sort()
    return Result(
        policy=policy_name,
        workers=n,
        hit_rate=hit_tokens / max(total_tokens, 1),
        imbalance=max(avg_queued) / mean_q if mean_q > 0 else 1.0,
        mean_queued_tokens=mean_q,
        latency_p50_ms=1000 * latencies[len(latencies) // 2],
        latency_p99_ms=1000 * latencies[int(len(latencies) * 0.99)],
        decisions_s=choose_time / len(trace),
    )


# -- decision latency --------------------------------------------------------------------------


def decision_latency(num_workers: int = 16, prompts: int = 1000, seed: int = 1
                     ) -> dict[str, tuple[float, float]]:
    """p50/p99 seconds of ``Router.route`` for 8,192-token prompts, wall clock."""
    rng = random.Random(seed)
    registry = InProcessRegistry(SETTINGS, ttl_s=1e9)
    bus = InProcessEventBus()
    router = Router(RouterConfig(SETTINGS), registry, bus, replica_id="bench")
    forwarders = {}
    for i in range(num_workers):
        w = f"p{i:02d}"
        registry.register(WorkerInfo(w, "prefill", f"{w}:0", 16, SETTINGS.model_id, 65536))
        forwarders[w] = attach_worker(bus, w)
    hasher = PromptHasher(SETTINGS)
    systems = [[rng.randrange(32_000) for _ in range(6144)] for _ in range(50)]
    for t, system in enumerate(systems):  # each system prompt cached on two workers
        hashes = tuple(hasher.hashes(system))
        for w in (t % num_workers, (t + 1) % num_workers):
            forwarders[f"p{w:02d}"].publish([BlockStored(hashes, None, 16)])
    router.sync()

    def measure(make_prompt: Callable[[int], list[int]], prehashed: bool = False
                ) -> tuple[float, float]:
        for i in range(100):  # warm-up, unmeasured: the router has seen each system prompt
            router.release(router.route(make_prompt(i)).request_id)
        samples = []
        for i in range(prompts):
            tokens = make_prompt(i)
            hashes = router.hasher.hashes(tokens) if prehashed else None
            started = time.perf_counter()
            if hashes is None:
                decision = router.route(tokens)
            else:
                decision = router.route_hashes(hashes, len(tokens))
            samples.append(time.perf_counter() - started)
            router.release(decision.request_id)
            if i % 100 == 0:
                router.sync()
        samples.sort()
        return samples[len(samples) // 2], samples[int(len(samples) * 0.99)]

    def shared(i: int) -> list[int]:
        return systems[i % 50] + [rng.randrange(32_000) for _ in range(2048)]

    def unique(i: int) -> list[int]:
        return [rng.randrange(32_000) for _ in range(8192)]

    gc.collect()  # start from a clean heap, as a long-running router would be
    return {
        "6k shared system prompt + 2k unique tokens": measure(shared),
        "8k unique tokens": measure(unique),
        "6k shared + 2k unique, hashes precomputed (`route_hashes`)": measure(shared, True),
    }


# -- report ------------------------------------------------------------------------------------


def table_header() -> list[str]:
    return [
        "",
        "| N | policy | hit rate | vs oracle | imbalance (max/mean queued) | mean queued tokens "
        "| prefill latency p50 / p99 (ms) | decision cost (us) |",
        "|---|---|---|---|---|---|---|---|",
    ]


def report(p: SimParams, sizes: Sequence[int], latency: bool = True) -> str:
    lines = [] if not sizes else [
        f"Trace: {p.requests} requests, {p.tenants} tenants, system prompts "
        f"{p.system_tokens[0]}-{p.system_tokens[1]} tokens, Zipf s={p.zipf_s}, suffixes "
        f"{p.suffix_tokens[0]}-{p.suffix_tokens[1]} tokens, Poisson arrivals at {p.load:.0%} of "
        f"ideal capacity; workers: {p.cache_blocks} x 16-token blocks of LRU cache, "
        f"{p.rate_tokens_s:.0f} tokens/s + {1000 * p.overhead_s:.0f} ms per request; events "
        f"delivered after {1000 * p.event_lag_s:.0f} ms, heartbeats every "
        f"{1000 * p.heartbeat_s:.0f} ms; first {p.warmup:.0%} of requests not scored; "
        f"miss weight {p.miss_weight:g}, load weight {p.load_weight:g}.",
    ]
    if sizes:
        lines += table_header()
    for n in sizes:
        trace = make_trace(p, n)
        results = {name: simulate(name, trace, n, p) for name in POLICIES}
        oracle = results["oracle"].hit_rate
        for name in POLICIES:
            r = results[name]
            lines.append(
                f"| {n} | {name} | {r.hit_rate:.1%} | {r.hit_rate / oracle:.0%} | "
                f"{r.imbalance:.2f} | {r.mean_queued_tokens:,.0f} | "
                f"{r.latency_p50_ms:.0f} / {r.latency_p99_ms:.0f} | {1e6 * r.decisions_s:.0f} |"
            )
        warm = int(len(trace) * p.warmup)
        ideal = ideal_hit_rate(trace, warm)
        lines.append(f"| {n} | (one infinite cache) | {ideal:.1%} | | | | | |")
    if not latency:
        return "\n".join(lines)
    lines += ["", "Router decision latency, `Router.route` on 8,192-token prompts "
              "(hashing included), 16 workers:", "", "| prompts | p50 (ms) | p99 (ms) |",
              "|---|---|---|"]
    for label, (p50, p99) in decision_latency().items():
        lines.append(f"| {label} | {1000 * p50:.3f} | {1000 * p99:.3f} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workers", type=int, nargs="*", default=[4, 16],
                        help="fleet sizes to simulate (none: only time decisions)")
    parser.add_argument("--requests", type=int, default=SimParams.requests)
    parser.add_argument("--cache-blocks", type=int, default=SimParams.cache_blocks)
    parser.add_argument("--load", type=float, default=SimParams.load)
    parser.add_argument("--seed", type=int, default=SimParams.seed)
    parser.add_argument("--miss-weight", type=float, default=SimParams.miss_weight)
    parser.add_argument("--no-latency", action="store_true", help="skip the decision timing")
    parser.add_argument("--quick", action="store_true", help="1,500 requests")
    args = parser.parse_args(argv)
    p = SimParams(
        requests=1500 if args.quick else args.requests,
        cache_blocks=args.cache_blocks,
        load=args.load,
        seed=args.seed,
        miss_weight=args.miss_weight,
    )
    started = time.perf_counter()
    print(report(p, args.workers, latency=not args.no_latency))
    print(f"\n(run took {time.perf_counter() - started:.0f} s)")


if __name__ == "__main__":
    main()
