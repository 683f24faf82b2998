"""SFT pairs from the standard library: template, prompt masking, packing, determinism, split."""
import ast

import pytest
import torch

from plasticity_callbacks.data import IGNORE_INDEX, ByteTokenizer, CodeCorpusDataModule
from plasticity_callbacks.data.corpus import is_validation, stdlib_dir
from plasticity_callbacks.data.sft import (InstructionPair, MultiValidationDataModule, SFTDataModule, function_pairs,
                                           pack_rows, parse_chat, render_chat)

SOURCE = '''
import os

def add(a, b: int = 2, *rest, key=None) -> int:
    """Add two numbers.

    Longer explanation that is not part of the summary.
    """
    # a comment kept in the response
    return a + b

class Box:
    def get(self,
            name):
        """Return the item called name."""
        return self.items[name]

    def nodoc(self):
        return 1

    def only_doc(self):
        """Nothing else here."""

async def fetch(url):
    """Fetch a URL asynchronously."""
    return await url
'''


def test_function_pairs_from_a_known_source():
    pairs = function_pairs(SOURCE, "mod.py")
    assert [p.name for p in pairs] == ["mod.py:add", "mod.py:Box.get", "mod.py:fetch"]
    add, get, fetch = pairs
    assert add.prompt == ("Write a Python function with the signature `def add(a, b: int=2, *rest, key=None) -> int:` "
                          "that does this: Add two numbers.")
    assert add.response == "def add(a, b: int = 2, *rest, key=None) -> int:\n    # a comment kept in the response\n" \
                           "    return a + b"
    assert get.response == "def get(self,\n        name):\n    return self.items[name]"  # dedented by 4
    assert "async def fetch(url):" in fetch.prompt and fetch.response.startswith("async def fetch(url):")
    for pair in pairs:  # every response is valid Python without its docstring
        node = ast.parse(pair.response).body[0]
        assert ast.get_docstring(node) is None


def test_template_round_trips_and_masks_the_prompt():
    tok = ByteTokenizer()
    pair = InstructionPair("x", "Write ünïcode `def f():`", "def f():\n    return 'é'")
    ids, supervised = render_chat(pair, tok)
    text = tok.decode(ids)
    assert text == f"<|bos|><|user|>{pair.prompt}<|end|><|assistant|>{pair.response}<|end|>"
    assert parse_chat(text) == (pair.prompt, pair.response)
    # supervised exactly on the response bytes and the closing <|end|>
    first = supervised.index(True)
    assert ids[first - 1] == tok.token("<|assistant|>") and all(supervised[first:]) and not any(supervised[:first])
    assert tok.decode(ids[first:]) == pair.response + "<|end|>"
    with pytest.raises(ValueError):
        parse_chat("def f(): pass")


def test_packed_rows_take_loss_only_on_responses():
    tok = ByteTokenizer()
    pairs = [InstructionPair(str(i), f"prompt {i} " * (i + 1), f"answer {i}" * (3 - i % 3 + 1)) for i in range(7)]
    examples = [render_chat(p, tok) for p in pairs]
    x, y = pack_rows(examples, sequence_len=64, pad=tok.pad)
    assert x.shape == y.shape and x.shape[1] == 64
    # rebuild the expected labels independently: next token wherever it belongs to a response
    decoded_targets = []
    for row_x, row_y in zip(x, y):
        keep = row_y != IGNORE_INDEX
        decoded_targets.append(tok.decode(row_y[keep]))
    fits = [p for p, (ids, _) in zip(pairs, examples) if len(ids) <= 65]
    assert "".join(decoded_targets) == "".join(p.response + "<|end|>" for p in fits)
    assert torch.equal(x[:, 1:], torch.where(y[:, :-1] == IGNORE_INDEX, x[:, 1:], y[:, :-1]))  # y is x shifted
    too_long = [render_chat(InstructionPair("long", "p", "r" * 100), tok)]
    assert pack_rows(too_long, sequence_len=64, pad=tok.pad)[0].shape[0] == 0  # never truncated


def test_datamodule_is_deterministic_and_split_like_the_code_corpus():
    kwargs = dict(packages=["operator", "numbers", "stat", "fractions"], sequence_len=192, batch_size=4,
                  val_fraction=0.3)
    a, b = SFTDataModule(**kwargs), SFTDataModule(**kwargs)
    a.setup("fit"), b.setup("fit")
    assert torch.equal(a.train_set.tensors[0], b.train_set.tensors[0])
    assert torch.equal(a.val_set.tensors[1], b.val_set.tensors[1])
    train, val = a.pairs()
    root = stdlib_dir()
    files = lambda pairs: {p.name.split(":")[0] for p in pairs}  # noqa: E731
    assert val and not files(train) & files(val)
    assert all(is_validation(root / f, root, 0.3) for f in files(val))
    assert not any(is_validation(root / f, root, 0.3) for f in files(train))
    x, y = next(iter(a.train_dataloader()))
    assert x.shape == (4, 192) and 0 < (y != IGNORE_INDEX).float().mean() < 1


def test_multi_validation_lists_main_then_extra_sets():
    sft = SFTDataModule(packages=["operator", "numbers"], sequence_len=192, batch_size=2, val_fraction=0.3)
    code = CodeCorpusDataModule(packages=["json"], sequence_len=64, batch_size=2, max_val_tokens=2000)
    dm = MultiValidationDataModule(sft, {"pretrain": code})
    dm.setup("fit")
    loaders = dm.val_dataloader()
    assert dm.val_names == ["main", "pretrain"] and len(loaders) == 2
    assert loaders[1].dataset is code.val_set and dm.sequence_len == 192 and dm.vocab_size == sft.vocab_size
    with pytest.raises(ValueError, match="main"):
        MultiValidationDataModule(sft, {"main": code})


@pytest.mark.parametrize("kwargs", [dict(sequence_len=0), dict(val_fraction=1.0), dict(max_examples=0)])
def test_bad_arguments_are_named(kwargs):
    with pytest.raises(ValueError, match=next(iter(kwargs)).split("_")[0]):
        SFTDataModule(**kwargs)
