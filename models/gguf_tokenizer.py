"""A GGUF file's tokenizer built from its metadata with the `tokenizers` library (no torch).

A GGUF carries no `tokenizer.json`: the vocabulary, merges, token types, special token ids and
chat template are metadata under llama.cpp's key names (`tokenizer.ggml.*`). transformers can
convert them, but its GGUF reader needs torch, which a JAX server does not depend on. This
module reads the same keys with the `gguf` package and builds the byte-level BPE tokenizer
(`tokenizer.ggml.model == "gpt2"`: SmolLM2, Llama 3, Qwen 2, ...) the way transformers does,
wrapped in a `PreTrainedTokenizerFast`. Other tokenizer models return None, and the caller
falls back to transformers' converter.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import gguf

BYTE_LEVEL_MODEL = "gpt2"
CONTROL, USER_DEFINED = 3, 4  # llama.cpp token types

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# `tokenizer.ggml.pre` -> the split regex its merges were learned with. Absent: GPT-2's own
# regex (ByteLevel's default), as transformers does for e.g. SmolLM2's "smollm".
PRE_TOKENIZER_SPLITS = {
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "smaug-bpe", "dbrx"), _LLAMA3_SPLIT),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen"), _QWEN2_SPLIT),
}
_SPECIAL_TOKEN_IDS = {
    "bos_token": "bos_token_id",
    "eos_token": "eos_token_id",
    "unk_token": "unknown_token_id",
    "pad_token": "padding_token_id",
}


def read_tokenizer_metadata(reader: gguf.GGUFReader) -> dict[str, Any]:
    """Every `tokenizer.*` field of the file: key -> value (lists for arrays)."""
    values = {}
    for key, field in reader.fields.items():
        if key.startswith("tokenizer.") and field.types:
            values[key] = _field_value(field)
    return values


def _field_value(field) -> Any:
    is_array = field.types[0] == gguf.GGUFValueType.ARRAY
    item_type = field.types[-1]
    items = []
    for index in field.data:
        part = field.parts[index]
        items.append(bytes(part).decode("utf-8") if item_type == gguf.GGUFValueType.STRING else part[0].item())
    return items if is_array else items[0]


@functools.cache
def _byte_alphabet() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map (`bytes_to_unicode`)."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("\u00a1"), ord("\u00ac") + 1),
        *range(ord("\u00ae"), ord("\u00ff") + 1),
    ]
    mapping = {byte: chr(byte) for byte in printable}
    others = [byte for byte in range(256) if byte not in mapping]
    mapping.update({byte: chr(256 + n) for n, byte in enumerate(others)})
    return mapping


def build_gguf_tokenizer(metadata: dict[str, Any]):
    """A `PreTrainedTokenizerFast` for a byte-level BPE GGUF, or None for other tokenizer models."""
    if metadata.get("tokenizer.ggml.model") != BYTE_LEVEL_MODEL or "tokenizer.ggml.merges" not in metadata:
        return None
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    tokens: list[str] = metadata["tokenizer.ggml.tokens"]
    token_types: list[int] = metadata.get("tokenizer.ggml.token_type") or [0] * len(tokens)
    spelling = _byte_alphabet()
    alphabet = set(spelling.values())
    vocab = {
        (token if set(token) <= alphabet else "".join(spelling[b] for b in token.encode("utf-8"))): index
        for index, token in enumerate(tokens)
    }
    merges = [tuple(merge.split(" ")) for merge in metadata["tokenizer.ggml.merges"]]
    backend = Tokenizer(
        models.BPE(
            vocab=vocab,
            merges=merges,
            dropout=None,
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
        )
    )
    split = PRE_TOKENIZER_SPLITS.get(metadata.get("tokenizer.ggml.pre"))
    if split is None:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    backend.decoder = decoders.ByteLevel()
    # Control tokens (<|im_start|>, ...) stay whole and are special; a control token spelled
    # outside the byte alphabet is a llama.cpp mislabel and is skipped, as transformers does.
    backend.add_special_tokens(
        [
            AddedToken(token, normalized=False, special=True)
            for token, kind in zip(tokens, token_types)
            if kind == CONTROL and set(token) <= alphabet
        ]
    )
    backend.add_tokens(
        [
            AddedToken(token, normalized=False, special=False)
            for token, kind in zip(tokens, token_types)
            if kind == USER_DEFINED and token in vocab
        ]
    )

    special = {
        name: tokens[metadata[f"tokenizer.ggml.{key}"]]
        for name, key in _SPECIAL_TOKEN_IDS.items()
        if f"tokenizer.ggml.{key}" in metadata
    }
    add_bos = bool(metadata.get("tokenizer.ggml.add_bos_token", False)) and "bos_token" in special
    add_eos = bool(metadata.get("tokenizer.ggml.add_eos_token", False)) and "eos_token" in special
    if add_bos or add_eos:
        pieces = [[special["bos_token"]] if add_bos else [], [special["eos_token"]] if add_eos else []]
        single = " ".join(pieces[0] + ["$A"] + pieces[1])
        backend.post_processor = processors.TemplateProcessing(
            single=single,
            pair=single + " " + single.replace("$A", "$B"),
            special_tokens=[(token, vocab[token]) for token in {*pieces[0], *pieces[1]}],
        )
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, chat_template=metadata.get("tokenizer.chat_template"), **special
    )


def load_tokenizer_from_gguf_metadata(path: str | Path):
    """Read the file's tokenizer metadata and build it; None when its model is not byte-level BPE."""
    return build_gguf_tokenizer(read_tokenizer_metadata(gguf.GGUFReader(Path(path))))
