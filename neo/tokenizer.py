"""Text <-> token ids, from a model directory's ``tokenizer.json`` (the ``tokenizers`` package).

The engine always accepts token ids; a tokenizer is optional (``load_tokenizer`` returns None
when the model has none, e.g. a shipped config used with dummy weights).
"""

import functools
import json
import os
from datetime import datetime

import tokenizers

from neo.models import loader, tiny


def _read_json(path: str) -> dict:
    if not os.path.isfile(path):
        return {}
    with open(path) as file:
        return json.load(file)


def _token_text(token) -> str | None:
    """A special token as written in tokenizer_config.json: a string or ``{"content": ...}``."""
    if isinstance(token, dict):
        return token.get("content")
    return token


def _as_ids(value) -> list[int]:
    if value is None:
        return []
    return list(value) if isinstance(value, list) else [value]


class Tokenizer:
    """A ``tokenizers.Tokenizer`` plus the model's special token ids and chat template.

    eos_token_ids: every id that ends generation (tuple, may be empty). bos_token_id: None
    when the model has none. vocab_size: the tokenizer's vocabulary, which may be smaller
    than the model's embedding table.
    """

    def __init__(self, backend: tokenizers.Tokenizer, *, bos_token: str | None = None,
                 eos_token: str | None = None, bos_token_id: int | None = None,
                 eos_token_ids: tuple[int, ...] = (), chat_template: str | None = None):
        self.backend = backend
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.bos_token_id = bos_token_id
        self.eos_token_ids = tuple(eos_token_ids)
        self.chat_template = chat_template

    @classmethod
    def from_directory(cls, directory: str) -> "Tokenizer":
        """Read ``tokenizer.json`` and the special tokens of a Hugging Face model directory.

        End-of-sequence ids are gathered from ``config.json``, ``generation_config.json`` and
        ``tokenizer_config.json``'s ``eos_token``; the chat template from
        ``tokenizer_config.json`` or ``chat_template.jinja``.
        """
        backend = tokenizers.Tokenizer.from_file(os.path.join(directory, "tokenizer.json"))
        model_config = _read_json(os.path.join(directory, "config.json"))
        generation_config = _read_json(os.path.join(directory, "generation_config.json"))
        tokenizer_config = _read_json(os.path.join(directory, "tokenizer_config.json"))
        template_path = os.path.join(directory, "chat_template.jinja")
        chat_template = tokenizer_config.get("chat_template")
        if os.path.isfile(template_path):
            with open(template_path) as file:
                chat_template = file.read()
        if isinstance(chat_template, list):  # [{"name": ..., "template": ...}, ...]
            named = {entry["name"]: entry["template"] for entry in chat_template}
            chat_template = named.get("default", next(iter(named.values()), None))
        return cls._with_specials(backend, tokenizer_config, chat_template,
                                  bos_ids=_as_ids(model_config.get("bos_token_id")),
                                  eos_ids=_as_ids(model_config.get("eos_token_id"))
                                  + _as_ids(generation_config.get("eos_token_id")))

    @classmethod
    def _with_specials(cls, backend, tokenizer_config: dict, chat_template, bos_ids, eos_ids):
        bos_token = _token_text(tokenizer_config.get("bos_token"))
        eos_token = _token_text(tokenizer_config.get("eos_token"))
        if eos_token is not None and backend.token_to_id(eos_token) is not None:
            eos_ids = eos_ids + [backend.token_to_id(eos_token)]
        bos_token_id = backend.token_to_id(bos_token) if bos_token is not None else None
        if bos_token_id is None and bos_ids:
            bos_token_id = bos_ids[0]
        return cls(backend, bos_token=bos_token, eos_token=eos_token, bos_token_id=bos_token_id,
                   eos_token_ids=tuple(dict.fromkeys(eos_ids)), chat_template=chat_template)

    @classmethod
    def tiny(cls) -> "Tokenizer":
        """The built-in byte-level tokenizer of neo-tiny."""
        config = tiny.tiny_hf_config()
        return cls._with_specials(tiny.tiny_tokenizer(), tiny.tiny_tokenizer_config(),
                                  tiny.tiny_tokenizer_config()["chat_template"],
                                  bos_ids=_as_ids(config["bos_token_id"]),
                                  eos_ids=_as_ids(config["eos_token_id"]))

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    @functools.cached_property
    def max_text_bytes_per_token(self) -> int | None:
        """The most UTF-8 bytes of input text that one token can stand for, so a text longer
        than ``n`` times this encodes to more than ``n`` tokens (before any truncation); None
        when the tokenizer can drop text (then no byte count bounds the token count).

        Each token consumes at most its vocabulary entry's bytes of (normalized) text: a
        byte-level entry spells each byte as one character and a SentencePiece entry spells a
        space as the 3-byte "\u2581", so an entry is never shorter than the text it covers.
        Normalization can shrink text, by at most ``NORMALIZER_SHRINK`` for the normalizers
        in ``_SHRINKING_NORMALIZERS``; anything that deletes text (an unknown normalizer,
        a pre-tokenizer that drops whitespace, added tokens that strip the whitespace beside
        them, a model that fuses unknown text into one token) gives None.
        """
        spec = json.loads(self.backend.to_str())
        shrink = _normalizer_shrink(spec.get("normalizer"))
        if (shrink is None or not _pre_tokenizer_keeps_text(spec.get("pre_tokenizer"))
                or not _model_keeps_text(spec["model"])
                or any(token.get("lstrip") or token.get("rstrip")
                       for token in spec.get("added_tokens") or [])):
            return None
        vocabulary = self.backend.get_vocab(with_added_tokens=True)
        return shrink * max(len(token.encode()) for token in vocabulary)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; ``add_special_tokens`` adds what the tokenizer adds (e.g. BOS).

        Goes through ``encode_batch_fast``: unlike ``encode`` it releases the GIL while it
        works (so other threads, such as a server's event loop, run meanwhile), and it skips
        the character offsets nobody here reads.
        """
        return self.backend.encode_batch_fast([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            chat_template: str | None = None) -> str:
        """Render ``[{"role": ..., "content": ...}, ...]`` into a prompt string.

        Uses ``chat_template`` if given, else the model's Jinja chat template when it has one;
        otherwise one ``role: content`` line per message, then ``assistant: `` when
        ``add_generation_prompt``. The result already holds the template's special tokens:
        encode it with ``add_special_tokens=False``.
        """
        template = chat_template or self.chat_template
        if not template:
            lines = "".join(f"{message['role']}: {message['content']}\n" for message in messages)
            return lines + ("assistant: " if add_generation_prompt else "")
        return _render_template(template, messages=messages,
                                add_generation_prompt=add_generation_prompt,
                                bos_token=self.bos_token or "", eos_token=self.eos_token or "")


# How many times fewer UTF-8 bytes a normalizer can leave of a text: Unicode normalization maps
# at most four bytes to one (NFKC turns the 4-byte mathematical "\U0001d400" into "A"; NFC the
# 3-byte Kelvin sign into "K", three 3-byte Hangul jamo into one syllable) and lowercasing at
# most three (the Kelvin sign to "k").
NORMALIZER_SHRINK = 4
_SHRINKING_NORMALIZERS = {"NFC", "NFD", "NFKC", "NFKD", "Lowercase"}
# Pre-tokenizers that split text without dropping any of it ("Split" and "Punctuation" unless
# their behavior is "Removed").
_TEXT_KEEPING_PRE_TOKENIZERS = {"ByteLevel", "Metaspace", "Digits", "UnicodeScripts", "Split",
                                "Punctuation"}


def _normalizer_shrink(spec: dict | None) -> int | None:
    """The factor by which the normalizer of ``spec`` (tokenizer.json's) can shrink a text in
    bytes; None when it can delete text."""
    if spec is None or spec["type"] == "Prepend":
        return 1
    if spec["type"] == "Sequence":
        factor = 1
        for part in spec["normalizers"]:
            part_factor = _normalizer_shrink(part)
            if part_factor is None:
                return None
            factor *= part_factor
        return factor
    if spec["type"] == "Replace" and "String" in spec["pattern"] and spec["content"]:
        return -(-len(spec["pattern"]["String"].encode()) // len(spec["content"].encode()))
    return NORMALIZER_SHRINK if spec["type"] in _SHRINKING_NORMALIZERS else None


def _pre_tokenizer_keeps_text(spec: dict | None) -> bool:
    if spec is None:
        return True
    if spec["type"] == "Sequence":
        return all(_pre_tokenizer_keeps_text(part) for part in spec["pretokenizers"])
    return (spec["type"] in _TEXT_KEEPING_PRE_TOKENIZERS
            and str(spec.get("behavior", "")).lower() != "removed")


def _model_keeps_text(spec: dict) -> bool:
    """BPE gives every unknown character a token of its own unless it fuses them (byte
    fallback spells them as bytes instead); other models map whole unknown words to one."""
    return spec["type"] == "BPE" and (not spec.get("fuse_unk") or spec.get("byte_fallback")
                                      or spec.get("unk_token") is None)


def _render_template(template: str, **variables) -> str:
    """Render a Hugging Face chat template (Jinja, sandboxed, with the helpers templates use)."""
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise TemplateError(message)

    def to_json(value, indent=None):
        return json.dumps(value, ensure_ascii=False, indent=indent)

    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=["jinja2.ext.loopcontrols"])
    environment.filters["tojson"] = to_json
    environment.globals["raise_exception"] = raise_exception
    environment.globals["strftime_now"] = lambda format: datetime.now().strftime(format)
    return environment.from_string(template).render(**variables)


def load_tokenizer(model: str) -> Tokenizer | None:
    """The tokenizer of a model name or directory; None when it has no ``tokenizer.json``.

    Raises the loader's error for a name that is neither built in nor a directory.
    """
    kind = loader.model_kind(model)
    if kind == "tiny":
        return Tokenizer.tiny()
    if kind == "directory" and os.path.isfile(os.path.join(model, "tokenizer.json")):
        return Tokenizer.from_directory(model)
    return None
