"""A multi-turn agent workload: many sessions of several turns each, every turn's prompt the
whole conversation so far (a shared system prompt, the replies, tool results), competing for
the servers' KV caches.

Each session is a chat: turn 1 asks a question; every later turn appends the model's reply and a
tool result (random words) and asks again, so a turn's prompt starts with the previous turn's
prompt and reply. Sessions run ``--concurrency`` at a time. Run once per mode, alternating over
``--rounds``, on the same conversations:

- ``sessions``: each request names its session (``prompt_cache_key``): the router keeps the
  session on the worker that holds its KV, while that worker is healthy and not overloaded;
- ``plain``: no session named (the router's usual prefix-aware choice);
- any OpenAI-compatible server (vLLM with prefix caching, say) with ``--base-url`` and
  ``--modes plain``.

The figure the agent loop feels is turn 2+'s time to first token: how much of the conversation
a turn finds still cached. Reported per mode: TTFT p50 and p90 of turn 1 and of turns 2+, the
prompt tokens served from the cache (from each reply's usage), and output tokens per second;
medians over rounds. The last line is a JSON summary.

    python -m tandem.loadtest.agent_bench --base-url http://127.0.0.1:8000 \\
        --sessions 16 --turns 8 --concurrency 4 --rounds 2
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from dataclasses import dataclass, field

import httpx

from tandem.loadtest import results as results_table

PROG = "python -m tandem.loadtest.agent_bench"
MODES = ("sessions", "plain")
WORDS = ("alpha", "bravo", "cache", "decode", "engine", "fleet", "gateway", "host", "index",
         "journal", "kernel", "lease", "memory", "node", "offset", "prefill", "queue", "router",
         "shard", "token", "unit", "vector", "worker", "yield", "zone")


@dataclass
class Turn:
    session: int
    turn: int  # 1-based
    ttft_s: float
    output_tokens: int
    prompt_tokens: int
    cached_tokens: int


@dataclass
class ModeResult:
    mode: str
    round: int
    wall_s: float
    turns: list[Turn] = field(default_factory=list)

    def summary(self) -> dict[str, float | None]:
        first = [t.ttft_s for t in self.turns if t.turn == 1]
        later = [t.ttft_s for t in self.turns if t.turn > 1]
        prompt = sum(t.prompt_tokens for t in self.turns if t.turn > 1)
        return {"ttft_turn1_p50_s": _quantile(first, 0.5),
                "ttft_turn2plus_p50_s": _quantile(later, 0.5),
                "ttft_turn2plus_p90_s": _quantile(later, 0.9),
                "turn2plus_cached_fraction": (sum(t.cached_tokens for t in self.turns
                                                  if t.turn > 1) / prompt) if prompt else None,
                "output_tokens_per_s": sum(t.output_tokens for t in self.turns) / self.wall_s}


def _quantile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


@dataclass(frozen=True)
class Workload:
    sessions: int
    turns: int
    system_words: int
    tool_words: int
    output_len: int
    seed: int

    def system_prompt(self, run: str) -> str:
        """The sessions' shared system prompt, opening with the run's name: no run finds
        another's conversations cached, and every run's are the same after it."""
        return (f"Run {run}. You are an operations agent. Use the tool results to answer. "
                f"Notes: {_words(random.Random(self.seed), self.system_words)}")

    def question(self, session: int, turn: int) -> str:
        rng = random.Random(f"{self.seed}-{session}-{turn}")
        return f"Session {session}, step {turn}: what should we check next about {_words(rng, 6)}?"

    def tool_result(self, session: int, turn: int) -> str:
        rng = random.Random(f"{self.seed}-{session}-{turn}-tool")
        return f"Tool result: {_words(rng, self.tool_words)}"


async def run_session(http: httpx.AsyncClient, url: str, model: str, work: Workload,
                      session: int, mode: str, label: str, headers: dict[str, str]
                      ) -> list[Turn]:
    messages = [{"role": "system", "content": work.system_prompt(label)}]
    turns = []
    for turn in range(1, work.turns + 1):
        if turn > 1:
            messages.append({"role": "user", "content": work.tool_result(session, turn - 1)})
        messages.append({"role": "user", "content": work.question(session, turn)})
        body: dict[str, object] = {
            "model": model, "messages": messages, "max_tokens": work.output_len,
            "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
        if mode == "sessions":
            body["prompt_cache_key"] = f"{label}-{session}"
        started = time.monotonic()
        first: float | None = None
        reply, usage = "", {}
        async with http.stream("POST", f"{url}/v1/chat/completions", json=body,
                               headers=headers) as response:
            response.raise_for_status()
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    usage = chunk["usage"]
                for choice in chunk.get("choices", []):
                    text = choice.get("delta", {}).get("content") or ""
                    if text and first is None:
                        first = time.monotonic() - started
                    reply += text
        messages.append({"role": "assistant", "content": reply})
        details = usage.get("prompt_tokens_details") or {}
        turns.append(Turn(session, turn, first if first is not None else float("nan"),
                          usage.get("completion_tokens", 0), usage.get("prompt_tokens", 0),
                          details.get("cached_tokens") or 0))
    return turns


async def run_mode(url: str, model: str, work: Workload, mode: str, round_: int,
                   concurrency: int, api_key: str | None = None) -> ModeResult:
    """Every session once, ``concurrency`` at a time. The run's name (mode, round) opens the
    system prompt and the session ids: no run finds another run's KV or session."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    gate = asyncio.Semaphore(concurrency)
    label = f"{mode}-r{round_}-{work.seed}"
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), trust_env=False) as http:
        async def one(session: int) -> list[Turn]:
            async with gate:
                return await run_session(http, url, model, work, session, mode, label,
                                         headers)

        started = time.monotonic()
        done = await asyncio.gather(*(one(s) for s in range(work.sessions)))
        result = ModeResult(mode, round_, time.monotonic() - started)
    result.turns = [t for turns in done for t in turns]
    return result


