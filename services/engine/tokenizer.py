"""Tokenizer and chat template from a GGUF file's vocabulary or a HF directory's tokenizer.json."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

_GGUF_CONTROL_TOKEN = 3
_GGUF_USER_DEFINED_TOKEN = 4


# What apply_chat_template gives the template itself.
TEMPLATE_VARIABLES = ("messages", "add_generation_prompt", "bos_token", "eos_token", "tools")


class Tokenizer:
    def __init__(
        self,
        backend: HFTokenizer,
        eos_token_ids: Sequence[int],
        bos_token_id: int | None = None,
        add_bos: bool = False,
        chat_template: str | None = None,
    ) -> None:
        self.backend = backend
        self.eos_token_ids = tuple(eos_token_ids)
        self.bos_token_id = bos_token_id
        self.add_bos = add_bos and bos_token_id is not None
        self.chat_template = chat_template
        self._template = (
            ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True).from_string(
                chat_template
            )
            if chat_template
            else None
        )

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self.backend.encode(text, add_special_tokens=False).ids
        if add_special_tokens and self.add_bos:
            ids = [self.bos_token_id, *ids]  # type: ignore[list-item]
        return ids

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    @property
    def template_renders_tools(self) -> bool:
        """Whether the chat template shows a ``tools`` list itself."""
        return "tools" in (self.chat_template or "")

    def apply_chat_template(
        self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True,
        tools: Sequence[dict[str, Any]] | None = None,
        extra: Mapping[str, Any] | None = None,
    ) -> str:
        """``extra``: more variables for the template (a request's ``chat_template_kwargs``);
        they cannot replace the ones set here (``TEMPLATE_VARIABLES``)."""
        if self._template is None:
            raise ValueError("this model has no chat template; send a plain prompt instead")
        bos = self.id_to_token(self.bos_token_id) if self.bos_token_id is not None else ""
        eos = self.id_to_token(self.eos_token_ids[0]) if self.eos_token_ids else ""
        clash = sorted(set(extra or ()) & set(TEMPLATE_VARIABLES))
        if clash:
            raise ValueError(f"chat template variable {clash[0]!r} is set by the server")
        return self._template.render(
            **(extra or {}),
            messages=list(messages),
            add_generation_prompt=add_generation_prompt,
            bos_token=bos or "",
            eos_token=eos or "",
            tools=list(tools) if tools else None,
        )

    def encode_chat(self, messages: Sequence[dict[str, Any]],
                    tools: Sequence[dict[str, Any]] | None = None,
                    extra: Mapping[str, Any] | None = None) -> list[int]:
        # The template writes BOS itself where the model wants one.
        return self.encode(self.apply_chat_template(messages, tools=tools, extra=extra),
                           add_special_tokens=False)

    @classmethod
    def from_gguf_fields(
        cls,
        tokens: list[str],
        merges: list[str],
        token_types: list[int],
        pre: str,
        chat_template: str | None,
        eos_token_ids: Sequence[int],
        bos_token_id: int | None,
        add_bos: bool,
    ) -> Tokenizer:
        vocab = {token: i for i, token in enumerate(tokens)}
        merge_pairs = [tuple(m.split(" ", 1)) for m in merges]
        backend = HFTokenizer(models.BPE(vocab=vocab, merges=merge_pairs, fuse_unk=False))
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        if pre in ("smollm", "starcoder", "refact"):
            # These vocabularies split every digit on its own before the byte-level regex.
            backend.pre_tokenizer = pre_tokenizers.Sequence(
                [pre_tokenizers.Digits(individual_digits=True), byte_level]
            )
        else:
            backend.pre_tokenizer = byte_level
        backend.decoder = decoders.ByteLevel()
        specials = [
            AddedToken(tokens[i], special=True, normalized=False)
            for i, kind in enumerate(token_types)
            if kind in (_GGUF_CONTROL_TOKEN, _GGUF_USER_DEFINED_TOKEN)
        ]
        backend.add_special_tokens(specials)
        return cls(backend, eos_token_ids, bos_token_id, add_bos, chat_template)

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
