"""Draft-model proposer: a small model (or the target's first layers) drafts k tokens.

The draft keeps its own paged KV cache, one shadow ``Sequence`` per request. On a decode worker
the prefill worker sent only the target's KV, so the first proposal prefills the prompt into
the draft cache here; afterwards each step feeds only what is new. Before drafting, a shadow is
synced with the target: its KV stays valid up to the longest common prefix of the two token
lists, so rejected drafts are simply recomputed over.

A shadow's ``num_computed_tokens`` is written here, not by the scheduler (which owns it for the
engine's sequences): shadows are never scheduled; they are private bookkeeping over the draft's
own KV cache and only share the ``Sequence`` type to reuse ``ModelRunner`` and ``BlockManager``.
"""

from __future__ import annotations

from pathlib import Path

from tandem.services.engine.block_manager import BlockManager
from tandem.services.engine.config import EngineConfig
from tandem.services.engine.kv_cache import KVCacheSpec, allocate_kv_cache
from tandem.services.engine.model import LlamaModel
from tandem.services.engine.model_loader import LoadedModel, load_model
from tandem.services.engine.model_runner import ModelRunner
from tandem.services.engine.sampler import sample
from tandem.services.engine.scheduler import ScheduledSequence
from tandem.services.engine.sequence import Sequence
from tandem.services.engine.speculative.proposer import Proposal


class DraftModelProposer:
    def __init__(self, runner: ModelRunner, blocks: BlockManager) -> None:
        self.runner = runner
        self.blocks = blocks
        self.shadows: dict[str, Sequence] = {}
        self._synced: dict[str, int] = {}  # target tokens already copied into the shadow

    @classmethod
    def from_model(cls, model: LlamaModel, config: EngineConfig) -> DraftModelProposer:
        spec = KVCacheSpec.for_model(model.config, config.block_size, config.dtype, None,
                                     config.speculative.draft_kv_cache_memory_gb)
        runner = ModelRunner(model, allocate_kv_cache(spec, config.device), config.block_size,
                             config.device)
        blocks = BlockManager(spec.num_blocks, config.block_size, enable_prefix_caching=False)
        return cls(runner, blocks)

    @classmethod
    def load(cls, path: str | Path | LoadedModel, config: EngineConfig, target: LlamaModel
             ) -> DraftModelProposer:
        loaded = path if isinstance(path, LoadedModel) else load_model(
            path, config.dtype, progress=False)
        if loaded.config.vocab_size != target.config.vocab_size:
            raise ValueError(
                f"the draft model's vocabulary ({loaded.config.vocab_size} tokens) differs from "
                f"the target's ({target.config.vocab_size}); it must share the tokenizer")
        model = LlamaModel(loaded.config, loaded.weights, target.attention,
                           max_positions=target.cos.shape[0], device=config.device)
        return cls.from_model(model, config)

    def propose(self, requests: list[tuple[Sequence, int]]) -> dict[str, Proposal]:
        active = {seq.request_id: (self._sync(seq), k) for seq, k in requests}
        drafted: dict[str, list[int]] = {rid: [] for rid in active}
        while active:
            # Feed each shadow what its cache lacks: on the first round everything since the
            # last sync (possibly the whole prompt), then the token drafted one round before.
            scheduled = []
            for rid, (shadow, _) in list(active.items()):
                num_new = shadow.num_tokens - shadow.num_computed_tokens
                if self.blocks.allocate(shadow, num_new):
                    scheduled.append(ScheduledSequence(shadow, num_new))
                else:  # the draft cache is full: this request drafts no further this step
                    del active[rid]
            if not scheduled:
                break
            result = self.runner.execute(scheduled)
            for item in scheduled:
                item.seq.num_computed_tokens += item.num_new_tokens
            # The draft draws with the noise the target will draw with at the same positions
            # (sampler.py): where the two models agree, so do their tokens.
            tokens = sample(result.logits[result.first_rows],
                            [shadow.sampling for shadow in result.sampled],
                            [shadow.num_output_tokens for shadow in result.sampled])
            for shadow, token in zip(result.sampled, tokens, strict=True):
                rid = shadow.request_id
                shadow.token_ids.append(token)
                drafted[rid].append(token)
                if len(drafted[rid]) >= active[rid][1]:
                    del active[rid]
        return {rid: Proposal(tokens) for rid, tokens in drafted.items() if tokens}

    def forget(self, request_id: str) -> None:
        shadow = self.shadows.pop(request_id, None)
        self._synced.pop(request_id, None)
        if shadow is not None:
            self.blocks.free(shadow)

    def num_free_blocks(self) -> int | None:
        return self.blocks.num_free_blocks

    def _sync(self, seq: Sequence) -> Sequence:
        shadow = self.shadows.get(seq.request_id)
        if shadow is None:
            shadow = Sequence(seq.request_id, list(seq.token_ids), seq.num_prompt_tokens,
                              seq.sampling, extra_keys=())
            self.shadows[seq.request_id] = shadow
            self._synced[seq.request_id] = seq.num_tokens
            return shadow
        # The target only appends, so both lists agree up to the last sync; compare after it.
        common = self._synced[seq.request_id]
        mine, theirs = shadow.token_ids, seq.token_ids
        while common < min(len(mine), len(theirs)) and mine[common] == theirs[common]:
            common += 1
        shadow.token_ids = list(theirs)
        shadow.num_computed_tokens = min(shadow.num_computed_tokens, common)
        self.blocks.trim(shadow, shadow.num_computed_tokens)
        self._synced[seq.request_id] = seq.num_tokens
        return shadow

