"""The levers: each names the ``tandem up`` flag or config key that pulls it, and an expected
effect from the evidence, as a fraction of the mean request's E2E latency it would save. Each
estimate is a first-order one, stated with its inputs (docs/operations.md "Doctor")."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from tandem.services.doctor.diagnosis import Diagnosis
from tandem.services.engine.config import SpeculativeConfig

# Decode speed-up that speculative decoding is assumed to bring while it is off (nothing
# measured it): n-gram prompt lookup measured 1.47x on repetitive text at batch 1 and 0.93x on
# chat (docs/speculative.md, "Measured"), so this is an upper estimate; the measured acceptance
# replaces it once speculation runs.
SPEC_PRIOR_SPEEDUP = 1.47
# The adaptive policy shares this many draft tokens per step across the batch: k shrinks as the
# batch grows and speculation stops at this many running sequences.
SPEC_BATCH_LIMIT = SpeculativeConfig().max_draft_tokens_per_step
NIXL_PULL_S = 0.005  # a KV pull over NIXL with RDMA: milliseconds
BATCH_FULL = 0.8  # a decode batch this full has no room for more sequences in practice
SHOWN_FROM = 0.01  # levers expected to save less than 1 % of E2E are not recommended


@dataclass(frozen=True)
class Lever:
    key: str
    name: str
    change: str  # the flag or config value that pulls it
    effect: float  # expected fraction of mean E2E saved, 0..1
    evidence: str  # the numbers behind the estimate


def _pct(fraction: float) -> str:
    return f"{100 * fraction:.0f}%"


def _ms(seconds: float) -> str:
    return f"{1000 * seconds:.0f} ms"


def prefix_routing(d: Diagnosis) -> Lever | None:
    """Round-robin prefill loses the hits cached on another worker: prefix routing finds them.
    Saving: prefill time × the lost blocks' share of the blocks computed."""
    if d.colocated or d.config.get("routing_policy") != "round_robin":
        return None
    if d.reachable is None or d.chosen is None:
        return None
    lost = max(0.0, d.reachable - d.chosen)
    computed = 1.0 - d.chosen
    saving = d.prefill_s * lost / computed if computed > 0 else 0.0
    return Lever("prefix_routing", "route prompts to the worker caching their prefix",
                 "--routing-policy prefix", d.share(saving),
                 f"{_pct(d.reachable)} of prompt blocks were cached on some prefill worker, "
                 f"{_pct(d.chosen)} on the chosen one; prefill is {_ms(d.prefill_s)} "
                 f"({_pct(d.share(d.prefill_s))} of E2E) -> saves ~{_ms(saving)}")


def speculation(d: Diagnosis) -> Lever | None:
    """Speculation spends spare compute per decode step: saving = decode time × (1 − 1/speed-up)
    × the batch's room for drafts (1 − running / SPEC_BATCH_LIMIT; none once KV ran out)."""
    if d.config.get("spec", "none") not in ("", "none"):
        return None
    room = 0.0 if d.memory_bound else max(0.0, 1.0 - d.running.mean / SPEC_BATCH_LIMIT)
    saving = d.decode_s * (1 - 1 / SPEC_PRIOR_SPEEDUP) * room
    return Lever("speculation", "speculative decoding (n-gram prompt lookup)", "--spec ngram",
                 d.share(saving),
                 f"decode is {_ms(d.decode_s)} ({_pct(d.share(d.decode_s))} of E2E); assumed "
                 f"speed-up {SPEC_PRIOR_SPEEDUP}x (measured on repetitive text; less on chat); "
                 f"{d.running.mean:.1f} sequences running"
                 f"{', KV full' if d.memory_bound else ''}: room for drafts {_pct(room)} -> "
                 f"saves ~{_ms(saving)}")