def medians(results: list[ModeResult]) -> dict[str, dict[str, float | None]]:
    out: dict[str, dict[str, float | None]] = {}
    for mode in dict.fromkeys(r.mode for r in results):
        rows = [r.summary() for r in results if r.mode == mode]
        out[mode] = {key: (statistics.median(v) if (v := [row[key] for row in rows
                                                         if row[key] is not None]) else None)
                     for key in rows[0]}
    return out


async def run(url: str, model: str, work: Workload, modes: list[str], rounds: int,
              concurrency: int, api_key: str | None = None, progress: bool = True
              ) -> list[ModeResult]:
    results = []
    for round_ in range(rounds):
        order = modes if round_ % 2 == 0 else modes[::-1]  # alternate which goes first
        for mode in order:
            result = await run_mode(url, model, work, mode, round_, concurrency, api_key)
            if progress:
                print(f"round {round_} {mode}: {json.dumps(result.summary())}", file=sys.stderr)
            results.append(result)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=PROG,
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", default="", help="(default: the served one)")
    parser.add_argument("--api-key")
    parser.add_argument("--sessions", type=int, default=16)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--system-words", type=int, default=300)
    parser.add_argument("--tool-words", type=int, default=120)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--modes", default="sessions,plain")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--label", default="",
                        help="the server's settings in words, for --record's row")
    results_table.add_argument(parser)
    args = parser.parse_args(argv)
    argv = sys.argv[1:] if argv is None else argv
    modes = args.modes.split(",")
    unknown = sorted(set(modes) - set(MODES))
    if unknown:
        parser.error(f"--modes: {unknown[0]!r} is not one of {', '.join(MODES)}")
    work = Workload(args.sessions, args.turns, args.system_words, args.tool_words,
                    args.output_len, args.seed)
    results = asyncio.run(run(args.base_url.rstrip("/").removesuffix("/v1"), args.model, work,
                              modes, args.rounds, args.concurrency, args.api_key))
    summary = medians(results)
    print(json.dumps({"workload": work.__dict__, "concurrency": args.concurrency,
                      "rounds": args.rounds, "medians": summary}))
    if args.record:
        results_table.record([results_table.Result(
            f"agent sessions ({args.label or args.base_url}), {mode}: turn-2+ TTFT p50 / p90, "
            f"output tok/s, turn-2+ prompt cached", _figures(values),
            results_table.command(PROG, argv)) for mode, values in summary.items()], args.record)
    return 0


def _figures(values: dict[str, float | None]) -> str:
    def fmt(key: str, spec: str) -> str:
        value = values.get(key)
        return "-" if value is None else format(value, spec)
    return (f"{fmt('ttft_turn2plus_p50_s', '.2f')} / {fmt('ttft_turn2plus_p90_s', '.2f')} s, "
            f"{fmt('output_tokens_per_s', '.1f')} tok/s, "
            f"{fmt('turn2plus_cached_fraction', '.0%')}")


if __name__ == "__main__":
    sys.exit(main())
