"""What every proposer offers the engine, and the factory that builds one from the config."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from tandem.services.engine.sequence import Sequence

if TYPE_CHECKING:
    from tandem.services.engine.config import EngineConfig
    from tandem.services.engine.model import LlamaModel


@dataclass
class Proposal:
    token_ids: list[int]  # at most the k asked for; may be empty


class Proposer(Protocol):
    def propose(self, requests: list[tuple[Sequence, int]]) -> dict[str, Proposal]:
        """Draft up to k tokens after each sequence's last token; keyed by request id."""
        ...

    def forget(self, request_id: str) -> None:
        """The request finished or was aborted: drop whatever is kept for it."""
        ...

    def num_free_blocks(self) -> int | None:
        """Free blocks of the proposer's own KV cache (None: it has none); for leak checks."""
        ...


def build_proposer(config: EngineConfig, target: LlamaModel) -> Proposer | None:
    spec = config.speculative
    if spec.method == "none":
        return None
    if spec.method == "ngram":
        from tandem.services.engine.speculative.ngram import NgramProposer
        return NgramProposer(spec.ngram_min, spec.ngram_max)
    from tandem.services.engine.speculative.draft import DraftModelProposer
    if spec.method == "self":
        layers = spec.self_draft_layers or max(1, target.config.num_layers // 4)
        if layers >= target.config.num_layers:
            raise ValueError(f"self_draft_layers ({layers}) must be below the target's "
                             f"{target.config.num_layers} layers")
        return DraftModelProposer.from_model(target.first_layers(layers), config)
    if not spec.draft_model:
        raise ValueError("speculative method 'draft' needs draft_model (a .gguf file or a "
                         "Hugging Face directory sharing the target's tokenizer)")
    return DraftModelProposer.load(spec.draft_model, config, target)
