"""Tokenizer and chat template from a GGUF file's vocabulary or a HF directory's tokenizer.json."""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from tandem.services.engine.chat_template import ChatTemplates

# tokenizer.ggml.token_type values (llama.cpp's, from SentencePiece's piece types).
_GGUF_NORMAL, _GGUF_UNKNOWN, _GGUF_CONTROL, _GGUF_USER_DEFINED = 1, 2, 3, 4
_GGUF_SPECIAL_TYPES = (_GGUF_UNKNOWN, _GGUF_CONTROL)  # matched in text, skipped when decoding

# How a byte-level BPE vocabulary (tokenizer.ggml.model "gpt2") cuts text before its merges, by
# tokenizer.ggml.pre: regexes applied in turn, every piece kept, as llama.cpp's llama-vocab.cpp
# does; the expressions are the models' own (their tokenizer.json or tiktoken pattern). Any other
# value is refused rather than guessed: a wrong split gives valid-looking but different ids.
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SINGLE_DIGITS = r"\p{N}"
BYTE_LEVEL_SPLITS: dict[str, tuple[str, ...]] = {
    # Files from before llama.cpp wrote the field. llama.cpp falls back to a split of its own
    # for them (punctuation and digit runs cut apart); like transformers, we take GPT-2's.
    "default": (_GPT2_SPLIT,),
    "gpt-2": (_GPT2_SPLIT,),
    "llama-bpe": (_LLAMA3_SPLIT,),  # Llama 3
    "llama3": (_LLAMA3_SPLIT,),
    "llama-v3": (_LLAMA3_SPLIT,),
    "qwen2": (_QWEN2_SPLIT,),
    "deepseek-r1-qwen": (_QWEN2_SPLIT,),
    "tekken": (_TEKKEN_SPLIT,),  # Mistral NeMo and later
    # These split every digit on its own first.
    "smollm": (_SINGLE_DIGITS, _GPT2_SPLIT),
    "starcoder": (_SINGLE_DIGITS, _GPT2_SPLIT),
    "refact": (_SINGLE_DIGITS, _GPT2_SPLIT),
}
# A piece that is a whole token is that token, merges or not (Llama 3's tokenizer.json
# "ignore_merges", and llama.cpp for these).
_IGNORE_MERGES = frozenset({"llama-bpe", "llama3", "llama-v3"})


# What apply_chat_template gives the template itself.
TEMPLATE_VARIABLES = ("messages", "add_generation_prompt", "bos_token", "eos_token", "tools")


