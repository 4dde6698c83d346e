"""Tokenizers the router hashes prompts with (docs/ROUTER.md, "Tokens").

The router must see the token ids the engine will prefill, or its page hashes never meet the
engine's: run it with the engine's own tokenizer (`HuggingFaceTokenizer`, when `transformers`
or `tokenizers` is installed). `WordTokenizer` and `ByteTokenizer` are deterministic, need
nothing, and are what the fake engine (kvcm.testing.openai_engine) and the tests use.

Chat requests are rendered with the tokenizer's chat template when it has one, else with
SIMPLE_CHAT_TEMPLATE:

    <|role|>\\n{content}\\n     for each message, then  <|assistant|>\\n
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any, Dict, List, Protocol, Sequence, runtime_checkable

Message = Dict[str, Any]

SIMPLE_CHAT_TEMPLATE = "<|{role}|>\n{content}\n"
SIMPLE_GENERATION_PROMPT = "<|assistant|>\n"


class TokenizerError(ValueError):
    """A prompt or message the tokenizer cannot turn into token ids; names the field."""


@runtime_checkable
class Tokenizer(Protocol):
    """Text to token ids. Implementations are deterministic and safe to share between
    coroutines of one event loop."""

    name: str

    def encode(self, text: str) -> List[int]:
        """Token ids of a completion prompt, as the engine tokenizes it."""
        ...

    def encode_chat(self, messages: Sequence[Message]) -> List[int]:
        """Token ids of a chat request's prompt (template applied, generation prompt added)."""
        ...


def message_text(message: Message, index: int) -> str:
    """The text of one chat message: a string, or the text parts of a content list (other
    parts, e.g. images, have no token ids here and are left out). TokenizerError naming
    messages[i] for a malformed message."""
    if not isinstance(message, dict):
        raise TokenizerError(f"messages[{index}]: must be an object")
    content = message.get("content")
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or not isinstance(part.get("type"), str):
                raise TokenizerError(
                    f"messages[{index}].content[{j}]: must be an object with a type")
            if part["type"] == "text":
                parts.append(str(part.get("text", "")))
        return "".join(parts)
    raise TokenizerError(f"messages[{index}].content: must be a string or a list of parts")


def has_non_text_parts(messages: Any) -> bool:
    """Whether a chat request carries parts other than text (images, audio): the engine's
    block hashes then depend on inputs the router does not tokenize."""
    if not isinstance(messages, list):
        return False
    return any(isinstance(m, dict) and isinstance(m.get("content"), list)
               and any(isinstance(p, dict) and p.get("type") != "text" for p in m["content"])
               for m in messages)


def render_simple_chat(messages: Sequence[Message]) -> str:
    """SIMPLE_CHAT_TEMPLATE applied to `messages`, with the generation prompt."""
    out = []
    for i, m in enumerate(messages):
        role = m.get("role") if isinstance(m, dict) else None
        if not isinstance(role, str) or not role:
            raise TokenizerError(f"messages[{i}].role: must be a non-empty string")
        out.append(SIMPLE_CHAT_TEMPLATE.format(role=role, content=message_text(m, i)))
    return "".join(out) + SIMPLE_GENERATION_PROMPT


class WordTokenizer:
    """One token per whitespace-separated word: the first 31 bits of the word's BLAKE2b.
    For tests and demos: readable (a 16-token block is 16 words) and dependency-free."""

    name = "words"

    def encode(self, text: str) -> List[int]:
        return [self.word_id(w) for w in text.split()]

    def encode_chat(self, messages: Sequence[Message]) -> List[int]:
        return self.encode(render_simple_chat(messages))

    @staticmethod
    def word_id(word: str) -> int:
        digest = hashlib.blake2b(word.encode("utf-8"), digest_size=4).digest()
        return int.from_bytes(digest, "little") & 0x7FFFFFFF


class ByteTokenizer:
    """One token per UTF-8 byte (ids 0..255). For tests."""

    name = "bytes"

    def encode(self, text: str) -> List[int]:
        return list(text.encode("utf-8"))

    def encode_chat(self, messages: Sequence[Message]) -> List[int]:
        return self.encode(render_simple_chat(messages))


