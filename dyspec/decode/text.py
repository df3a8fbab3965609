"""Tokens as text: a byte-level tokenizer splits a character of several bytes (most of CJK, emoji)
over tokens, and a token decoded alone then reads as U+FFFD. Trees label such a token with its bytes
(`token_labels`); the streamed text gives a split character whole to the token that completes it
(`stream_texts`), so nothing garbled reaches a view."""

from __future__ import annotations

import functools
import weakref

from transformers import PreTrainedTokenizerBase

PARTIAL = "\ufffd"  # what decoding bytes that end inside a character gives
MAX_PENDING = 4  # a character is at most 4 bytes: longer, the text really holds U+FFFD


# tokenizer -> {token id: label}: a step's tree labels dozens of tokens, most of them seen before, and
# decoding one costs microseconds of the tokenizer's Python
_LABELS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def token_labels(tokenizer: PreTrainedTokenizerBase, ids: list[int]) -> list[str]:
    """Each token decoded alone; one that holds only part of a character as its bytes, `<e4 bd>`."""
    known = _LABELS.setdefault(tokenizer, {})
    new = [i for i in dict.fromkeys(ids) if i not in known]
    for i, text in zip(new, tokenizer.batch_decode([[i] for i in new]) if new else []):
        known[i] = token_bytes(tokenizer, i) if PARTIAL in text else text
    return [known[i] for i in ids]


@functools.cache
def byte_of_char() -> dict[str, int]:
    """GPT-2's byte-level table read backwards: the byte each of its printable characters stands for."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return {c: b for b, c in bytes_to_unicode().items()}


def token_bytes(tokenizer: PreTrainedTokenizerBase, token_id: int) -> str:
    """A token's bytes in hex: a byte-level BPE token's characters mapped back to the bytes they
    stand for (GPT-2's table), a byte-fallback token (`<0xE4>`) as it is."""
    piece = tokenizer.convert_ids_to_tokens(token_id)
    table = byte_of_char()
    if not all(c in table for c in piece):
        return piece
    return "<" + " ".join(f"{table[c]:02x}" for c in piece) + ">"


def stream_texts(tokenizer: PreTrainedTokenizerBase, ids: list[int], pending: list[int]) -> tuple[list[str], list[int]]:
    """The text each of `ids` adds after `pending` (earlier tokens that ended inside a character),
    and the tokens pending after them: a token that ends inside a character adds "", the one that
    completes it the whole character."""
    texts, pending = [], list(pending)
    for token in ids:
        pending.append(token)
        text = tokenizer.decode(pending)
        if text.endswith(PARTIAL) and len(pending) < MAX_PENDING:
            texts.append("")
            continue
        texts.append(text)
        pending = []
    return texts, pending