def kv_memory(d: Diagnosis) -> Lever | None:
    """Out of KV, the batch stops growing and sequences are preempted: more KV blocks remove
    the recomputes (prefill time per token × each preempted sequence's mean context) and the
    waits behind the full cache."""
    if not d.memory_bound:
        return None
    context = d.prompt_tokens + d.output_tokens / 2
    recompute = d.preemptions_per_request * context * d.prefill_s_per_token
    waited = d.wait_s if d.colocated else d.decode_wait_s
    saving = recompute + waited
    blocks = d.config.get("num_kv_blocks")
    change = (f"num_kv_blocks: {2 * int(blocks)} (config)" if blocks else
              f"kv_cache_memory_gb: {2 * float(d.config.get('kv_cache_memory_gb') or 1.0):g} "
              f"(config)")  # unset: 1 GiB, the CPU default (engine/kv_sizing.py)
    return Lever("kv_memory", "more KV cache per decoding engine", change, d.share(saving),
                 f"KV usage peak {_pct(d.kv_usage.peak)}, {d.preemptions:.0f} preemptions "
                 f"({d.preemptions_per_request:.2f}/request) x {context:.0f} tokens x "
                 f"{_ms(d.prefill_s_per_token)}/token = {_ms(recompute)} recomputed, "
                 f"{_ms(waited)} waiting for blocks -> saves ~{_ms(saving)}")


def prefill_workers(d: Diagnosis) -> Lever | None:
    """Prompts queue before prefill: another prefill worker takes at least its share
    (1/(N+1)) of the queue."""
    if d.colocated or d.queue_s <= 0:
        return None
    return _another_worker(d, "prefill", d.queue_s,
                           f"prompts wait {_ms(d.queue_s)} before prefill "
                           f"({_pct(d.share(d.queue_s))} of E2E)")


def decode_workers(d: Diagnosis) -> Lever | None:
    """Sequences wait for a decode slot with KV to spare (batches near max_num_seqs): another
    decode worker takes at least its share (1/(M+1)) of the wait."""
    if d.colocated or d.memory_bound or d.batch_fill < BATCH_FULL or d.decode_wait_s <= 0:
        return None
    return _another_worker(d, "decode", d.decode_wait_s,
                           f"sequences wait {_ms(d.decode_wait_s)} for a decode slot with "
                           f"{d.running.mean:.1f} running of max_num_seqs {d.max_num_seqs}")


def _another_worker(d: Diagnosis, role: str, waited_s: float, why: str) -> Lever:
    count = int(d.config.get(f"{role}_replicas") or 1)
    saving = waited_s / (count + 1)
    return Lever(f"{role}_workers", f"another {role} worker", f"--{role} {count + 1}",
                 d.share(saving),
                 f"{why} on {count} worker(s) -> saves at least ~{_ms(saving)}")


def kv_transport(d: Diagnosis) -> Lever | None:
    """KV pulls over TCP: NIXL over RDMA brings one to milliseconds."""
    if d.colocated or not d.kv_over_tcp or d.transfer_s <= NIXL_PULL_S:
        return None
    saving = d.transfer_s - NIXL_PULL_S
    return Lever("kv_transport", "KV over NIXL (RDMA)", "--kv-transport nixl", d.share(saving),
                 f"a KV pull takes {_ms(d.transfer_s)} ({_pct(d.share(d.transfer_s))} of E2E) "
                 f"over TCP; NIXL with RDMA ~{_ms(NIXL_PULL_S)}")


LEVERS: tuple[Callable[[Diagnosis], Lever | None], ...] = (
    prefix_routing, speculation, kv_memory, prefill_workers, decode_workers, kv_transport)


def ranked(d: Diagnosis) -> list[Lever]:
    """Every lever that applies, the largest expected effect first."""
    levers = [lever for make in LEVERS if (lever := make(d)) is not None]
    return sorted(levers, key=lambda lever: -lever.effect)


def recommended(levers: list[Lever]) -> list[Lever]:
    return [lever for lever in levers if lever.effect >= SHOWN_FROM]
