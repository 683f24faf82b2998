"""Byte-level tokenizer: ids 0–255 are bytes, special tokens follow. Nothing to download."""
from __future__ import annotations

import torch

SPECIAL_TOKENS = ("<|bos|>", "<|eos|>", "<|pad|>", "<|user|>", "<|assistant|>", "<|end|>")
IGNORE_INDEX = -100  # label value that cross-entropy skips (masked prompt tokens, padding)


class ByteTokenizer:
    """UTF-8 bytes plus ``SPECIAL_TOKENS``.

    Example:
        >>> tok = ByteTokenizer()
        >>> tok.decode(tok.encode("def f(): pass", bos=True))
        '<|bos|>def f(): pass'
    """

    def __init__(self):
        self.special = {name: 256 + i for i, name in enumerate(SPECIAL_TOKENS)}
        self.special_names = {i: name for name, i in self.special.items()}
        self.vocab_size = 256 + len(SPECIAL_TOKENS)

    @property
    def bos(self) -> int:
        return self.special["<|bos|>"]

    @property
    def eos(self) -> int:
        return self.special["<|eos|>"]

    @property
    def pad(self) -> int:
        return self.special["<|pad|>"]

    def token(self, name: str) -> int:
        if name not in self.special:
            raise KeyError(f"unknown special token {name!r}; known: {list(self.special)}")
        return self.special[name]

    def encode(self, text: str, bos: bool = False, eos: bool = False) -> list[int]:
        ids = list(text.encode("utf-8"))
        return ([self.bos] if bos else []) + ids + ([self.eos] if eos else [])

    def encode_tensor(self, text: str) -> torch.Tensor:
        """Bytes of ``text`` as an int16 tensor (fast path for large corpora)."""
        raw = bytearray(text.encode("utf-8"))
        return torch.frombuffer(raw, dtype=torch.uint8).to(torch.int16) if raw else torch.zeros(0, dtype=torch.int16)

    def decode(self, ids) -> str:
        if torch.is_tensor(ids):
            ids = ids.tolist()
        out, buf = [], bytearray()
        for i in ids:
            if i < 256:
                buf.append(i)
                continue
            out.append(buf.decode("utf-8", errors="replace"))
            buf = bytearray()
            out.append(self.special_names.get(i, f"<|{i}|>"))
        out.append(buf.decode("utf-8", errors="replace"))
        return "".join(out)
