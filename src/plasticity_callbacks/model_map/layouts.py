"""Row layouts of fused matrices: which rows of a weight's ``(out, in)`` view form Q, K, V, a gate, ...

A fused projection computes several matrices in one matmul; its forward then cuts the output
apart. How it cuts decides which rows belong together, and the cut is not always contiguous:

* contiguous blocks ``[q | k | v]`` (GPT-2 ``c_attn``, Phi-3 ``qkv_proj``, ``nn.MultiheadAttention``);
* per head ``[heads, 3, head_dim]`` (GPT-NeoX/Pythia and Bloom ``query_key_value``: ``view`` then ``chunk``);
* per key/value group ``[kv_groups, q_per_kv + 2, head_dim]`` (Falcon's grouped ``query_key_value``).

A :class:`RowBlock` is therefore a set of row indices. :func:`interleaved_heads` and
:func:`grouped_heads` name the two strided patterns for :func:`declare_plasticity`.

Example:
    >>> declare_plasticity(model, fused={"layers.0.attn.query_key_value.weight": interleaved_heads(heads=8)})
    >>> [len(b) for b in grouped_heads(kv_groups=2, q_per_kv=4).blocks(96)]   # q, k, v rows
    [64, 16, 16]
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RowBlock:
    """Rows of a weight's ``(out, in)`` view that form one matrix, e.g. the K rows of a fused QKV.

    ``rows`` is a ``range`` when contiguous (:meth:`take` is then a view) or a tuple of indices.
    """

    label: str
    rows: range | tuple[int, ...]

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def index(self) -> slice | torch.Tensor:
        """An index for dim 0: a slice when the rows are contiguous, else a LongTensor."""
        if isinstance(self.rows, range) and self.rows.step == 1:
            return slice(self.rows.start, self.rows.stop)
        return torch.tensor(self.rows, dtype=torch.long)

    def take(self, weight: torch.Tensor) -> torch.Tensor:
        """These rows of ``weight`` (``(out, in, *k)``): a view when contiguous, a copy otherwise."""
        index = self.index
        return weight[index] if isinstance(index, slice) else weight[index.to(weight.device)]

    def put(self, weight: torch.Tensor, value: torch.Tensor) -> None:
        """Write ``value`` (from :meth:`take`) back into these rows of ``weight``."""
        index = self.index
        if isinstance(index, slice):
            if value.data_ptr() != weight[index].data_ptr():
                weight[index] = value
        else:
            weight[index.to(weight.device)] = value

    def describe(self) -> str:
        rows = self.rows
        if isinstance(rows, range) and rows.step == 1:
            return f"{self.label}=rows {rows.start}:{rows.stop}"
        return f"{self.label}={len(rows)} rows, strided"


@dataclass(frozen=True)
class HeadLayout:
    """Rows viewed as ``[groups, len(slots), head_dim]``; slot ``s`` of every group belongs to ``slots[s]``.

    Args:
        groups: how many groups the forward's ``view`` makes (heads, or key/value groups).
        slots: the part each slot of a group belongs to, e.g. ``("q", "k", "v")`` per head.
    """

    groups: int
    slots: tuple[str, ...]

    def __post_init__(self) -> None:
        if not isinstance(self.groups, int) or self.groups < 1 or not self.slots:
            raise ValueError(f"a head layout needs groups >= 1 and at least one slot, got {self.groups}, {self.slots}")

    def blocks(self, rows: int) -> tuple[RowBlock, ...]:
        per_group = self.groups * len(self.slots)
        if rows % per_group:
            raise ValueError(f"{self!r}: {rows} rows are not {self.groups} groups of {len(self.slots)} equal slots")
        index = torch.arange(rows).view(self.groups, len(self.slots), -1)  # (groups, slots, head_dim)
        labels = list(dict.fromkeys(self.slots))
        return tuple(RowBlock(label, tuple(index[:, [s == label for s in self.slots]].flatten().tolist()))
                     for label in labels)

    def __repr__(self) -> str:
        kinds = {s: self.slots.count(s) for s in self.slots}
        if self.slots == ("q", "k", "v"):
            return f"interleaved_heads(heads={self.groups})"
        if set(kinds) == {"q", "k", "v"} and kinds["k"] == kinds["v"] == 1 and self.slots[-2:] == ("k", "v"):
            return f"grouped_heads(kv_groups={self.groups}, q_per_kv={kinds['q']})"
        return f"HeadLayout(groups={self.groups}, slots={self.slots})"


@dataclass(frozen=True)
class Interleaved:
    """Rows dealt out in turn: row ``r`` belongs to ``parts[r % len(parts)]`` (GPT-OSS experts' ``gate_up[..., ::2]``,
    ``gate_up[..., 1::2]``).

    Args:
        parts: the labels, in the order rows cycle through them.
    """

    parts: tuple[str, ...] = ("gate", "up")

    def blocks(self, rows: int) -> tuple[RowBlock, ...]:
        if rows % len(self.parts):
            raise ValueError(f"{self!r}: {rows} rows do not deal out evenly to {len(self.parts)} parts")
        return tuple(RowBlock(label, range(i, rows, len(self.parts))) for i, label in enumerate(self.parts))


@dataclass(frozen=True)
class Bare:
    """A parameter outside ``nn.Linear``/conv used as a linear map: one matrix, or a stack of them along dim 0.

    Build it with :func:`linear_map` or :func:`stacked_matrices`.
    """

    stored: str = "out_in"
    split: object = None
    stacked: bool = False

    def __post_init__(self) -> None:
        if self.stored not in ("out_in", "in_out"):
            raise ValueError(f"stored={self.stored!r}: give 'out_in' (used as F.linear(x, W)) or 'in_out' (x @ W)")


def linear_map(stored: str = "out_in", split=None) -> Bare:
    """A bare 2-D parameter used as one linear map, for ``declare_plasticity(fused=...)``.

    Args:
        stored: ``"out_in"`` (the forward computes ``F.linear(x, W)``) or ``"in_out"`` (``x @ W``).
        split: how its output rows split (any ``fused=`` layout), or None: whole.

    Example:
        >>> declare_plasticity(model, fused={"mix": linear_map("in_out")})
    """
    return Bare(stored, None if split is None else parse_fused("split", split), stacked=False)


def stacked_matrices(stored: str = "out_in", split=None) -> Bare:
    """A 3-D parameter holding one matrix per leading index (experts), for ``declare_plasticity(fused=...)``.

    Args:
        stored: ``"out_in"`` (each matrix used as ``F.linear(x, W[e])``) or ``"in_out"`` (``x @ W[e]``).
        split: how one matrix's output rows split (counts, row lists, :func:`interleaved_heads`,
            :class:`Interleaved`), or None: each matrix whole.

    Example:
        >>> declare_plasticity(model, fused={"layers.0.mlp.experts.gate_up_proj":
        ...                                  stacked_matrices("in_out", split=Interleaved(("gate", "up")))})
    """
    return Bare(stored, None if split is None else parse_fused("split", split), stacked=True)


def interleaved_heads(heads: int, parts: int | Sequence[str] = ("q", "k", "v")) -> HeadLayout:
    """Rows laid out ``[heads, parts, head_dim]``: the forward does ``view(..., heads, parts·head_dim)``
    then ``chunk(parts)`` (GPT-NeoX/Pythia, Bloom, MHA Falcon).

    Args:
        heads: the number of attention heads.
        parts: labels of the parts within a head (or their number: 3 -> q, k, v).
    """
    if isinstance(parts, int):
        parts = ("q", "k", "v") if parts == 3 else tuple(f"part{i}" for i in range(parts))
    return HeadLayout(heads, tuple(parts))


def grouped_heads(kv_groups: int, q_per_kv: int) -> HeadLayout:
    """Rows laid out ``[kv_groups, q_per_kv + 2, head_dim]``: per key/value group its query heads, one
    key head and one value head (Falcon's grouped-query ``query_key_value``).

    Args:
        kv_groups: the number of key/value heads.
        q_per_kv: query heads per key/value head.
    """
    return HeadLayout(kv_groups, ("q",) * q_per_kv + ("k", "v"))


def contiguous(sizes: Sequence[tuple[str, int]]) -> tuple[RowBlock, ...]:
    """Blocks of consecutive rows, ``[("q", 64), ("k", 16), ("v", 16)]`` -> rows 0:64, 64:80, 80:96."""
    blocks, start = [], 0
    for label, size in sizes:
        blocks.append(RowBlock(label, range(start, start + size)))
        start += size
    return tuple(blocks)


def check_partition(blocks: Sequence[RowBlock], rows: int, what: str) -> tuple[RowBlock, ...]:
    """Raise unless ``blocks`` cover each of ``rows`` rows exactly once."""
    seen = Counter(r for b in blocks for r in b.rows)
    problems = {f"out of range (the rows are 0..{rows - 1})": sorted(r for r in seen if r >= rows),
                "in no block": sorted(set(range(rows)) - set(seen)),
                "in more than one block": sorted(r for r, n in seen.items() if n > 1)}
    named = [f"row(s) {rows_named(found)} {problem}" for problem, found in problems.items() if found]
    if named:
        raise ValueError(f"{what}: the row blocks must cover each of the matrix's {rows} rows exactly once: "
                         f"{'; '.join(named)}")
    return tuple(blocks)


def rows_named(rows: list[int]) -> str:
    """Up to five row indices, and how many more."""
    return " ".join([", ".join(map(str, rows[:5])), f"and {len(rows) - 5} more" if len(rows) > 5 else ""]).strip()


def parse_fused(name: str, spec) -> HeadLayout | tuple[tuple[str, object], ...]:
    """A ``declare_plasticity(fused=...)`` entry: a :class:`HeadLayout`, or ``(label, count | rows)`` pairs.

    Accepted: ``{"q": 64, "k": 16, "v": 16}`` or ``[64, 16, 16]`` (contiguous counts), ``{"q": [0, 1, ...], ...}``
    (row index sets), :func:`interleaved_heads` / :func:`grouped_heads`.
    """
    if isinstance(spec, (HeadLayout, Interleaved, Bare)):
        return spec
    items = list(spec.items()) if isinstance(spec, Mapping) else [(f"block{i}", s) for i, s in enumerate(spec or ())]
    parsed = []
    for label, value in items:
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            parsed.append((str(label), int(value)))
        elif (isinstance(value, (Sequence, range)) and not isinstance(value, str) and len(value)
              and all(isinstance(r, int) and not isinstance(r, bool) and r >= 0 for r in value)):
            parsed.append((str(label), tuple(int(r) for r in value)))
        else:
            parsed = []
            break
    if not parsed:
        raise ValueError(f"declare_plasticity(fused={{{name!r}: {spec!r}}}): give row counts {{'q': 64, 'k': 16, "
                         "'v': 16}, row index lists {'q': [0, 1, ...], ...}, interleaved_heads(heads=...) or "
                         "grouped_heads(kv_groups=..., q_per_kv=...)")
    if len({isinstance(v, int) for _, v in parsed}) > 1:
        raise ValueError(f"declare_plasticity(fused={{{name!r}: ...}}): give all blocks as counts or all as row lists")
    return tuple(parsed)


def declared_blocks(spec, rows: int, what: str) -> tuple[RowBlock, ...]:
    """The row blocks a parsed declaration gives for a matrix of ``rows`` rows (checked)."""
    if isinstance(spec, Bare):
        raise ValueError(f"{what}: {'stacked_matrices' if spec.stacked else 'linear_map'}(...) describes a "
                         "parameter outside nn.Linear/conv; this one is a layer's weight: give its row blocks")
    if isinstance(spec, (HeadLayout, Interleaved)):
        try:
            return spec.blocks(rows)
        except ValueError as err:
            raise ValueError(f"{what}: {err}") from None
    if isinstance(spec[0][1], int):
        if sum(s for _, s in spec) != rows:
            raise ValueError(f"{what}: blocks add up to {sum(s for _, s in spec)} rows, the matrix has {rows}")
        return contiguous(spec)
    return check_partition([RowBlock(label, tuple(r)) for label, r in spec], rows, what)


# Config/module fields that give head counts, as different code bases name them.
_HEADS = ("num_heads", "num_attention_heads", "n_head", "n_heads", "heads")
_KV_HEADS = ("num_key_value_heads", "num_kv_heads", "n_head_kv", "n_kv_heads", "n_kv_head", "n_query_groups",
             "kv_heads", "num_key_value_groups_count")


def head_counts(module, config) -> tuple[int | None, int | None]:
    """``(heads, kv_heads)`` of an attention module, from its own attributes first, then its config.

    ``multi_query=True`` (GPT-BigCode, old Falcon) means one key/value head.
    """
    def first(names):
        for source in (module, config):
            for name in names:
                value = getattr(source, name, None)
                if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                    return value
        return None

    heads, kv_heads = first(_HEADS), first(_KV_HEADS)
    multi_query = getattr(module, "multi_query", None)
    multi_query = getattr(config, "multi_query", False) if multi_query is None else multi_query
    if multi_query is True and not getattr(config, "new_decoder_architecture", False):
        kv_heads = 1
    return heads, kv_heads or heads


def suggested_declarations(name: str, rows: int, heads: int | None, kv_heads: int | None) -> list[str]:
    """Declarations that fit a fused QKV of ``rows`` rows with these head counts, one per plausible layout."""
    if not heads:
        return [f"declare_plasticity(model, fused={{{name!r}: {{'q': ..., 'k': ..., 'v': ...}}}})  # contiguous "
                "row counts, or row index lists"]
    kv_heads = kv_heads or heads
    head_dim, rest = divmod(rows, heads + 2 * kv_heads)
    if rest or not head_dim:
        return [f"declare_plasticity(model, fused={{{name!r}: {{'q': ..., 'k': ..., 'v': ...}}}})  # {rows} rows "
                f"do not fit {heads} query + 2×{kv_heads} key/value heads: give row counts or row index lists"]
    q, kv = heads * head_dim, kv_heads * head_dim
    out = [f"declare_plasticity(model, fused={{{name!r}: {{'q': {q}, 'k': {kv}, 'v': {kv}}}}})  "
           "# forward splits [q | k | v]"]
    if kv_heads == heads:
        out.append(f"declare_plasticity(model, fused={{{name!r}: interleaved_heads(heads={heads})}})  "
                   f"# forward views (..., {heads}, 3·head_dim) then chunks")
    elif heads % kv_heads == 0:
        out.append(f"declare_plasticity(model, fused={{{name!r}: grouped_heads(kv_groups={kv_heads}, "
                   f"q_per_kv={heads // kv_heads})}})  # forward views (..., {kv_heads}, q_per_kv + 2, head_dim)")
    return out
