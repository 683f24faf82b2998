"""Instruction → response pairs from the standard library, in a chat template, for an SFT phase.

Each pair comes from a documented function found with ``ast``: the prompt asks for a function
with its signature that does what the first paragraph of its docstring says; the response is
the function's own source without the docstring. Pairs are rendered as

    <|bos|><|user|>{prompt}<|end|><|assistant|>{response}<|end|>

and the loss is taken on the response and its closing ``<|end|>`` only (every other label is
``IGNORE_INDEX``). Files are split exactly as :class:`CodeCorpusDataModule` splits them, so
the SFT validation pairs come from the same held-out files as the pretraining validation set
and phase-2 training never sees a file that phase-1 validation measures.

``MultiValidationDataModule`` adds earlier phases' validation sets as extra validation
dataloaders, so retention of phase-1 knowledge is measured while phase 2 trains.
"""
from __future__ import annotations

import ast
import functools
from dataclasses import dataclass
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_info
from torch.utils.data import DataLoader, TensorDataset

from .corpus import read_text, split_files, stdlib_dir, stdlib_files
from .datamodule import TrainValDataModule
from .tokenizer import IGNORE_INDEX, ByteTokenizer

PROMPT_TEMPLATE = "Write a Python function with the signature `{signature}` that does this: {summary}"


@dataclass(frozen=True)
class InstructionPair:
    name: str  # where it came from, e.g. "json/decoder.py:JSONDecoder.decode"
    prompt: str
    response: str


def docstring_summary(docstring: str, max_chars: int = 200) -> str:
    """The first paragraph of a docstring on one line ('' when it is too long to be a summary)."""
    paragraph = docstring.strip().split("\n\n")[0]
    summary = " ".join(line.strip() for line in paragraph.splitlines())
    return summary if len(summary) <= max_chars else ""


def _dedent(lines: list[str], columns: int) -> list[str]:
    return [line[columns:] if not line[:columns].strip() else line.lstrip() for line in lines]


def function_pairs(source: str, origin: str) -> list[InstructionPair]:
    """One pair per documented function or method in ``source`` whose body is more than its docstring."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    lines = source.splitlines()
    pairs, scopes = [], [(tree, "")]
    while scopes:  # depth-first, in source order, carrying the qualified name
        node, prefix = scopes.pop(0)
        children = [c for c in ast.iter_child_nodes(node) if isinstance(c, (ast.ClassDef, ast.FunctionDef,
                                                                              ast.AsyncFunctionDef))]
        scopes[:0] = [(c, f"{prefix}{c.name}.") for c in children]
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        docstring = ast.get_docstring(node)
        summary = docstring_summary(docstring) if docstring else ""
        if not summary or len(node.body) < 2:
            continue
        doc_node, first_statement = node.body[0], node.body[1]
        # The header may span lines (long signatures); the body resumes after the docstring.
        header = lines[node.lineno - 1 : doc_node.lineno - 1]
        body = lines[doc_node.end_lineno : node.end_lineno]
        if not header or first_statement.lineno == doc_node.end_lineno:
            continue  # docstring on the def line, or code after it on its line: nothing clean to cut
        response = "\n".join(_dedent(header + body, node.col_offset)).rstrip()
        keyword = "async def" if isinstance(node, ast.AsyncFunctionDef) else "def"
        returns = f" -> {ast.unparse(node.returns)}" if node.returns is not None else ""
        signature = f"{keyword} {node.name}({ast.unparse(node.args)}){returns}:"
        prompt = PROMPT_TEMPLATE.format(signature=signature, summary=summary)
        pairs.append(InstructionPair(f"{origin}:{prefix.rstrip('.')}", prompt, response))
    return pairs


@functools.lru_cache(maxsize=4096)
def file_pairs(path: Path, origin: str, mtime_ns: int) -> tuple[InstructionPair, ...]:
    """``function_pairs`` of one file, cached: parsing the whole library takes seconds, and a study
    builds the same SFT data in every run of one process."""
    return tuple(function_pairs(read_text(path), origin))


def render_chat(pair: InstructionPair, tokenizer: ByteTokenizer) -> tuple[list[int], list[bool]]:
    """Token ids of the chat template and, per token, whether the model is trained to produce it."""
    user, assistant, end = (tokenizer.token(t) for t in ("<|user|>", "<|assistant|>", "<|end|>"))
    prompt = [tokenizer.bos, user, *tokenizer.encode(pair.prompt), end, assistant]
    response = [*tokenizer.encode(pair.response), end]
    return prompt + response, [False] * len(prompt) + [True] * len(response)


def parse_chat(text: str) -> tuple[str, str]:
    """Inverse of the template on decoded text: ``(prompt, response)``."""
    head, _, rest = text.partition("<|user|>")
    prompt, _, rest = rest.partition("<|end|><|assistant|>")
    response, found, _ = rest.partition("<|end|>")
    if head not in ("", "<|bos|>") or not found:
        raise ValueError(f"not a rendered chat example: {text[:80]!r}")
    return prompt, response


def pack_rows(examples: list[tuple[list[int], list[bool]]], sequence_len: int, pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Whole examples packed greedily into rows of ``sequence_len + 1`` tokens (never split, padded).

    Returns ``x, y`` of shape ``(rows, sequence_len)``: ``y`` is ``x`` shifted by one, with
    ``IGNORE_INDEX`` wherever the next token is prompt or padding. Longer examples are dropped.
    """
    width = sequence_len + 1
    rows, row_ids, row_mask = [], [], []
    for ids, mask in examples:
        if len(ids) > width:
            continue
        if len(row_ids) + len(ids) > width:
            rows.append((row_ids, row_mask))
            row_ids, row_mask = [], []
        row_ids, row_mask = row_ids + ids, row_mask + mask
    if row_ids:
        rows.append((row_ids, row_mask))
    tokens = torch.full((len(rows), width), pad, dtype=torch.long)
    supervised = torch.zeros((len(rows), width), dtype=torch.bool)
    for r, (ids, mask) in enumerate(rows):
        tokens[r, : len(ids)] = torch.tensor(ids)
        supervised[r, : len(mask)] = torch.tensor(mask)
    x, y = tokens[:, :-1], tokens[:, 1:].clone()
    y[~supervised[:, 1:]] = IGNORE_INDEX
    return x, y