class Tokenizer:
    def __init__(
        self,
        backend: HFTokenizer,
        eos_token_ids: Sequence[int],
        bos_token_id: int | None = None,
        add_bos: bool = False,
        chat_template: str | list[dict[str, str]] | None = None,
    ) -> None:
        """``chat_template``: one template, or named ones (``chat_template.ChatTemplates``)."""
        self.backend = backend
        self.eos_token_ids = tuple(eos_token_ids)
        self.bos_token_id = bos_token_id
        self.add_bos = add_bos and bos_token_id is not None
        self.chat_template = chat_template
        self._templates = ChatTemplates.of(chat_template or None)
        # Whether the chat template shows a ``tools`` list itself.
        self.template_renders_tools = self._templates is not None and self._templates.renders_tools

    @property
    def chat_template_sources(self) -> list[str]:
        """The chat templates' texts (none without a template)."""
        return [] if self._templates is None else list(self._templates.sources.values())

    def with_chat_template(self, chat_template: str) -> Tokenizer:
        """This tokenizer with another chat template (``--chat-template``)."""
        return Tokenizer(self.backend, self.eos_token_ids, self.bos_token_id, self.add_bos,
                         chat_template)

    @functools.cached_property
    def max_token_chars(self) -> int:
        """The most characters one token stands for (its vocabulary string: a byte-level BPE
        token's is one character per byte, a SentencePiece one's its text): a text of more than
        ``n * max_token_chars`` characters is more than ``n`` tokens."""
        return max((len(token) for token in self.backend.get_vocab(with_added_tokens=True)),
                   default=1)

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # encode_batch, not encode: the same ids as fast, but it lets go of the GIL while it
        # works (encode holds it: ~0.6 ms for a 544-token prompt, during which an engine thread
        # in the same process could not get back from a kernel call).
        ids = self.backend.encode_batch([text], add_special_tokens=False)[0].ids
        if add_special_tokens and self.add_bos:
            ids = [self.bos_token_id, *ids]  # type: ignore[list-item]
        return ids

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    def apply_chat_template(
        self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True,
        tools: Sequence[dict[str, Any]] | None = None,
        extra: Mapping[str, Any] | None = None,
    ) -> str:
        """``extra``: more variables for the template (a request's ``chat_template_kwargs``);
        they cannot replace the ones set here (``TEMPLATE_VARIABLES``)."""
        if self._templates is None:
            raise ValueError("this model has no chat template; send a plain prompt instead")
        bos = self.id_to_token(self.bos_token_id) if self.bos_token_id is not None else ""
        eos = self.id_to_token(self.eos_token_ids[0]) if self.eos_token_ids else ""
        clash = sorted(set(extra or ()) & set(TEMPLATE_VARIABLES))
        if clash:
            raise ValueError(f"chat template variable {clash[0]!r} is set by the server")
        template = self._templates.picked[bool(tools)]
        if isinstance(template, str):
            raise ValueError(template)
        return template.render(
            **(extra or {}),
            messages=list(messages),
            add_generation_prompt=add_generation_prompt,
            bos_token=bos or "",
            eos_token=eos or "",
            tools=list(tools) if tools else None,
        )

    def encode_chat(self, messages: Sequence[dict[str, Any]],
                    tools: Sequence[dict[str, Any]] | None = None,
                    extra: Mapping[str, Any] | None = None,
                    add_special_tokens: bool = False) -> list[int]:
        """The chat's tokens. Special tokens come only from the template: a special token's
        text inside a message's content is plain text (a user cannot forge a turn), tokenized
        as it would be were it not special. (The template writes BOS where the model wants one;
        ``add_special_tokens`` puts the tokenizer's BOS before it too, as vLLM's flag does.)"""
        specials = self._special_texts
        if specials and any(_has_special(m.get("content"), specials) for m in messages):
            marked = [{**m, "content": _mark_specials(m.get("content"), specials)}
                      for m in messages]
            ids = self._encode_marked(self.apply_chat_template(marked, tools=tools, extra=extra))
        else:
            ids = self.encode(self.apply_chat_template(messages, tools=tools, extra=extra),
                              add_special_tokens=False)
        if add_special_tokens and self.add_bos:
            ids = [self.bos_token_id, *ids]  # type: ignore[list-item]
        return ids

    @functools.cached_property
    def _special_texts(self) -> tuple[str, ...]:
        """The special tokens' texts, longest first (the order the tokenizer matches them)."""
        texts = {t.content for t in self.backend.get_added_tokens_decoder().values()
                 if t.special}
        return tuple(sorted(texts, key=len, reverse=True))

    @functools.cached_property
    def _plain(self) -> HFTokenizer:
        """This tokenizer with special tokens' texts split as any text (its own copy: the
        setting is the object's, and the gateway tokenizes on two threads)."""
        plain = HFTokenizer.from_str(self.backend.to_str())
        plain.encode_special_tokens = True
        return plain

    def _encode_marked(self, text: str) -> list[int]:
        """``text`` rendered from content whose special texts were marked: the template's own
        special texts become their tokens; each stretch between them, with the marked ones put
        back as text, is tokenized as a stretch between special tokens always is."""
        specials = self._special_texts
        template_special = re.compile("|".join(map(re.escape, specials)))
        ids: list[int] = []
        stretch_start = 0
        for match in template_special.finditer(text):
            ids += self._encode_plain(_unmark(text[stretch_start:match.start()], specials))
            ids.append(self.backend.token_to_id(match.group()))
            stretch_start = match.end()
        return ids + self._encode_plain(_unmark(text[stretch_start:], specials))

    def _encode_plain(self, text: str) -> list[int]:
        return self._plain.encode_batch([text], add_special_tokens=False)[0].ids if text else []

    @classmethod
    def from_gguf_fields(cls, fields: Mapping[str, Any]) -> Tokenizer:
        """From a GGUF file's metadata (its ``tokenizer.*`` keys), built as the vocabulary's
        ``tokenizer.ggml.model`` declares. ValueError names a model or ``pre`` it cannot build."""
        model = fields.get("tokenizer.ggml.model")
        tokens: list[str] = fields["tokenizer.ggml.tokens"]
        token_types: list[int] = fields.get("tokenizer.ggml.token_type") or []
        if model == "llama":
            scores: list[float] = fields.get("tokenizer.ggml.scores") or []
            if len(scores) != len(tokens):
                raise ValueError("a 'llama' vocabulary needs tokenizer.ggml.scores for every token")
            backend = _spm_backend(
                tokens, scores, token_types,
                add_space_prefix=bool(fields.get("tokenizer.ggml.add_space_prefix", True)),
            )
            add_bos_default = True  # llama.cpp's default for a SentencePiece vocabulary
        elif model == "gpt2":
            backend = _byte_level_backend(
                tokens, fields.get("tokenizer.ggml.merges") or [],
                str(fields.get("tokenizer.ggml.pre", "default")),
            )
            add_bos_default = False
        else:
            raise ValueError(
                f"unsupported tokenizer.ggml.model {model!r}; supported: 'gpt2', 'llama'"
            )
        specials = [i for i, kind in enumerate(token_types) if kind in _GGUF_SPECIAL_TYPES]
        backend.add_special_tokens(
            [AddedToken(tokens[i], special=True, normalized=False) for i in specials]
        )
        # Matched whole in text, as llama.cpp does, but kept when decoding (e.g. <think>).
        backend.add_tokens([
            AddedToken(tokens[i], special=False, normalized=False)
            for i, kind in enumerate(token_types) if kind == _GGUF_USER_DEFINED
        ])
        eos = fields.get("tokenizer.ggml.eos_token_id")
        bos = fields.get("tokenizer.ggml.bos_token_id")
        return cls(
            backend,
            eos_token_ids=(int(eos),) if eos is not None else (),
            bos_token_id=int(bos) if bos is not None else None,
            add_bos=bool(fields.get("tokenizer.ggml.add_bos_token", add_bos_default)),
            chat_template=fields.get("tokenizer.chat_template"),
        )

    @classmethod
    def from_hf_dir(
        cls, path: Path, eos_token_ids: Sequence[int], bos_token_id: int | None
    ) -> Tokenizer:
        tokenizer_file = path / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise FileNotFoundError(f"{path}: no tokenizer.json")
        backend = HFTokenizer.from_file(str(tokenizer_file))
        config_file = path / "tokenizer_config.json"
        config = json.loads(config_file.read_text()) if config_file.is_file() else {}
        template = config.get("chat_template")
        template_file = path / "chat_template.jinja"
        if template is None and template_file.is_file():
            template = template_file.read_text()
        add_bos = bool(config.get("add_bos_token", False))
        return cls(backend, eos_token_ids, bos_token_id, add_bos, template)