class HuggingFaceTokenizer:
    """A Hugging Face tokenizer by hub name or local path.

    With `transformers` installed, AutoTokenizer loads it (and its chat template). Otherwise
    `tokenizers` loads `tokenizer.json` (the path, or the file in the directory) and, with
    `jinja2`, renders the `chat_template` of a `tokenizer_config.json` beside it; without a
    template, SIMPLE_CHAT_TEMPLATE. `add_special_tokens` applies to completion prompts, as
    vLLM's default (True) does."""

    def __init__(self, name_or_path: str, *, add_special_tokens: bool = True) -> None:
        self.name = name_or_path
        self._add_special = add_special_tokens
        self._hf: Any = None  # transformers tokenizer
        self._tok: Any = None  # tokenizers.Tokenizer
        self._template: Any = None  # jinja2 template
        self._special: Dict[str, str] = {}
        try:
            import transformers  # noqa: F401
        except ImportError:
            self._load_tokenizers(name_or_path)
        else:
            from transformers import AutoTokenizer

            self._hf = AutoTokenizer.from_pretrained(name_or_path)

    def _load_tokenizers(self, name_or_path: str) -> None:
        try:
            from tokenizers import Tokenizer as RawTokenizer
        except ImportError:
            raise TokenizerError(
                f"tokenizer {name_or_path!r}: needs the `transformers` or `tokenizers` "
                "package (pip install tokenizers), or use 'words' / 'bytes' for tests"
            ) from None
        path = Path(name_or_path)
        file = path / "tokenizer.json" if path.is_dir() else path
        if not file.is_file():
            raise TokenizerError(
                f"tokenizer {name_or_path!r}: no tokenizer.json there (without `transformers` "
                "only local files load)")
        self._tok = RawTokenizer.from_file(str(file))
        config = file.parent / "tokenizer_config.json"
        if config.is_file():
            meta = json.loads(config.read_text(encoding="utf-8"))
            template = meta.get("chat_template")
            for k in ("bos_token", "eos_token"):
                v = meta.get(k)
                self._special[k] = v.get("content", "") if isinstance(v, dict) else (v or "")
            if isinstance(template, str):
                try:
                    import jinja2
                except ImportError:
                    raise TokenizerError(
                        f"tokenizer {name_or_path!r}: has a chat template, which needs "
                        "the `jinja2` package") from None
                env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
                self._template = env.from_string(template)

    def encode(self, text: str) -> List[int]:
        if self._hf is not None:
            return list(self._hf(text, add_special_tokens=self._add_special)["input_ids"])
        return list(self._tok.encode(text, add_special_tokens=self._add_special).ids)

    def encode_chat(self, messages: Sequence[Message]) -> List[int]:
        msgs = [dict(m, content=message_text(m, i)) for i, m in enumerate(messages)]
        if self._hf is not None and getattr(self._hf, "chat_template", None):
            ids = self._hf.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True)
            return list(ids if isinstance(ids, list) else ids["input_ids"])
        if self._template is not None:
            text = self._template.render(messages=msgs, add_generation_prompt=True,
                                         **self._special)
            # The template writes the special tokens itself (vLLM: add_special_tokens=False).
            return list(self._tok.encode(text, add_special_tokens=False).ids)
        text = render_simple_chat(msgs)
        if self._hf is not None:
            return list(self._hf(text, add_special_tokens=False)["input_ids"])
        return list(self._tok.encode(text, add_special_tokens=False).ids)


def load_tokenizer(spec: str) -> Tokenizer:
    """'words', 'bytes', or a Hugging Face tokenizer name / path. TokenizerError when empty."""
    if not spec:
        raise TokenizerError(
            "tokenizer: required: the engines' Hugging Face tokenizer (name or path), or "
            "'words' / 'bytes' (test tokenizers)")
    if spec == WordTokenizer.name:
        return WordTokenizer()
    if spec == ByteTokenizer.name:
        return ByteTokenizer()
    return HuggingFaceTokenizer(os.path.expanduser(spec))


def prompt_tokens(tokenizer: Tokenizer, body: Dict[str, Any], chat: bool) -> List[int]:
    """Token ids of an OpenAI request body's prompt: `messages` for chat; for completions
    `prompt` as a string, a list of ids, or a one-element list of either. TokenizerError
    naming the field otherwise."""
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise TokenizerError("messages: must be a non-empty list")
        return tokenizer.encode_chat(messages)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return tokenizer.encode(prompt)
    if isinstance(prompt, list) and prompt and all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return list(prompt)
    if isinstance(prompt, list) and len(prompt) > 1:
        raise TokenizerError("prompt: batched prompts are not routed (send one per request)")
    raise TokenizerError("prompt: must be a string or a non-empty list of token ids")


__all__ = [
    "ByteTokenizer",
    "HuggingFaceTokenizer",
    "Message",
    "SIMPLE_CHAT_TEMPLATE",
    "Tokenizer",
    "TokenizerError",
    "WordTokenizer",
    "has_non_text_parts",
    "load_tokenizer",
    "message_text",
    "prompt_tokens",
    "render_simple_chat",
]
