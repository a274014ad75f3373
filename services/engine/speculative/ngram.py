"""Prompt-lookup proposer: no model, just the text so far.

If the last n tokens occurred earlier (in the prompt or the output), propose the tokens that
followed that occurrence. Longer matches are tried first; the most recent occurrence wins. It
pays off when the output copies from the context: edits, code continuation, quoting.
"""

from __future__ import annotations

from tandem.services.engine.sequence import Sequence
from tandem.services.engine.speculative.proposer import Proposal


class NgramProposer:
    def __init__(self, ngram_min: int, ngram_max: int) -> None:
        self.ngram_min = ngram_min
        self.ngram_max = ngram_max

    def propose(self, requests: list[tuple[Sequence, int]]) -> dict[str, Proposal]:
        proposals = {}
        for seq, k in requests:
            tokens = lookup(seq.token_ids, k, self.ngram_min, self.ngram_max)
            if tokens:
                proposals[seq.request_id] = Proposal(tokens)
        return proposals

    def forget(self, request_id: str) -> None:
        pass

    def num_free_blocks(self) -> int | None:
        return None


def lookup(tokens: list[int], k: int, ngram_min: int, ngram_max: int) -> list[int]:
    """Up to k tokens that followed the latest earlier occurrence of the longest matching
    suffix of ``tokens`` (n from ngram_max down to ngram_min); [] when nothing matches."""
    size = len(tokens)
    for n in range(min(ngram_max, size - 1), ngram_min - 1, -1):
        suffix = tokens[size - n:]
        last = suffix[-1]
        # Candidate ends, newest first; the suffix itself (ending at size - 1) is excluded.
        for end in range(size - 2, n - 2, -1):
            if tokens[end] == last and tokens[end - n + 1:end + 1] == suffix:
                return tokens[end + 1:end + 1 + k]
    return []
