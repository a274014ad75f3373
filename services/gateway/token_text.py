"""A token's own text and bytes, for logprobs (a token may hold part of a UTF-8 character)."""

from __future__ import annotations

from functools import lru_cache

from tokenizers import decoders

from tandem.services.engine.tokenizer import Tokenizer


@lru_cache(maxsize=1)
def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte <-> printable character map, inverted: character -> byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    chars = list(printable)
    n = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


class TokenText:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._byte_level = isinstance(tokenizer.backend.decoder, decoders.ByteLevel)
        self._text = lru_cache(maxsize=65536)(self._text_uncached)
        self._bytes = lru_cache(maxsize=65536)(self._bytes_uncached)

    def text(self, token_id: int) -> str:
        return self._text(token_id)

    def bytes(self, token_id: int) -> list[int]:
        return self._bytes(token_id)

    def _text_uncached(self, token_id: int) -> str:
        return self._tokenizer.decode([token_id], skip_special_tokens=False)

    def _bytes_uncached(self, token_id: int) -> list[int]:
        piece = self._tokenizer.id_to_token(token_id)
        if self._byte_level and piece is not None:
            alphabet = _byte_level_alphabet()
            if all(c in alphabet for c in piece):
                return [alphabet[c] for c in piece]
        return list(self.text(token_id).encode("utf-8"))
