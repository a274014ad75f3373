"""Prompt text of an exact token length for a given tokenizer.

Text is a run of " word" pieces, each a single vocabulary token that the tokenizer reproduces on
its own, so that n pieces encode to n tokens; ``fit`` then closes any gap left by BOS tokens or
a chat template by resizing the variable part and re-encoding until the count is exact.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import numpy as np

from tandem.services.engine.tokenizer import Tokenizer

T = TypeVar("T")

_WORD = re.compile(r" [a-z]{3,10}")
_MIN_WORDS = 256
_FIT_ATTEMPTS = 8


class PromptError(ValueError):
    """A prompt of the requested length cannot be made with this tokenizer."""


@dataclass(frozen=True)
class ChatMessage:
    role: str  # system | user | assistant
    content: str

    def as_dict(self) -> dict[str, str]:
        return {"role": self.role, "content": self.content}


class PromptMaker:
    """Random text of exact token lengths, and the token counts a server will see."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.words = _single_token_words(tokenizer)
        if len(self.words) < _MIN_WORDS:
            raise PromptError(f"the tokenizer has only {len(self.words)} single-token words "
                              f"(need {_MIN_WORDS}); it is not a byte-level BPE vocabulary")

    def draw(self, rng: np.random.Generator, n: int) -> list[str]:
        """n random " word" pieces (each one token)."""
        return [self.words[i] for i in rng.integers(0, len(self.words), size=max(n, 0))]

    def count_text(self, text: str) -> int:
        """Prompt tokens of a completions request (BOS included where the model adds one)."""
        return len(self.tokenizer.encode(text))

    def count_chat(self, messages: Sequence[ChatMessage]) -> int:
        """Prompt tokens of a chat request, after the model's chat template."""
        return len(self.tokenizer.encode_chat([m.as_dict() for m in messages]))


def fit(make: Callable[[int], T], count: Callable[[T], int], target: int, what: str) -> T:
    """``make(n)`` for the n (n >= 0 words in its variable part) whose ``count`` is ``target``."""
    n = target
    for _ in range(_FIT_ATTEMPTS):
        candidate = make(n)
        got = count(candidate)
        if got == target:
            return candidate
        fixed = got - n  # tokens outside the variable part (BOS, template, shared prefix)
        n = target - fixed
        if n < 0:
            raise PromptError(f"{what}: cannot make a {target}-token prompt: its fixed part "
                              f"alone is {fixed} tokens")
    raise PromptError(f"{what}: no prompt of exactly {target} tokens after {_FIT_ATTEMPTS} tries")


def _single_token_words(tokenizer: Tokenizer) -> list[str]:
    backend = tokenizer.backend
    size = backend.get_vocab_size(with_added_tokens=False)
    texts = backend.decode_batch([[i] for i in range(size)], skip_special_tokens=True)
    candidates = [(i, t) for i, t in enumerate(texts) if _WORD.fullmatch(t)]
    encoded = backend.encode_batch([t for _, t in candidates], add_special_tokens=False)
    return sorted(t for (i, t), enc in zip(candidates, encoded, strict=True) if enc.ids == [i])
