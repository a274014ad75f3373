"""The six questions, each answered with numbers and a one-line verdict."""

from __future__ import annotations

from dataclasses import dataclass

from tandem.services.doctor.diagnosis import KV_FULL, Diagnosis


@dataclass(frozen=True)
class Answer:
    key: str
    question: str
    numbers: dict[str, str]  # name -> value as printed (units included)
    verdict: str


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{1000 * seconds:.0f} ms"


def _pct(fraction: float | None) -> str:
    return "-" if fraction is None else f"{100 * fraction:.0f}%"


def latency(d: Diagnosis) -> Answer:
    parts = {"queueing": d.queue_s, "prefill": d.prefill_s, "KV transfer": d.transfer_s,
             "decode": d.decode_s}
    top = max(parts, key=lambda k: parts[k])
    numbers = {"requests": f"{d.requests:.0f}",
               "request rate": f"{d.request_rate:.2f}/s" if d.request_rate else "-",
               "E2E mean": _ms(d.e2e_s), "TTFT mean": _ms(d.ttft_s),
               "TTFT p99 (bucket)": _ms(d.ttft_p99_s), "ITL mean": _ms(d.itl_s)}
    numbers |= {f"{name}": f"{_ms(s)} ({_pct(d.share(s))})" for name, s in parts.items()}
    return Answer("latency", "Where does the time go?", numbers,
                  f"{top} dominates: {_pct(d.share(parts[top]))} of a mean request's "
                  f"{_ms(d.e2e_s)}")


def prefix(d: Diagnosis) -> Answer:
    numbers = {"prefix cache hit rate": _pct(d.hit_rate),
               "cached on any prefill worker": _pct(d.reachable),
               "cached on the chosen one": _pct(d.chosen),
               "routing policy": d.config.get("routing_policy", "-")}
    if d.colocated:
        verdict = f"one engine: the hit rate ({_pct(d.hit_rate)}) is all there is to share"
    elif d.reachable is None or d.chosen is None:
        verdict = "no routed prompt with a readable prefix index in the window"
    elif d.reachable - d.chosen >= 0.05:
        verdict = (f"{_pct(d.reachable - d.chosen)} of prompt blocks were cached on another "
                   f"prefill worker than the one chosen: hits lost to routing")
    else:
        verdict = (f"routing reaches what is shared ({_pct(d.chosen)} of prompt blocks cached "
                   f"where they went)")
    return Answer("prefix", "How much prefix is shared?", numbers, verdict)


def batch(d: Diagnosis) -> Answer:
    numbers = {"running per decoding engine (mean)": f"{d.running.mean:.1f}",
               "running (peak)": f"{d.running.peak:.0f}",
               "waiting per decoding engine (mean)": f"{d.waiting.mean:.1f}",
               "max_num_seqs": str(d.max_num_seqs or "-"),
               "batch fill": _pct(d.batch_fill)}
    if d.memory_bound:
        verdict = (f"the batch stopped at {d.running.peak:.0f} sequences because KV ran out "
                   f"(throughput-bound, offline-like load)")
    elif d.batch_fill >= 0.8:
        verdict = "batches run near max_num_seqs: throughput-bound (offline-like load)"
    else:
        verdict = (f"small batches ({d.running.mean:.1f} of {d.max_num_seqs}): latency-bound, "
                   f"interactive load; spare compute per step")
    return Answer("batch", "What batch size is reached (interactive or offline)?", numbers,
                  verdict)


def context(d: Diagnosis) -> Answer:
    tokens = d.prompt_tokens + d.output_tokens
    blocks = tokens / d.block_size if d.block_size else 0.0
    per_engine = d.kv_blocks / blocks if blocks else 0.0
    numbers = {"prompt tokens per request": f"{d.prompt_tokens:.0f}",
               "output tokens per request": f"{d.output_tokens:.0f}",
               "KV blocks per request (at its end)": f"{blocks:.1f}",
               "KV blocks per decoding engine": f"{d.kv_blocks:.0f}",
               "requests whose KV fits one engine": f"{per_engine:.0f}"}
    kind = ("prompt-heavy (prefill-bound work)" if d.prompt_tokens > 4 * d.output_tokens else
            "output-heavy (decode-bound work)" if d.output_tokens > d.prompt_tokens else
            "balanced")
    verdict = f"{kind}; an engine's KV holds {per_engine:.0f} such requests"
    if d.max_num_seqs and per_engine < d.max_num_seqs:
        verdict += f", fewer than max_num_seqs ({d.max_num_seqs})"
    return Answer("context", "How long are the contexts?", numbers, verdict)


def memory(d: Diagnosis) -> Answer:
    numbers = {"KV usage mean": _pct(d.kv_usage.mean), "KV usage peak": _pct(d.kv_usage.peak),
               "preemptions": f"{d.preemptions:.0f}",
               "preemptions per request": f"{d.preemptions_per_request:.2f}"}
    if d.preemptions:
        verdict = (f"KV pressure: {d.preemptions:.0f} preemptions "
                   f"({d.preemptions_per_request:.2f} per request), each recomputing a sequence")
    elif d.kv_usage.peak >= KV_FULL:
        verdict = f"KV nearly full at peak ({_pct(d.kv_usage.peak)}), no preemption yet"
    else:
        verdict = f"KV has room (peak {_pct(d.kv_usage.peak)}, no preemption)"
    return Answer("memory", "Where does memory go (KV pressure, preemptions)?", numbers, verdict)


def speculation(d: Diagnosis) -> Answer:
    method = d.config.get("spec", "none")
    numbers = {"method": method, "draft tokens": f"{d.spec_draft:.0f}",
               "accepted": f"{d.spec_accepted:.0f}", "acceptance": _pct(d.acceptance),
               "mean accepted length": (f"{d.spec_accepted / d.spec_steps:.2f}"
                                        if d.spec_steps else "-")}
    if method in ("", "none"):
        verdict = "speculative decoding is off"
    elif d.acceptance is None:
        verdict = f"{method} on, but no draft was verified in the window"
    elif d.acceptance < 0.3:
        verdict = f"{method}: {_pct(d.acceptance)} accepted, too few to pay for verification"
    else:
        verdict = f"{method}: {_pct(d.acceptance)} of drafts accepted"
    return Answer("speculation", "How well does speculation work?", numbers, verdict)


QUESTIONS = (latency, prefix, batch, context, memory, speculation)


def answer_all(d: Diagnosis) -> list[Answer]:
    return [question(d) for question in QUESTIONS]