# Marks a special token's text in message content while the template renders it (private-use
# code points: kept as they are by the template, and never a special token's text).
_MARK = "\ue000tandem-special-{}\ue001"
_MARKED = re.compile("\ue000tandem-special-([0-9]+)\ue001")


def _has_special(content: Any, specials: Sequence[str]) -> bool:
    if isinstance(content, str):
        return any(text in content for text in specials)
    if isinstance(content, list):
        return any(_has_special(part.get("text") if isinstance(part, dict) else None, specials)
                   for part in content)
    return False


def _mark_specials(content: Any, specials: Sequence[str]) -> Any:
    if isinstance(content, str):
        pattern = "|".join(map(re.escape, specials))
        return re.sub(pattern, lambda m: _MARK.format(specials.index(m.group())), content)
    if isinstance(content, list):
        return [{**part, "text": _mark_specials(part["text"], specials)}
                if isinstance(part, dict) and isinstance(part.get("text"), str) else part
                for part in content]
    return content


def _unmark(text: str, specials: Sequence[str]) -> str:
    return _MARKED.sub(lambda m: specials[int(m.group(1))], text)


def _byte_level_backend(tokens: list[str], merges: list[str], pre: str) -> HFTokenizer:
    """Byte-level BPE (tokenizer.ggml.model "gpt2"): tokens spelled in GPT-2's byte alphabet."""
    splits = BYTE_LEVEL_SPLITS.get(pre)
    if splits is None:
        raise ValueError(
            f"unsupported tokenizer.ggml.pre {pre!r} for tokenizer.ggml.model 'gpt2'; "
            f"supported: {', '.join(sorted(BYTE_LEVEL_SPLITS))}"
        )
    vocab = {token: i for i, token in enumerate(tokens)}
    merge_pairs = [tuple(m.split(" ", 1)) for m in merges]
    backend = HFTokenizer(models.BPE(
        vocab=vocab, merges=merge_pairs, fuse_unk=False, ignore_merges=pre in _IGNORE_MERGES
    ))
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        *(pre_tokenizers.Split(Regex(split), behavior="isolated") for split in splits),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    backend.decoder = decoders.ByteLevel()
    return backend


