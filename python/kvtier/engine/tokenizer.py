"""Tokenizer and chat template built from the GGUF metadata (no network, no tokenizer.json).

SmolLM2 uses GPT-2-style byte-level BPE (``tokenizer.ggml.model = "gpt2"``) with the ``smollm``
pre-tokenizer: every digit is its own pre-token, then the GPT-2 regex splits the rest (llama.cpp's
``LLAMA_VOCAB_PRE_TYPE_SMOLLM``; HF's ``Digits(individual_digits=True)`` + ``ByteLevel``). The
``tokenizers`` package runs the BPE from the vocabulary and merges in the file. Control tokens
(``token_type == 3``: ``<|endoftext|>``, ``<|im_start|>``, ``<|im_end|>``, ...) are special: written
in text they encode to their ids.

The chat template is ChatML. Rather than run Jinja, :meth:`Tokenizer.apply_chat_template` renders
ChatML directly and takes the default system prompt from the GGUF's template; a template that is
not ChatML is refused, so the rendering cannot silently drift from the file.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from pathlib import Path

import gguf
import tokenizers
from tokenizers import decoders, models, pre_tokenizers

from kvtier.engine.errors import EngineInputError, ModelFormatError
from kvtier.engine.weights import metadata, open_gguf

CONTROL_TOKEN_TYPE = 3
_DEFAULT_SYSTEM = re.compile(r"'<\|im_start\|>system\n(.*?)<\|im_end\|>\n'", re.DOTALL)
_CHATML_MARKS = (
    "'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>'",
    "add_generation_prompt",
)


class Tokenizer:
    """Byte-level BPE tokenizer plus ChatML chat template. Build one with :func:`load_tokenizer`."""

    def __init__(
        self,
        tokens: Sequence[str],
        merges: Sequence[str],
        token_types: Sequence[int],
        *,
        bos_token_id: int,
        eos_token_id: int,
        chat_template: str,
    ) -> None:
        if len(tokens) != len(token_types):
            raise ModelFormatError(f"{len(tokens)} tokens but {len(token_types)} token types")
        vocab = {token: i for i, token in enumerate(tokens)}
        pairs = []
        for merge in merges:
            left, sep, right = merge.partition(" ")
            if not sep:
                raise ModelFormatError(f"BPE merge {merge!r} is not two tokens separated by a space")
            pairs.append((left, right))
        bpe = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=pairs))
        bpe.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
        )
        bpe.decoder = decoders.ByteLevel()
        self.special_tokens = tuple(
            t for t, kind in zip(tokens, token_types, strict=True) if kind == CONTROL_TOKEN_TYPE
        )
        bpe.add_special_tokens(
            [tokenizers.AddedToken(t, special=True, normalized=False) for t in self.special_tokens]
        )
        self._bpe = bpe
        self.vocab_size = len(tokens)
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.chat_template = chat_template
        if not all(mark in chat_template for mark in _CHATML_MARKS):
            raise ModelFormatError("the GGUF chat template is not ChatML; this tokenizer renders only ChatML")
        match = _DEFAULT_SYSTEM.search(chat_template)
        self.default_system_prompt = match.group(1) if match else None
        self.stop_token_ids = tuple(sorted({eos_token_id, vocab.get("<|endoftext|>", eos_token_id)}))

    @classmethod
    def from_gguf(cls, reader: gguf.GGUFReader) -> Tokenizer:
        kind = metadata(reader, "tokenizer.ggml.model")
        if kind != "gpt2":
            raise ModelFormatError(f"tokenizer model is {kind!r}; only GPT-2-style BPE ('gpt2') is supported")
        pre = metadata(reader, "tokenizer.ggml.pre")
        if pre != "smollm":
            raise ModelFormatError(f"pre-tokenizer is {pre!r}; only 'smollm' is supported")
        return cls(
            metadata(reader, "tokenizer.ggml.tokens"),
            metadata(reader, "tokenizer.ggml.merges"),
            metadata(reader, "tokenizer.ggml.token_type"),
            bos_token_id=int(metadata(reader, "tokenizer.ggml.bos_token_id")),
            eos_token_id=int(metadata(reader, "tokenizer.ggml.eos_token_id")),
            chat_template=metadata(reader, "tokenizer.chat_template"),
        )

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``; special-token strings in it (``<|im_start|>``) become their ids."""
        if not isinstance(text, str):
            raise EngineInputError(f"text is {type(text).__name__}; expected str")
        return list(self._bpe.encode(text, add_special_tokens=False).ids)

    def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        ids = [int(t) for t in token_ids]
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise EngineInputError(f"token ids {bad[:5]} are outside 0..{self.vocab_size - 1}")
        return str(self._bpe.decode(ids, skip_special_tokens=skip_special_tokens))

    def apply_chat_template(
        self, messages: Sequence[Mapping[str, str]], *, add_generation_prompt: bool = True
    ) -> str:
        """ChatML text of ``messages`` (``{"role": ..., "content": ...}``), with the template's default
        system message first when the conversation has none, and an open assistant turn when
        ``add_generation_prompt``."""
        if not messages:
            raise EngineInputError("messages is empty; expected at least one message")
        parts = []
        if messages[0].get("role") != "system" and self.default_system_prompt is not None:
            parts.append(f"<|im_start|>system\n{self.default_system_prompt}<|im_end|>\n")
        for message in messages:
            role, content = message.get("role"), message.get("content")
            if not isinstance(role, str) or not isinstance(content, str):
                raise EngineInputError(f"message {message!r} needs string `role` and `content`")
            parts.append(f"<|im_start|>{role}\n{content}<|im_end|>\n")
        if add_generation_prompt:
            parts.append("<|im_start|>assistant\n")
        return "".join(parts)

    def encode_chat(self, messages: Sequence[Mapping[str, str]]) -> list[int]:
        """Token ids of the chat template applied to ``messages``, ready for generation."""
        return self.encode(self.apply_chat_template(messages))

    def encode_instruct(self, prompt: str) -> list[int]:
        """Token ids of a one-turn user prompt in the chat template."""
        return self.encode_chat([{"role": "user", "content": prompt}])


def load_tokenizer(path: str | Path | None = None) -> Tokenizer:
    """The tokenizer of the packaged SmolLM2 GGUF (or the GGUF at ``path``)."""
    return Tokenizer.from_gguf(open_gguf(path))
