"""Workloads are deterministic per seed and their prompts have exact token lengths."""

from __future__ import annotations

from collections import Counter

import pytest

from tandem.loadtest.bench.prompts import PromptError, PromptMaker
from tandem.loadtest.bench.workloads import (
    BenchRequest,
    LengthRange,
    WorkloadSpec,
    build_workload,
    zipf_weights,
)

CASES = [("random", "completions"), ("random", "chat"), ("prefix", "completions"),
         ("prefix", "chat"), ("chat", "chat"), ("mix", "completions"), ("mix", "chat")]


def spec(name: str, endpoint: str, **overrides: object) -> WorkloadSpec:
    base: dict[str, object] = dict(
        name=name, endpoint=endpoint, num_requests=24, input_len=LengthRange(40, 80),
        output_len=LengthRange(4, 12), prefix_len=96, num_tenants=4, num_turns=3,
        long_fraction=0.25, long_input_len=LengthRange(300, 300))
    return WorkloadSpec(**{**base, **overrides})  # type: ignore[arg-type]


def counted(maker: PromptMaker, request: BenchRequest) -> int:
    if request.messages is not None:
        return maker.count_chat(request.messages)
    assert request.prompt is not None
    return maker.count_text(request.prompt)


@pytest.mark.parametrize(("name", "endpoint"), CASES)
def test_deterministic_per_seed(maker: PromptMaker, name: str, endpoint: str) -> None:
    a = build_workload(spec(name, endpoint), maker, seed=7).requests
    b = build_workload(spec(name, endpoint), maker, seed=7).requests
    c = build_workload(spec(name, endpoint), maker, seed=8).requests
    assert a == b
    assert a != c
    assert [r.index for r in a] == list(range(24))


@pytest.mark.parametrize(("name", "endpoint"), CASES)
def test_prompt_token_counts_are_exact(maker: PromptMaker, name: str, endpoint: str) -> None:
    for request in build_workload(spec(name, endpoint), maker, seed=3).requests:
        assert counted(maker, request) == request.prompt_tokens, request
        assert (request.prompt is None) == (endpoint == "chat")
        if name == "random":
            assert 40 <= request.prompt_tokens <= 80
        elif name == "prefix":
            assert 96 + 40 <= request.prompt_tokens <= 96 + 80
        elif name == "mix":
            assert request.prompt_tokens == 300 if request.kind == "long" else \
                40 <= request.prompt_tokens <= 80
        assert 4 <= request.max_tokens <= 12


def test_fixed_lengths_are_exact(maker: PromptMaker) -> None:
    for endpoint in ("completions", "chat"):
        w = build_workload(spec("random", endpoint, input_len=LengthRange(64, 64),
                                output_len=LengthRange(7, 7)), maker, seed=0)
        assert {(r.prompt_tokens, r.max_tokens) for r in w.requests} == {(64, 7)}


def test_ranges_are_used(maker: PromptMaker) -> None:
    w = build_workload(spec("random", "completions"), maker, seed=1)
    assert len({r.prompt_tokens for r in w.requests}) > 5
    assert len({r.max_tokens for r in w.requests}) > 3


def test_prefix_tenants_share_system_prompts_with_zipf_popularity(maker: PromptMaker) -> None:
    w = build_workload(spec("prefix", "chat", num_requests=200), maker, seed=5)
    systems: dict[str, set[str]] = {}
    for r in w.requests:
        assert r.messages is not None and r.messages[0].role == "system"
        assert maker.count_text(r.messages[0].content) == 96
        systems.setdefault(r.group, set()).add(r.messages[0].content)
    assert all(len(s) == 1 for s in systems.values())  # one system prompt per tenant
    assert len({next(iter(s)) for s in systems.values()}) == len(systems)  # tenants differ
    popularity = Counter(r.group for r in w.requests)
    assert popularity["tenant-0"] > popularity["tenant-3"]
    assert zipf_weights(4, 1.0).tolist() == pytest.approx([12 / 25, 6 / 25, 4 / 25, 3 / 25])

    texts = build_workload(spec("prefix", "completions"), maker, seed=5).requests
    by_tenant: dict[str, list[str]] = {}
    for r in texts:
        assert r.prompt is not None
        by_tenant.setdefault(r.group, []).append(r.prompt)
    for prompts in by_tenant.values():
        shared = maker.tokenizer.encode(prompts[0])[:96]
        assert all(maker.tokenizer.encode(p)[:96] == shared for p in prompts)


def test_chat_history_grows_and_turns_wait_for_the_previous_one(maker: PromptMaker) -> None:
    w = build_workload(spec("chat", "chat", num_requests=10), maker, seed=2)
    by_index = {r.index: r for r in w.requests}
    turns: dict[str, list[BenchRequest]] = {}
    for r in w.requests:
        turns.setdefault(r.group, []).append(r)
    assert len(turns) == 4  # ceil(10 / 3 turns)
    for conversation in turns.values():
        assert conversation[0].after is None
        for prev, cur in zip(conversation, conversation[1:], strict=False):
            assert cur.after == prev.index and by_index[cur.after] is prev
            assert prev.messages is not None and cur.messages is not None
            assert cur.messages[:len(prev.messages)] == prev.messages
            assert [m.role for m in cur.messages[len(prev.messages):]] == ["assistant", "user"]
            # The synthetic reply is as long as the previous turn's max_tokens.
            reply = cur.messages[len(prev.messages)].content
            assert maker.count_text(reply) == prev.max_tokens
            assert cur.prompt_tokens > prev.prompt_tokens
    # Turn-major order: every first turn comes before any second turn.
    assert [r.after is None for r in w.requests] == [True] * 4 + [False] * 6


def test_mix_has_the_exact_long_fraction(maker: PromptMaker) -> None:
    w = build_workload(spec("mix", "completions", num_requests=40, long_fraction=0.1), maker,
                       seed=4)
    kinds = Counter(r.kind for r in w.requests)
    assert kinds == {"long": 4, "short": 36}


def test_bad_specs_fail_with_clear_messages(maker: PromptMaker) -> None:
    with pytest.raises(ValueError, match="use --endpoint chat"):
        build_workload(spec("chat", "completions"), maker, seed=0)
    with pytest.raises(ValueError, match="unknown workload 'nope'"):
        build_workload(spec("nope", "completions"), maker, seed=0)
    with pytest.raises(ValueError, match="--long-fraction"):
        build_workload(spec("mix", "completions", long_fraction=1.5), maker, seed=0)
    # The chat template alone is longer than 5 tokens.
    with pytest.raises(PromptError, match="cannot make a 5-token prompt: its fixed part"):
        build_workload(spec("random", "chat", input_len=LengthRange(5, 5)), maker, seed=0)


@pytest.mark.parametrize(("text", "expected"), [("256", (256, 256)), ("16:32", (16, 32))])
def test_length_ranges_parse(text: str, expected: tuple[int, int]) -> None:
    r = LengthRange.parse(text)
    assert (r.low, r.high) == expected
    assert str(r) == text


@pytest.mark.parametrize("text", ["0", "-3", "abc", "9:3", "1:x", ""])
def test_bad_length_ranges_are_rejected(text: str) -> None:
    with pytest.raises(ValueError):
        LengthRange.parse(text)
