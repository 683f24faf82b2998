import pytest
import torch

from plasticity_callbacks.data import ByteTokenizer, CodeCorpusDataModule, split_files, stdlib_files
from plasticity_callbacks.errors import ConfigError
from plasticity_callbacks.models import GPTConfig
from plasticity_callbacks.models.lightning_module import check_data_fits_model


def test_tokenizer_round_trip_with_specials_and_unicode():
    tok = ByteTokenizer()
    text = "def f(x):\n    return 'héllo → 世界'\n"
    ids = tok.encode(text, bos=True, eos=True)
    assert ids[0] == tok.bos and ids[-1] == tok.eos and max(ids[1:-1]) < 256
    assert tok.decode(ids) == "<|bos|>" + text + "<|eos|>"
    assert tok.decode(tok.encode(text)) == text
    assert torch.equal(tok.encode_tensor(text).long(), torch.tensor(tok.encode(text)))
    assert tok.vocab_size <= GPTConfig().vocab_size


def test_stdlib_corpus_is_sorted_without_tests():
    files = stdlib_files()
    assert len(files) > 100 and files == sorted(files)
    assert not any(part in ("test", "tests", "site-packages") for f in files for part in f.parts[-3:-1])
    assert {f.name for f in stdlib_files(packages=["json"])} >= {"__init__.py", "decoder.py"}
    assert all("json" not in f.parts for f in stdlib_files(exclude_packages=["json"]))


def test_split_is_deterministic_disjoint_and_stable_under_subsetting():
    files = stdlib_files()
    train, val = split_files(files, 0.1)
    train2, val2 = split_files(list(files), 0.1)
    assert (train, val) == (train2, val2)
    assert not set(train) & set(val) and len(train) + len(val) == len(files)
    assert 0.03 < len(val) / len(files) < 0.2
    subset = files[: len(files) // 2]  # a file's side of the split does not depend on the others
    _, val_subset = split_files(subset, 0.1)
    assert set(val_subset) == set(val) & set(subset)


def test_datamodule_windows_are_shifted_by_one():
    dm = CodeCorpusDataModule(packages=["json"], sequence_len=32, batch_size=4, val_fraction=0.3)
    dm.setup()
    x, y = dm.train_set[3]
    assert x.shape == y.shape == (32,) and torch.equal(x[1:], y[:-1])
    xb, yb = next(iter(dm.train_dataloader()))
    assert xb.shape == (4, 32) and xb.dtype == torch.long
    assert len(dm.val_set) > 0


def test_user_files_source(tmp_path):
    for i in range(3):
        (tmp_path / f"doc{i}.txt").write_text("plasticity " * 50)
    dm = CodeCorpusDataModule(source="files", paths=str(tmp_path / "*.txt"), sequence_len=16, val_fraction=0.3)
    dm.setup()
    assert len(dm.train_set) > 0 and len(dm.val_set) > 0


def test_clear_errors_for_bad_data(tmp_path):
    with pytest.raises(ValueError, match="matches no files"):
        CodeCorpusDataModule(source="files", paths=str(tmp_path / "*.nothing")).setup()
    with pytest.raises(ValueError, match="corpus is empty"):
        CodeCorpusDataModule(packages=["no_such_package_*"]).setup()
    with pytest.raises(ValueError, match="data.source"):
        CodeCorpusDataModule(source="web")
    (tmp_path / "tiny.txt").write_text("x")
    with pytest.raises(ValueError, match="shorter than one window"):
        CodeCorpusDataModule(source="files", paths=str(tmp_path / "tiny.txt"), val_fraction=0).setup()
    with pytest.raises(ConfigError, match="data.sequence_len=512 is larger than model.sequence_len=256"):
        check_data_fits_model(CodeCorpusDataModule(sequence_len=512), GPTConfig())
    with pytest.raises(ConfigError, match="model.vocab_size=200"):
        check_data_fits_model(CodeCorpusDataModule(), GPTConfig(vocab_size=200))


def test_user_files_split_does_not_depend_on_where_the_folder_lives(tmp_path):
    held_out = []
    for folder in ("a", "somewhere/else"):
        root = tmp_path / folder
        root.mkdir(parents=True)
        for i in range(6):
            (root / f"doc{i}.txt").write_text(f"document {i} " * 40)
        dm = CodeCorpusDataModule(source="files", paths=str(root / "*.txt"), sequence_len=16, val_fraction=0.3)
        dm.setup()
        held_out.append(dm.val_set.tokens)
    assert torch.equal(held_out[0], held_out[1])


def test_a_tiny_corpus_keeps_a_file_on_each_side(tmp_path):
    files = [tmp_path / f"f{i}.txt" for i in range(3)]
    for val_fraction in (0.01, 0.99):  # (nearly) every file hashed to one side
        train, val = split_files(files, val_fraction)
        assert train and val and sorted(train + val) == sorted(files)