def _spm_backend(
    tokens: list[str], scores: list[float], token_types: list[int], add_space_prefix: bool
) -> HFTokenizer:
    """SentencePiece BPE (tokenizer.ggml.model "llama") as Hugging Face's Llama tokenizer.json
    has it: a BPE whose merges rank by the merged token's score, text it cannot spell falling
    back to the <0xNN> byte tokens, and "\u2581" for spaces (one more in front when
    ``add_space_prefix``)."""
    vocab = {token: i for i, token in enumerate(tokens)}
    unk = next((tokens[i] for i, kind in enumerate(token_types) if kind == _GGUF_UNKNOWN), None)
    backend = HFTokenizer(models.BPE(
        vocab=vocab, merges=_merges_from_scores(tokens, scores, token_types), unk_token=unk,
        fuse_unk=True, byte_fallback=True,
    ))
    # Spaces become "\u2581" in each stretch of text between special tokens, which gets one more
    # in front: llama.cpp's rule, and sentencepiece's for text without special tokens.
    # (transformers' Llama tokenizer uses Metaspace, which adds none before a leading space.)
    spaces = normalizers.Replace(" ", "\u2581")
    backend.normalizer = (
        normalizers.Sequence([normalizers.Prepend("\u2581"), spaces]) if add_space_prefix
        else spaces
    )
    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    backend.decoder = decoders.Sequence(steps)
    return backend


def _merges_from_scores(
    tokens: list[str], scores: list[float], token_types: list[int]
) -> list[tuple[str, str]]:
    """Every way to make a normal token from two tokens, best score first (ties: longer left
    part, then longer right part, then vocabulary order), as transformers derives them."""
    ids = {token: i for i, token in enumerate(tokens)}
    candidates: list[tuple[float, str, str]] = []
    for i, token in enumerate(tokens):
        if token_types and token_types[i] != _GGUF_NORMAL:
            continue
        splits = [(token[:k], token[k:]) for k in range(1, len(token))]
        splits = sorted(
            ((left, right) for left, right in splits if left in ids and right in ids),
            key=lambda pair: (ids[pair[0]], ids[pair[1]]),
        )
        candidates += [(scores[i], left, right) for left, right in splits]
    candidates.sort(key=lambda c: (-c[0], -len(c[1]), -len(c[2])))
    return [(left, right) for _, left, right in candidates]
