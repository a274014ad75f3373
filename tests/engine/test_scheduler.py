"""The scheduler shares a step among tenants: a flooding tenant's prompts do not queue another
tenant's, and a decoding sequence keeps its token when prompts fill the budget. Without a model:
the test plays the engine's part (marks what a step computed, appends a sampled token)."""

from __future__ import annotations

from tandem.services.engine.block_manager import BlockManager
from tandem.services.engine.scheduler import Scheduler, SchedulerOutput
from tandem.services.engine.sequence import Sequence
from tandem.services.protocol.request import GenerationRequest, SamplingParams

BS = 4


def make_seq(rid: str, num_tokens: int, tenant: str) -> Sequence:
    tokens = [hash((rid, i)) % 1000 for i in range(num_tokens)]  # no shared prefixes
    return Sequence(rid, tokens, num_tokens, SamplingParams(max_tokens=64), ("m",), tenant)


def run_step(scheduler: Scheduler) -> SchedulerOutput:
    """Schedule a step and play it: each scheduled sequence computed its tokens; one whose
    prompt is now computed samples a token."""
    out = scheduler.schedule()
    for item in out.scheduled:
        seq = item.seq
        scheduler.computed(seq, seq.num_computed_tokens + item.num_new_tokens)
        if seq.num_computed_tokens == seq.num_tokens:
            seq.token_ids.append(7)
    return out


def scheduled(out: SchedulerOutput) -> dict[str, int]:
    return {item.seq.request_id: item.num_new_tokens for item in out.scheduled}


def test_another_tenants_prompt_is_not_queued_behind_a_flood():
    scheduler = Scheduler(BlockManager(num_blocks=256, block_size=BS), max_num_seqs=16,
                          max_num_batched_tokens=24)
    for i in range(8):
        scheduler.add(make_seq(f"flood-{i}", 20, "flood"))
    first = scheduled(run_step(scheduler))
    assert first == {"flood-0": 20, "flood-1": 4}
    scheduler.add(make_seq("calm", 6, "calm"))

    second = scheduled(run_step(scheduler))
    # flood-0 decodes; then the calm tenant's prompt (its tenant runs none) goes ahead of
    # flood-1's unfinished prompt and of the six flood prompts that arrived before it.
    assert list(second) == ["flood-0", "calm", "flood-1", "flood-2"]
    assert second == {"flood-0": 1, "calm": 6, "flood-1": 16, "flood-2": 1}


def test_prompt_chunks_go_by_tenant_share_and_decodes_keep_their_token():
    scheduler = Scheduler(BlockManager(num_blocks=256, block_size=BS), max_num_seqs=16,
                          max_num_batched_tokens=16)
    for rid, size, tenant in (("calm-0", 3, "calm"), ("flood-0", 6, "flood"),
                              ("flood-1", 40, "flood"), ("flood-2", 40, "flood")):
        scheduler.add(make_seq(rid, size, tenant))
    assert scheduled(run_step(scheduler)) == {"calm-0": 3, "flood-0": 6, "flood-1": 7}
    scheduler.add(make_seq("calm-1", 40, "calm"))
    # Both decoding sequences keep their token; the calm tenant runs 1 sequence, the flood 2:
    # calm-1's prompt takes the rest of the step, ahead of flood-1's unfinished one.
    assert scheduled(run_step(scheduler)) == {"calm-0": 1, "flood-0": 1, "calm-1": 14}
    # Now 2 against 2: arrival order among equals (flood-1 was running first).
    assert scheduled(run_step(scheduler)) == {"calm-0": 1, "flood-0": 1, "flood-1": 14}


def test_single_tenant_order_is_arrival_order():
    scheduler = Scheduler(BlockManager(num_blocks=256, block_size=BS), max_num_seqs=16,
                          max_num_batched_tokens=16)
    for i in range(4):
        scheduler.add(make_seq(f"r{i}", 6, "default"))
    assert list(scheduled(run_step(scheduler))) == ["r0", "r1", "r2"]
    assert list(scheduled(run_step(scheduler))) == ["r0", "r1", "r2", "r3"]


def test_the_requests_tenant_reaches_the_engines_sequence(make_engine):  # type: ignore[no-untyped-def]
    engine = make_engine()
    engine.add_request(GenerationRequest("r", [1, 2, 3], SamplingParams(max_tokens=2),
                                         tenant="calm"))
    seq = engine.scheduler.get("r")
    assert seq is not None and seq.tenant == "calm"