class SFTDataModule(TrainValDataModule):
    """Supervised fine-tuning on instruction/response pairs built from the standard library.

    Args:
        packages / exclude_packages: ``fnmatch`` patterns on stdlib top-level packages.
        sequence_len: tokens per row; examples longer than a row are skipped.
        batch_size: rows per batch.
        val_fraction: share of files held out (the same split as ``CodeCorpusDataModule``).
        max_examples: cap on training pairs, for quick runs.

    Example:
        >>> dm = SFTDataModule(packages=["json", "email"], sequence_len=256, batch_size=8)
        >>> trainer.fit(module, datamodule=dm)
    """

    def __init__(self, packages: list[str] | None = None, exclude_packages: list[str] | None = None,
                 sequence_len: int = 256, batch_size: int = 16, val_fraction: float = 0.05,
                 max_examples: int | None = None, num_workers: int = 0):
        super().__init__()
        if sequence_len <= 0 or batch_size <= 0:
            raise ValueError(f"data.sequence_len and data.batch_size must be positive, got {sequence_len}, {batch_size}")
        if not 0 <= val_fraction < 1:
            raise ValueError(f"data.val_fraction must be in [0, 1), got {val_fraction}")
        if max_examples is not None and max_examples <= 0:
            raise ValueError(f"data.max_examples must be positive or null, got {max_examples}")
        self.packages = None if packages is None else list(packages)
        self.exclude_packages = None if exclude_packages is None else list(exclude_packages)
        self.sequence_len, self.batch_size, self.val_fraction = sequence_len, batch_size, val_fraction
        self.max_examples, self.num_workers = max_examples, num_workers
        self.tokenizer = ByteTokenizer()
        self.train_set: TensorDataset | None = None
        self.val_set: TensorDataset | None = None

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size

    def pairs(self) -> tuple[list[InstructionPair], list[InstructionPair]]:
        root = stdlib_dir()
        files = stdlib_files(self.packages, self.exclude_packages)
        train_files, val_files = split_files(files, self.val_fraction, root)

        def collect(paths: list[Path]) -> list[InstructionPair]:
            return [p for f in paths for p in file_pairs(f, str(f.relative_to(root)), f.stat().st_mtime_ns)]

        train = collect(train_files)
        return (train[: self.max_examples] if self.max_examples else train), collect(val_files)

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is not None:
            return
        train, val = self.pairs()
        pad = self.tokenizer.pad
        self.train_set = TensorDataset(*pack_rows([render_chat(p, self.tokenizer) for p in train], self.sequence_len, pad))
        self.val_set = TensorDataset(*pack_rows([render_chat(p, self.tokenizer) for p in val], self.sequence_len, pad))
        if len(self.train_set) < self.batch_size:
            raise ValueError(f"only {len(self.train_set)} SFT rows of {self.sequence_len} tokens for packages="
                             f"{self.packages}; widen data.packages or raise data.sequence_len")
        rank_zero_info(f"sft: {len(train)} train pairs in {len(self.train_set)} rows, "
                       f"{len(val)} val pairs in {len(self.val_set)} rows")


class MultiValidationDataModule(L.LightningDataModule):
    """Trains on ``main``; validates on ``main`` (dataloader 0) and then on each of ``extra``'s validation sets.

    ``val_names`` lists the validation sets in dataloader order (``"main"`` first), so a
    module can log each under its own name, e.g. the pretraining set's loss after SFT.

    Example:
        >>> dm = MultiValidationDataModule(SFTDataModule(), {"pretrain": CodeCorpusDataModule()})
        >>> dm.val_names
        ['main', 'pretrain']
    """

    def __init__(self, main: L.LightningDataModule, extra: dict[str, L.LightningDataModule]):
        super().__init__()
        if "main" in extra:
            raise ValueError("extra validation sets cannot be named 'main'")
        self.main, self.extra = main, dict(extra)

    def __getattr__(self, name: str):  # sequence_len, vocab_size, batch_size... of the main data
        if name in ("main", "extra") or name.startswith("_"):
            raise AttributeError(name)
        return getattr(self.main, name)

    @property
    def val_names(self) -> list[str]:
        return ["main", *self.extra]

    def setup(self, stage: str | None = None) -> None:
        for datamodule in (self.main, *self.extra.values()):
            datamodule.setup(stage)

    def train_dataloader(self) -> DataLoader:
        return self.main.train_dataloader()

    def val_dataloader(self) -> list[DataLoader]:
        return [self.main.val_dataloader(), *(dm.val_dataloader() for dm in self.extra.values())]
