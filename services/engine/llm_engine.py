"""The engine: requests in, tokens out, one scheduler step at a time. No Ray, no HTTP."""

from __future__ import annotations

import dataclasses
import itertools
import logging
import random
import time
from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch

from tandem.services.engine import cpu_kernels
from tandem.services.engine.attention import get_attention_backend
from tandem.services.engine.block_manager import BlockManager
from tandem.services.engine.config import EngineConfig, ModelConfig
from tandem.services.engine.cuda_graphs import DecodeGraphs
from tandem.services.engine.device import check_device, wait_for_writes
from tandem.services.engine.faults import fault_hook_from_env
from tandem.services.engine.grammar import Grammars
from tandem.services.engine.host_kv_pool import HostKVPool, host_pool_blocks
from tandem.services.engine.kv_cache import KVCache, KVCacheSpec, allocate_kv_cache
from tandem.services.engine.kv_sizing import (
    CPU_KV_CACHE_GB,
    GIB,
    DeviceMemory,
    KVCacheTooSmall,
    blocks_in,
    context_length,
    gpu_kv_bytes,
    profile_forward,
)
from tandem.services.engine.logits_controls import Draw, controlled
from tandem.services.engine.model import LlamaModel, Shard
from tandem.services.engine.model_loader import LoadedModel, load_model
from tandem.services.engine.model_runner import ModelRunner
from tandem.services.engine.sampler import rows_logprobs, sample, token_logprobs, verify
from tandem.services.engine.scheduler import Scheduler
from tandem.services.engine.sequence import Sequence, SequenceStatus
from tandem.services.engine.speculative import build_proposer
from tandem.services.engine.speculative.policy import SpecPolicy
from tandem.services.engine.speculative.proposer import Proposer
from tandem.services.engine.tensor_parallel import FollowerSettings, TensorParallelGroup
from tandem.services.protocol.block_hash import HashSettings
from tandem.services.protocol.kv_events import KVEvent
from tandem.services.protocol.outputs import (
    EngineOverloadedError,
    EngineStats,
    FinishReason,
    PinnedKV,
    RequestError,
    RequestOutput,
)
from tandem.services.protocol.request import GenerationRequest, SamplingParams

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ImportSlot:
    """Blocks reserved for a prompt whose KV another worker computed.

    ``block_ids[:num_cached_blocks]`` already hold that KV (this engine's prefix cache); the
    caller fills the rest (``filled_block_ids``), block i with the sender's block i, then
    commits the import.
    """

    request_id: str
    block_ids: tuple[int, ...]
    num_cached_blocks: int

    @property
    def filled_block_ids(self) -> tuple[int, ...]:
        """The blocks the caller fills."""
        return self.block_ids[self.num_cached_blocks:]


@dataclass
class SpecStats:
    draft_tokens: int = 0
    accepted_tokens: int = 0
    steps: int = 0


def _moe_runs_eagerly(config: ModelConfig) -> bool:
    """Whether the model is a mixture of experts, whose decode steps run without CUDA graphs
    (a step reads its experts' group sizes on the host: engine/moe.py); says so in the log."""
    if config.is_moe:
        log.info("decode steps run eagerly: CUDA graphs do not capture a mixture-of-experts "
                 "model's expert routing")
    return config.is_moe


