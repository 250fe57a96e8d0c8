"""Exact, faster `encode` for GPT-2-style byte-level BPE tokenizers, on ASCII text.

`tokenizers` encodes a text in three steps: split it at added tokens (`<|im_start|>`), split each piece into
pre-tokens with the byte-level regex (GPT-2's)

    's|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+

and run BPE on each pre-token's bytes (each byte written as one printable character). On ASCII text the regex's
classes are plain: letters `[A-Za-z]`, numbers `[0-9]`, whitespace `[\\t\\n\\v\\f\\r ]` (Unicode White_Space; not
`\\x1c`-`\\x1f`, which Python's `\\s` would take), so Python's `re` runs it, and a pre-token's ids depend on the
pre-token alone, so they are cached. A piece that is not ASCII goes to the tokenizer itself. The result is the
tokenizer's own ids (`ByteLevelEncoder.of` checks the tokenizer's configuration, then compares both on probe
texts); the cost on a 1 KB tool output is about a quarter of `tokenizers`' (its regex engine is the slow step),
on source code about a tenth.
"""

from __future__ import annotations

import json
import re
from typing import Any

_WS = "\\t\\n\\x0b\\x0c\\r "
# GPT-2's pre-tokenizer pattern, restricted to ASCII (see the module docstring)
_PRE_TOKEN = re.compile(
    rf"'s|'t|'re|'ve|'m|'ll|'d| ?[A-Za-z]+| ?[0-9]+| ?[^{_WS}A-Za-z0-9]+|[{_WS}]+(?![^{_WS}])|[{_WS}]+")
_CACHE_LIMIT = 200_000     # pre-tokens remembered (then forgotten at once)
_PROBES = ["", " ", "a", "hello world", "  two  spaces  ", "tabs\tand\nnewlines\n\n\nend\n", "trailing   ",
           "I'm sure it's John's, they'll've", "'S 'T 'Re", "x=1;y=[2,3]# ok", "99 bottles 3.14 1e-9",
           "def f(x):\n    return x  # c\n", "\x00\x01\x1c\x1d\x1e\x1f\x7f\x0b\x0c\r\n", "a\x1cb c\x1f",
           "".join(map(chr, range(128))), " ".join(map(chr, range(128)))]


def _byte_chars() -> dict[int, str]:
    """GPT-2's byte -> character map: printable bytes stand for themselves, the others for 256 + n."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    out, n = {b: chr(b) for b in printable}, 0
    for b in range(256):
        if b not in out:
            out[b] = chr(256 + n)
            n += 1
    return out


_ASCII_TO_BYTE_CHARS = {b: c for b, c in _byte_chars().items() if b < 128}   # a str.translate table


class ByteLevelEncoder:
    """`encode(text)` == `backend.encode(text, add_special_tokens=False).ids` of a Rust (`tokenizers`) tokenizer
    whose pipeline is: no normalizer, a `ByteLevel` pre-tokenizer with GPT-2's regex and no prefix space, a
    BPE model; added tokens matched as written (no lstrip, rstrip, single_word or normalized). Build it with
    `of`, which returns None for any other tokenizer.

    Args:
        backend: the `tokenizers.Tokenizer` (`transformers` tokenizer's `backend_tokenizer`).
        added: added token text -> id.
    """

    def __init__(self, backend: Any, added: dict[str, int]):
        self._backend = backend
        self._model = backend.model
        self._added = added
        # leftmost-longest, as `tokenizers` matches added tokens: longer alternatives first
        self._split = re.compile("(" + "|".join(map(re.escape, sorted(added, key=len, reverse=True))) + ")") \
            if added else None
        self._cache: dict[str, list[int]] = {}

    @classmethod
    def of(cls, backend: Any) -> ByteLevelEncoder | None:
        """The encoder for `backend` (a `tokenizers.Tokenizer`), or None when its pipeline is not the one this
        class reproduces (see the class docstring) or the two disagree on the probe texts."""
        try:
            config = json.loads(backend.to_str())
        except Exception:  # noqa: BLE001 - not a tokenizers.Tokenizer
            return None
        pre, model = config.get("pre_tokenizer") or {}, config.get("model") or {}
        added = config.get("added_tokens") or []
        if (config.get("normalizer") is not None or pre.get("type") != "ByteLevel" or not pre.get("use_regex", True)
                or pre.get("add_prefix_space") or model.get("type") != "BPE" or model.get("dropout")
                or any(t.get(f) for t in added for f in ("lstrip", "rstrip", "single_word", "normalized"))):
            return None
        encoder = cls(backend, {t["content"]: t["id"] for t in added})
        probes = _PROBES + [p + t + p for t in encoder._added for p in ("", " ", "x\n")]
        if any(encoder.encode(p) != backend.encode(p, add_special_tokens=False).ids for p in probes):
            return None
        return encoder

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, added tokens written in it mapped to their ids."""
        if self._split is None:
            return self._encode_piece(text)
        out: list[int] = []
        for i, piece in enumerate(self._split.split(text)):
            if i % 2:
                out.append(self._added[piece])
            elif piece:
                out += self._encode_piece(piece)
        return out

    def _encode_piece(self, piece: str) -> list[int]:
        if not piece.isascii():
            return self._backend.encode(piece, add_special_tokens=False).ids
        cache, out = self._cache, []
        for word in _PRE_TOKEN.findall(piece):
            ids = cache.get(word)
            if ids is None:
                if len(cache) >= _CACHE_LIMIT:
                    cache.clear()
                ids = cache[word] = [t.id for t in self._model.tokenize(word.translate(_ASCII_TO_BYTE_CHARS))]
            out += ids
        return out
