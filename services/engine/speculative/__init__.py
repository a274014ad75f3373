"""Speculative decoding: proposers guess k tokens, the target verifies them in one pass.

``build_proposer`` (here: the proposer a config asks for), ``proposer`` (the interface),
``ngram`` (prompt lookup), ``draft`` (a small model or the target's first layers, with its own
paged KV cache), ``policy`` (how many tokens
to draft, adapting to load and acceptance). Drafts are verified in ``engine/sampler.py``:
accepted while they equal the target's own draws.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tandem.services.engine.speculative.draft import DraftModelProposer
from tandem.services.engine.speculative.ngram import NgramProposer
from tandem.services.engine.speculative.proposer import Proposer

if TYPE_CHECKING:
    from tandem.services.engine.config import EngineConfig
    from tandem.services.engine.model import LlamaModel


def build_proposer(config: EngineConfig, target: LlamaModel) -> Proposer | None:
    spec = config.speculative
    if spec.method == "none":
        return None
    if spec.method == "ngram":
        return NgramProposer(spec.ngram_min, spec.ngram_max)
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