class LLMEngine:
    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None,
                 draft: LoadedModel | None = None) -> None:
        """``draft``: the speculative draft model, already loaded (else it is loaded from
        ``config.speculative.draft_model``)."""
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.config = config
        check_device(config.device)
        loaded = loaded or load_model(config.model, config.dtype,
                                       weight_format=config.weight_format)
        if config.weight_format == "int4" and not loaded.quantized:
            raise ValueError("weight_format int4 needs the model loaded with weight_format int4 "
                             "(a GGUF with Q4_1 weights)")
        self.model_config = loaded.config
        self.tokenizer = loaded.tokenizer
        tp = config.tensor_parallel_size
        shards = [Shard.of(loaded.config, rank, tp) for rank in range(tp)]
        local = shards[0].local_config(loaded.config)  # rank 0 has the most KV heads
        # This rank's cache (its KV heads), and the canonical layout (every KV head: what a
        # KV transfer moves and pairing describes); the same with one rank. Its block count
        # and the context it must hold: kv_sizing.py.
        shape = KVCacheSpec.for_model(local, config.block_size, config.dtype, 1, 0.0,
                                      config.kv_cache_dtype)
        hand_sized = config.num_kv_blocks is not None or config.kv_cache_memory_gb is not None
        profiled = torch.device(config.device).type == "cuda" and not hand_sized
        if profiled and tp > 1:
            raise ValueError(f"gpu_memory_utilization sizes the KV cache of one-rank engines; "
                             f"with tensor_parallel_size {tp} set kv_cache_memory_gb")
        num_blocks, sizing = (0, "") if profiled else _hand_sized_blocks(shape, config)
        model_len = loaded.config.max_position_embeddings
        positions = min(config.max_model_len or model_len, model_len)
        self.hash_settings = HashSettings(config.block_size, loaded.config.model_id,
                                          kv_cache_dtype=config.kv_cache_dtype)
        self.tp = None if tp == 1 else TensorParallelGroup(FollowerSettings(
            model=config.model, model_id=loaded.config.model_id, dtype=config.dtype,
            device=config.device,
            block_size=config.block_size, num_blocks=num_blocks,
            kv_cache_dtype=config.kv_cache_dtype, attention_backend=config.attention_backend,
            num_threads=config.num_threads, max_positions=positions, world_size=tp,
            store_port=0, timeout_s=config.tensor_parallel_timeout_s), shards)
        model = LlamaModel(loaded.config, loaded.weights,
                           get_attention_backend(config.attention_backend, config.device,
                                                 local.num_heads, local.num_kv_heads,
                                                 local.head_dim, shape.torch_dtype,
                                                 config.kernel_threads,
                                                 loaded.config.attention_features),
                           max_positions=positions, device=config.device,
                           shard=shards[0], all_reduce=self.tp and self.tp.all_reduce,
                           quantized=loaded.quantized if config.weight_format == "int4"
                           else None,
                           quantized_head=loaded.quantized_head
                           if config.weight_format == "int4" else (),
                           kernel_threads=config.kernel_threads)
        if profiled:
            num_blocks, sizing = _profiled_blocks(model, shape, config)
        self.local_kv_spec = dataclasses.replace(shape, num_blocks=num_blocks)
        self.kv_spec = dataclasses.replace(self.local_kv_spec,
                                           num_kv_heads=loaded.config.num_kv_heads)
        capacity = num_blocks * config.block_size
        self.max_model_len = context_length(config.max_model_len, model_len, capacity,
                                            hand_sized, sizing)
        log.info("KV cache: %d blocks of %d tokens = %d tokens in %.2f GiB (%s): %d "
                 "sequence(s) of max_model_len %d", num_blocks, config.block_size, capacity,
                 num_blocks * self.local_kv_spec.bytes_per_block / GIB, sizing,
                 capacity // self.max_model_len, self.max_model_len)
        self.kv_cache: KVCache = allocate_kv_cache(self.local_kv_spec, config.device)
        self.host_pool = (
            HostKVPool(self.kv_cache, host_pool_blocks(config.host_kv_cache_gb,
                                                       self.kv_spec.bytes_per_block))
            if config.host_kv_cache_gb > 0 and config.enable_prefix_caching else None
        )
        self.block_manager = BlockManager(self.kv_spec.num_blocks, config.block_size,
                                          config.enable_prefix_caching, self.host_pool)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs,
                                   config.max_num_batched_tokens)
        self.runner = ModelRunner(model, self.kv_cache, config.block_size, config.device,
                                  self.tp, config.prefill_threads)
        features = loaded.config.attention_features
        why_not = (cpu_kernels.unavailable_reason()
                   if config.attention_backend == "auto" and model.attention.name == "torch"
                   and self.local_kv_spec.torch_dtype == torch.bfloat16 and not features
                   else None)
        self.attention_backend = model.attention.name  # what runs (tandem_attention_backend)
        if why_not:  # bfloat16 on a CPU whose kernels did not build or load: the slow path
            log.warning("attention backend torch, not our CPU kernels: %s (bfloat16 runs "
                        "several times slower this way)", why_not)
        else:
            log.info("attention backend %s (asked: %s%s)", model.attention.name,
                     config.attention_backend,
                     f"; the model's layers use {', '.join(sorted(features))}"
                     if features else "")
        if (config.cuda_graphs and torch.device(config.device).type == "cuda"
                and model.attention.name == "triton" and self.tp is None
                and not _moe_runs_eagerly(loaded.config)):
            began = time.monotonic()
            graphs = DecodeGraphs(model, self.kv_cache, config.block_size, config.max_num_seqs,
                                  self.max_model_len, config.device)
            graphs.capture_all()
            # Every block is free yet: the check's steps write the first ones.
            problem = graphs.self_check(list(range(-(-3 // config.block_size))))
            if problem is None:
                self.runner.graphs = graphs
                log.info("captured decode CUDA graphs for batch sizes %s in %.1f s",
                         sorted(graphs.graphs), time.monotonic() - began)
            else:
                log.error("decode steps run eagerly: %s", problem)
        # Seeds for sampled requests that come without one (the gateway sends one always).
        self._seeds = random.Random(config.seed)
        spec = config.speculative
        if draft is not None and spec.method == "draft":
            from tandem.services.engine.speculative.draft import DraftModelProposer
            self.proposer: Proposer | None = DraftModelProposer.load(draft, config, model)
        else:
            self.proposer = build_proposer(config, model)
        self.grammars = Grammars(loaded.tokenizer, loaded.config.vocab_size,
                                 list(loaded.config.eos_token_ids))
        self.spec_policy = SpecPolicy(spec)
        self.spec_stats = SpecStats()
        self.num_preemptions = 0
        self._generate_ids = itertools.count()
        self._stepping: list[str] = []  # the requests of the step in progress
        self.fault_hook = fault_hook_from_env()  # test-only; see services/engine/faults.py

    # -- requests -------------------------------------------------------------------------

    def add_request(self, request: GenerationRequest, prefill_only: bool = False) -> None:
        """Queue a request. ``prefill_only`` (the prefill role) stops it after the first token
        and pins the prompt's blocks: that output carries a ``PinnedKV``; see ``release_kv``.
        ``request.output_token_ids``: tokens it already generated elsewhere (a resumed request:
        they are recomputed, or found in the prefix cache, and it goes on from the next one,
        with ``max_tokens`` counting them)."""
        seq = self._new_sequence(request, request.output_token_ids)
        seq.prefill_only = prefill_only
        self.scheduler.add(seq)

    def abort_request(self, request_id: str) -> bool:
        """Forget a request wherever it is: queued, running, importing KV or pinned."""
        seq = self.scheduler.get(request_id)
        if seq is None:
            return False
        seq.finish_reason = FinishReason.ABORT
        self._finish(seq)
        return True

    def has_unfinished_requests(self) -> bool:
        """Whether ``step`` has work: requests importing KV or pinned wait on a caller."""
        return self.scheduler.has_work()

    @property
    def requests(self) -> dict[str, Sequence]:
        """Every request this engine holds, by id, in any status (the scheduler's; read only)."""
        return self.scheduler.requests

    def take_events(self) -> list[KVEvent]:
        """The KV events (blocks cached, evicted) since the last call, in emission order.

        The block manager only queues them; whoever runs the engine drains them between steps
        (``AsyncEngine`` does, after each step) and publishes them off the engine's path.
        """
        return self.block_manager.take_events()

    # -- disaggregation: prefill side -----------------------------------------------------

    def release_kv(self, request_id: str) -> bool:
        """Free a pinned prefill's blocks (its full blocks stay in the prefix cache)."""
        seq = self.scheduler.get(request_id)
        if seq is None or seq.status is not SequenceStatus.PINNED:
            return False
        self.scheduler.finish(seq)
        return True

    # -- disaggregation: decode side ------------------------------------------------------

    def begin_import(self, request: GenerationRequest, first_token: int) -> ImportSlot:
        """Reserve blocks for a prompt prefilled elsewhere, whose first token is known.

        Leading blocks this engine already caches are reused; the caller transfers the rest,
        then calls ``commit_import`` (or ``recompute_import``, or ``abort_request``). Raises
        ``EngineOverloadedError`` when the blocks are not free now (then ``add_request`` with
        ``output_token_ids=(first_token,)`` queues it to be prefilled here).
        """
        request_id = request.request_id
        seq = self._new_sequence(request, (first_token,))
        seq.prompt_logprobs_sent = True  # the prefill worker computed and sent them
        num_cached_blocks = self.scheduler.begin_import(seq)
        if num_cached_blocks is None:
            bm = self.block_manager
            num_needed = bm.blocks_needed(seq.num_prompt_tokens) - len(bm.find_cached_prefix(seq))
            raise EngineOverloadedError(
                f"no room to import {num_needed} KV blocks ({bm.num_free_blocks} free)")
        return ImportSlot(request_id, tuple(seq.block_ids), num_cached_blocks)

    def commit_import(self, request_id: str) -> None:
        """The import's blocks hold the prompt's KV: cache the full ones, schedule decoding."""
        self.scheduler.commit_import(self._importing(request_id))

    def recompute_import(self, request_id: str) -> None:
        """Give up on the transfer: drop its blocks and prefill the prompt here instead."""
        self.scheduler.recompute_import(self._importing(request_id))

    def close(self) -> None:
        """Stop the other ranks of a tensor-parallel engine (nothing to do with one rank)."""
        if self.tp is not None:
            self.tp.close()

    # -- internals: requests --------------------------------------------------------------

    def _new_sequence(self, request: GenerationRequest, output_token_ids: Seq[int]
                      ) -> Sequence:
        request_id, params = request.request_id, request.params
        if not params.greedy and params.seed is None:
            params = dataclasses.replace(params, seed=self._seeds.getrandbits(63))
        if self.scheduler.get(request_id) is not None:
            raise RequestError(f"request id {request_id!r} is already in use")
        prompt = list(request.prompt_token_ids)
        if not prompt:
            raise RequestError("prompt is empty: send at least one token")
        if len(prompt) >= self.max_model_len:
            raise RequestError(
                f"prompt has {len(prompt)} tokens, but the context length is "
                f"{self.max_model_len} (prompt + at least 1 generated token)"
            )
        outputs = list(output_token_ids)
        if outputs and (len(outputs) >= params.max_tokens
                        or len(prompt) + len(outputs) >= self.max_model_len):
            raise RequestError(f"a resumed request has {len(outputs)} tokens already: "
                               "nothing is left of max_tokens or the context")
        vocab = self.model_config.vocab_size
        bad = next((t for t in prompt + outputs if not 0 <= t < vocab), None)
        if bad is not None:
            raise RequestError(f"token id {bad} is outside the vocabulary [0, {vocab})")
        if len(self.scheduler.waiting) >= self.config.max_waiting:
            raise EngineOverloadedError(
                f"{len(self.scheduler.waiting)} requests are already waiting; retry later"
            )
        seq = Sequence(request_id, prompt + outputs, len(prompt), params,
                       self.hash_settings.extra_keys(request.cache_salt), request.tenant)
        if params.structured_output is not None:
            seq.matcher = self.grammars.matcher(params.structured_output, outputs)
            if seq.matcher.is_error():
                raise RequestError(f"structured_output: {seq.matcher.get_error()}")
        return seq

    def _importing(self, request_id: str) -> Sequence:
        seq = self.scheduler.get(request_id)
        if seq is None or seq.status is not SequenceStatus.WAITING_FOR_REMOTE_KV:
            raise RequestError(f"no KV import is in progress for request {request_id!r}")
        return seq

    # -- stepping -------------------------------------------------------------------------

    def fail_step(self, only: str | None = None) -> list[str]:
        """After ``step`` raised: abort the requests of that step (freeing their blocks) and
        return their ids. If it failed before scheduling anything, every running and waiting
        request is failed, so a fault that repeats cannot hold them forever. ``only``: the one
        request a ``SequenceFault`` named (the step's others are left to run again)."""
        ids = [only] if only is not None else self._stepping or [
            s.request_id for s in (*self.scheduler.running, *self.scheduler.waiting)]
        self._stepping = []
        failed = [i for i in ids if self.abort_request(i)]
        return failed

    def step(self) -> list[RequestOutput]:
        self._stepping = []
        if self.proposer is not None:
            self._propose()
        plan = self.scheduler.schedule()
        self.num_preemptions += len(plan.preempted)
        if not plan.scheduled:
            return []
        self._stepping = [item.seq.request_id for item in plan.scheduled]
        if self.fault_hook is not None:
            self.fault_hook(item.seq for item in plan.scheduled)
        result = self.runner.execute(plan.scheduled)
        for seq, row, _, count in result.prompt_rows:
            start = len(seq.prompt_logprobs)
            seq.prompt_logprobs += rows_logprobs(
                result.logits[row:row + count], seq.token_ids[start + 1:start + 1 + count],
                seq.sampling.prompt_logprobs or 0)
        reached_end = set(map(id, result.sampled))
        for item in plan.scheduled:
            if id(item.seq) not in reached_end:  # a prefill chunk short of the prompt's end
                self.scheduler.computed(item.seq,
                                        item.seq.num_computed_tokens + item.num_new_tokens)
        if not result.sampled:
            return []
        plain = [i for i, seq in enumerate(result.sampled) if not seq.spec_token_ids]
        plain_seqs = [result.sampled[i] for i in plain]
        plain_rows = [result.first_rows[i] for i in plain]
        plain_logits = (result.logits if plain_rows == list(range(len(result.logits)))
                        else result.logits[plain_rows])  # no copy when every row is one
        plain_tokens = sample(
            self._controlled(plain_logits, plain_seqs),
            [seq.sampling for seq in plain_seqs], [seq.num_output_tokens for seq in plain_seqs])
        emitted: dict[int, list[int]] = dict(zip(plain, ([t] for t in plain_tokens),
                                                 strict=True))
        outputs = []
        for i, (seq, row) in enumerate(zip(result.sampled, result.first_rows, strict=True)):
            logits = result.logits[row:row + 1 + len(seq.spec_token_ids)]
            tokens = emitted[i] if i in emitted else self._verify(seq, logits)
            outputs.append(self._append_tokens(seq, tokens, logits))
        if self.tp is not None:  # after the tokens' host sync: a collective NCCL timed out
            self.tp.check()  # gave partial sums, and this step's tokens must not go out
        return outputs

    def _verify(self, seq: Sequence, logits: torch.Tensor) -> list[int]:
        drafts = seq.spec_token_ids
        tokens = verify(self._controlled(logits, [seq] * len(logits), drafts), seq.sampling,
                        seq.num_output_tokens, drafts)
        accepted = len(tokens) - 1
        self.spec_stats.draft_tokens += len(drafts)
        self.spec_stats.accepted_tokens += accepted
        self.spec_stats.steps += 1
        self.spec_policy.observe(seq.request_id, len(drafts), accepted)
        return tokens

    def _controlled(self, logits: torch.Tensor, seqs: Seq[Sequence], drafts: Seq[int] = ()
                    ) -> torch.Tensor:
        """``logits`` with each row's logits controls applied: row i draws for ``seqs[i]``,
        after its output so far and the first i of ``drafts`` (a verified sequence's rows)."""
        if not any(seq.sampling.adjusts_logits for seq in seqs):
            return logits
        allowed = (self._grammar_masks(seqs[0], drafts) if drafts
                   else [seq.matcher and seq.matcher.compute_bitmask() for seq in seqs])
        draws = [Draw(seq.sampling, seq.token_ids[:seq.num_prompt_tokens],
                      [*seq.output_token_ids, *drafts[:i]], allowed[i])
                 for i, seq in enumerate(seqs)]
        return controlled(logits, draws, self.model_config.eos_token_ids)

    @staticmethod
    def _grammar_masks(seq: Sequence, drafts: Seq[int]) -> list[bytes | None]:
        """The grammar's masks at a verified sequence's rows: row i after the first i drafts.
        Rows past a draft the grammar refuses get none: verification stops at that draft (the
        target's masked draw there differs from it), so they emit nothing."""
        masks: list[bytes | None] = [None] * (len(drafts) + 1)
        if seq.matcher is None:
            return masks
        masks[0] = seq.matcher.compute_bitmask()
        consumed = 0
        for draft in drafts:
            if seq.matcher.try_consume_tokens([draft]) != 1:
                break
            consumed += 1
            masks[consumed] = seq.matcher.compute_bitmask()
        if consumed:
            seq.matcher.rollback(consumed)
        return masks

    def _append_tokens(self, seq: Sequence, tokens: list[int], logits: torch.Tensor
                       ) -> RequestOutput:
        """Emit a step's tokens for ``seq`` (more than one when drafts were accepted), up to a
        stop. Every real input token now has its KV, and so does each accepted draft."""
        num_real = seq.num_tokens
        num_accepted = len(tokens) - 1
        emitted: list[int] = []
        new_logprobs = []
        for row, token in enumerate(tokens):
            if seq.sampling.logprobs is not None:
                new_logprobs.append(token_logprobs(logits[row], token, seq.sampling.logprobs))
            seq.token_ids.append(token)
            emitted.append(token)
            if seq.matcher is not None and not seq.matcher.consume_token(token):
                log.error("request %s: its grammar refused token %d: %s", seq.request_id,
                          token, seq.matcher.get_error())
            self._check_stop(seq, token)
            if seq.finish_reason is not None:
                break
        seq.logprobs.extend(new_logprobs)
        seq.spec_token_ids = []
        self.scheduler.computed(seq, num_real + min(len(emitted), num_accepted))
        kv = None
        if seq.finish_reason is not None:
            self._finish(seq)
        elif seq.prefill_only:  # done here: pinned
            kv = self._pin(seq)
        prompt_logprobs = None
        if seq.sampling.prompt_logprobs is not None and not seq.prompt_logprobs_sent:
            prompt_logprobs, seq.prompt_logprobs_sent = seq.prompt_logprobs, True
        return RequestOutput(
            request_id=seq.request_id, new_token_ids=emitted, new_logprobs=new_logprobs,
            finished=seq.finish_reason is not None or seq.prefill_only,  # pinned: done too
            finish_reason=seq.finish_reason,
            num_prompt_tokens=seq.num_prompt_tokens, num_output_tokens=seq.num_output_tokens,
            num_cached_tokens=seq.num_cached_tokens, kv=kv, prompt_logprobs=prompt_logprobs,
        )

    # -- speculative decoding -------------------------------------------------------------

    def _propose(self) -> None:
        """Draft tokens for the running sequences that are generating."""
        running = self.scheduler.running
        candidates = [s for s in running if not s.prefill_only
                      and s.num_computed_tokens == s.num_tokens - 1]
        for seq in candidates:  # drafts left from a step that did not schedule the sequence
            seq.spec_token_ids = []
        lengths = self.spec_policy.draft_lengths(candidates, len(running))
        requests = []
        for seq in candidates:
            # Every draft may be accepted and a bonus token follows: stay within max_tokens
            # and the context (the last draft is an input at position num_tokens - 1 + k).
            room = min(seq.sampling.max_tokens - seq.num_output_tokens - 1,
                       self.max_model_len - seq.num_tokens)
            k = min(lengths.get(seq.request_id, 0), room)
            if k > 0:
                requests.append((seq, k))
        if not requests:
            return
        assert self.proposer is not None
        proposals = self.proposer.propose(requests)
        for seq, _ in requests:
            proposal = proposals.get(seq.request_id)
            if proposal is not None:
                seq.spec_token_ids = proposal.token_ids

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]
                 ) -> list[list[int]]:
        """Run prompts to completion (offline use and tests); returns generated token ids.
        Drops the queued KV events as it goes: offline use has nobody to take them."""
        per_prompt = params if isinstance(params, list) else [params] * len(prompts)
        ids = [f"generate-{next(self._generate_ids)}" for _ in prompts]
        results: dict[str, list[int]] = {i: [] for i in ids}
        for request_id, prompt, p in zip(ids, prompts, per_prompt, strict=True):
            self.add_request(GenerationRequest(request_id, prompt, p))
        while any(r in self.requests for r in ids):
            for out in self.step():
                if out.request_id in results:
                    results[out.request_id].extend(out.new_token_ids)
            self.take_events()
        return [results[i] for i in ids]

    @property
    def stats(self) -> EngineStats:
        bm = self.block_manager
        return EngineStats(
            num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
            num_free_blocks=bm.num_free_blocks, num_blocks=bm.num_blocks,
            kv_cache_usage=bm.usage, prefix_cache_queries=bm.stats.queries,
            prefix_cache_hits=bm.stats.hits, num_preemptions=self.num_preemptions,
            num_pinned=self.scheduler.num_with_status(SequenceStatus.PINNED),
            num_importing=self.scheduler.num_with_status(SequenceStatus.WAITING_FOR_REMOTE_KV),
            spec_draft_tokens=self.spec_stats.draft_tokens,
            spec_accepted_tokens=self.spec_stats.accepted_tokens,
            spec_steps=self.spec_stats.steps,
            pending_prefill_blocks=self._pending_prefill_blocks(),
            block_size=self.config.block_size,
            **self._host_kv_stats(),
        )

    def _host_kv_stats(self) -> dict[str, int]:
        pool = self.host_pool
        if pool is None:
            return {}
        return {"host_kv_restored_blocks": pool.restored,
                "host_kv_offloaded_blocks": pool.offloaded, "host_kv_blocks": len(pool),
                "host_kv_capacity_blocks": pool.capacity}

    def _pending_prefill_blocks(self) -> int:
        """Prompt blocks queued or running but not computed yet (the router's prefill load)."""
        size = self.config.block_size
        return sum(-(-(s.num_prompt_tokens - s.num_computed_tokens) // size)
                   for s in (*self.scheduler.waiting, *self.scheduler.running)
                   if s.num_computed_tokens < s.num_prompt_tokens)

    # -- internals ------------------------------------------------------------------------

    def _check_stop(self, seq: Sequence, token: int) -> None:
        p = seq.sampling
        is_eos = token in self.model_config.eos_token_ids and not p.ignore_eos
        # A grammar that is complete (or broken) allows nothing more: the output ends.
        done = seq.matcher is not None and (seq.matcher.is_stopped() or seq.matcher.is_error())
        if is_eos or token in p.stop_token_ids or done:
            seq.finish_reason = FinishReason.STOP
        elif seq.num_output_tokens >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            seq.finish_reason = FinishReason.LENGTH

    def _finish(self, seq: Sequence) -> None:
        self.scheduler.finish(seq)
        self._forget(seq)

    def _forget(self, seq: Sequence) -> None:
        """Drop per-request state kept outside the sequence (speculation)."""
        seq.spec_token_ids = []
        if self.proposer is not None:
            self.spec_policy.forget(seq.request_id)
            self.proposer.forget(seq.request_id)

    def _pin(self, seq: Sequence) -> PinnedKV:
        """Pin a prefill-only request's prompt blocks for a KV transfer."""
        self._forget(seq)
        self.scheduler.pin(seq)
        wait_for_writes(self.config.device)  # its blocks are read from outside our stream
        return PinnedKV(seq.request_id, tuple(seq.block_ids), seq.num_computed_tokens)


def _hand_sized_blocks(shape: KVCacheSpec, config: EngineConfig) -> tuple[int, str]:
    """The cache's blocks when no profiling decides them, and how they were chosen."""
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks, "num_kv_blocks"
    if config.kv_cache_memory_gb is not None:
        return (blocks_in(config.kv_cache_memory_gb, shape.bytes_per_block),
                f"kv_cache_memory_gb {config.kv_cache_memory_gb:g}")
    return blocks_in(CPU_KV_CACHE_GB, shape.bytes_per_block), "the CPU default"


def _profiled_blocks(model: LlamaModel, shape: KVCacheSpec, config: EngineConfig
                     ) -> tuple[int, str]:
    """vLLM's sizing on a GPU: a profiling forward at the largest step, then
    ``gpu_memory_utilization`` of the device less what that left in use."""
    block_size = config.block_size
    tokens = config.max_num_batched_tokens
    spec = dataclasses.replace(shape, num_blocks=-(-tokens // block_size))
    cache = allocate_kv_cache(spec, config.device)
    rows = config.max_num_seqs * (1 + (config.speculative.k if config.speculative.enabled
                                       else 0))
    profile_forward(model, cache, block_size, tokens, rows, config.device)
    memory = DeviceMemory.measure(config.device, spec.num_blocks * spec.bytes_per_block)
    del cache
    torch.cuda.empty_cache()
    budget = gpu_kv_bytes(memory, config.gpu_memory_utilization)
    sizing = (f"gpu_memory_utilization {config.gpu_memory_utilization:g} of "
              f"{memory.total / GIB:.1f} GiB, after a {tokens}-token profiling step peaking at "
              f"{memory.torch_peak / GIB:.2f} GiB")
    if budget < shape.bytes_per_block:
        raise KVCacheTooSmall(f"no room for a KV cache: {sizing} leaves "
                              f"{budget / GIB:.2f} GiB; raise gpu_memory_utilization or "
                              f"lower max_num_batched_tokens")
    return budget // shape.bytes_per_block, sizing
