"""The language-model task stream and TaskMetrics on it, each checked against a direct computation."""
import copy

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from plasticity_callbacks.callbacks.task_metrics import TaskMetrics, plasticity_metrics, target_scores
from plasticity_callbacks.data.lm_stream import BYTES, LMTaskStream, corpus_bytes
from plasticity_callbacks.data.tokenizer import IGNORE_INDEX
from plasticity_callbacks.models.lightning_module import GPTLightningModule

SMALL = dict(corpus_max_bytes=200_000, window=16, batch_size=8)


def test_target_scores_count_only_the_targets_that_are_not_ignored():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 7, 11, generator=g)
    targets = torch.randint(0, 11, (5, 7), generator=g)
    ignored = torch.rand(5, 7, generator=g) < 0.5
    targets[ignored] = IGNORE_INDEX
    accuracy, loss = target_scores(logits, targets)
    hits, nats, counted = 0, 0.0, 0
    for i in range(5):  # one target at a time
        for t in range(7):
            if targets[i, t] == IGNORE_INDEX:
                continue
            counted += 1
            hits += int(logits[i, t].argmax() == targets[i, t])
            nats += float(torch.logsumexp(logits[i, t], 0) - logits[i, t, targets[i, t]])
    assert counted == int((~ignored).sum()) > 0
    assert float(accuracy) == pytest.approx(hits / counted)
    assert float(loss) == pytest.approx(nats / counted, rel=1e-5)
    with pytest.raises(ValueError, match="every target is IGNORE_INDEX"):
        target_scores(logits, torch.full((5, 7), IGNORE_INDEX))


class HandMade(nn.Module):
    """A module with given logits and given hidden features (the interface TaskMetrics reads)."""

    device = torch.device("cpu")

    def __init__(self, logits, hidden):
        super().__init__()
        self.logits, self.hidden = logits, hidden
        self.weight = nn.Parameter(torch.ones(3))

    def forward(self, x):
        return self.logits

    def hidden_activations(self, x):
        return [("h", self.hidden)]


def test_plasticity_metrics_on_hand_made_logits_and_a_known_rank_feature_matrix():
    logits = torch.zeros(2, 3, 4)
    logits[0, 2, 1] = logits[1, 2, 3] = 5.0  # the last position predicts 1 and 3
    targets = torch.full((2, 3), IGNORE_INDEX)
    targets[0, 2], targets[1, 2] = 1, 0  # one hit, one miss
    rank = 3  # features with three equal singular values and two units always zero
    basis, _ = torch.linalg.qr(torch.randn(40, rank, generator=torch.Generator().manual_seed(1)))
    hidden = torch.cat([2.0 * basis, torch.zeros(40, 2)], dim=1)  # (rows, units)
    m = plasticity_metrics(HandMade(logits, hidden), torch.zeros(2, 3), targets, tau=0.025)
    assert m["accuracy"] == pytest.approx(0.5)
    expected_loss = 0.5 * sum(float(torch.logsumexp(logits[i, 2], 0) - logits[i, 2, c]) for i, c in ((0, 1), (1, 0)))
    assert m["loss"] == pytest.approx(expected_loss, rel=1e-6)
    assert m["feature_rank"] == pytest.approx(rank, rel=1e-6)  # exp(entropy) of three equal σ
    assert m["stable_rank"] == pytest.approx(rank, rel=1e-6)
    assert m["dead"] == pytest.approx(2 / 5) and m["dormant"] == pytest.approx(2 / 5)
    assert m["weight_norm"] == pytest.approx(3 ** 0.5)


def test_random_last_byte_tasks_recall_a_random_byte_after_corpus_windows():
    train, _ = corpus_bytes(SMALL["corpus_max_bytes"])
    text = bytes(train.tolist())
    fresh = LMTaskStream(design={"windows_per_task": 32}, num_tasks=3, seed=5, **SMALL)
    fixed = LMTaskStream(design={"windows_per_task": 32, "fresh_windows": False}, num_tasks=3, seed=5, **SMALL)
    for stream in (fresh, fixed):
        stream.setup()
        for t in range(3):
            task = stream.task(t)
            assert task.train_x.shape == task.train_y.shape == (32, 16)
            assert (task.train_y[:, :-1] == IGNORE_INDEX).all()
            assert ((task.train_y[:, -1] >= 0) & (task.train_y[:, -1] < BYTES)).all()
            assert all(bytes(row.tolist()) in text for row in task.train_x[:4])  # windows of the corpus
            assert torch.equal(task.eval_x, task.train_x) and torch.equal(task.eval_y, task.train_y)
    assert torch.equal(fixed.task(0).train_x, fixed.task(2).train_x)
    assert not torch.equal(fresh.task(0).train_x, fresh.task(2).train_x)
    assert not torch.equal(fixed.task(0).train_y, fixed.task(1).train_y)  # the bytes to recall change
    assert fresh.task_boundary_steps == [100, 200]


def test_permuted_vocab_relabels_every_byte_of_the_same_held_out_windows():
    stream = LMTaskStream(design={"name": "permuted_vocab", "eval_windows": 20}, num_tasks=2, steps_per_task=3, seed=2, **SMALL)
    plain = LMTaskStream(design={"name": "slices", "slice_bytes": [1000], "eval_windows": 20}, seed=2, **SMALL)  # same windows
    stream.setup(), plain.setup()
    unpermuted = plain.task(0).eval_x.flatten().tolist()
    relabellings = []
    for t in range(2):
        task = stream.task(t)
        assert task.train_x.shape == (3 * 8, 16)
        assert torch.equal(task.train_y[:, :-1], task.train_x[:, 1:])  # next-byte targets, permuted alike
        pairs = set(zip(unpermuted, task.eval_x.flatten().tolist()))
        # one byte always becomes the same byte, and two bytes never become one: a permutation
        assert len(pairs) == len({a for a, _ in pairs}) == len({b for _, b in pairs})
        relabellings.append(dict(pairs))
    assert relabellings[0] != relabellings[1]


def test_slices_are_disjoint_consecutive_parts_of_the_training_bytes():
    stream = LMTaskStream(design={"name": "slices", "slice_bytes": [1000, 50_000]}, steps_per_task=4, seed=0, **SMALL)
    assert stream.num_tasks == 2 and stream.task_boundary_steps == [4]
    stream.setup()
    text = bytes(stream.train_bytes.tolist())
    small, large = text[:1000], text[1000:51_000]
    assert all(bytes(row.tolist()) in small for row in stream.task(0).train_x)
    assert all(bytes(row.tolist()) in large for row in stream.task(1).train_x)
    assert torch.equal(stream.task(0).eval_x, stream.task(1).eval_x)  # one held-out set for every task


@pytest.mark.parametrize("bad, match", [
    (dict(design="shuffled"), "design"),
    (dict(design="slices"), "slice_bytes"),
    (dict(design={"name": "slices", "slice_bytes": [1000, 2000]}, num_tasks=3), "disagrees"),
    (dict(design={"name": "slices", "slice_bytes": [10**6, 10**6]}, corpus_max_bytes=10**6), "corpus_max_bytes"),
    (dict(window=1), "window"),
    (dict(design={"windows_per_task": 4}, batch_size=8), "fewer than"),
    (dict(design={"eval_windows": 1}), "data.design.eval_windows=1"),
    (dict(design={"fresh_windows": "no"}), "data.design.fresh_windows='no'"),
    (dict(design={"name": "slices", "slices": [1000]}), r"design: unknown field\(s\) \['slices'\]"),
])
def test_bad_settings_name_the_field(bad, match):
    with pytest.raises(ValueError, match=match):
        stream = LMTaskStream(**{"corpus_max_bytes": 200_000, **bad})
        stream.setup()


def test_gpt_hidden_activations_are_what_enters_each_c_proj():
    module = GPTLightningModule({"n_layer": 2, "n_embd": 32, "n_head": 2, "n_kv_head": 2, "sequence_len": 16})
    seen = []
    hooks = [block.mlp.c_proj.register_forward_pre_hook(lambda _, args: seen.append(args[0].flatten(0, -2)))
             for block in module.model.blocks]
    x = torch.randint(0, 256, (3, 16))
    with torch.no_grad():
        module.model(x)
    for hook in hooks:
        hook.remove()
    module.model.blocks[0].mlp.hidden_observer = observer = lambda *_: None  # e.g. ReDo's: put back after
    with torch.no_grad():
        got = module.hidden_activations(x)
    assert [name for name, _ in got] == ["model.blocks.0.mlp", "model.blocks.1.mlp"]
    for (_, h), direct in zip(got, seen):
        assert h.shape == (3 * 16, 128) and torch.equal(h, direct)
    assert module.model.blocks[0].mlp.hidden_observer is observer


class EndOfTaskCopies(L.Callback):
    """A copy of the module at every task end (listed before TaskMetrics: the same weights it measures)."""

    def __init__(self, steps):
        self.steps, self.ends = steps, []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step % self.steps == 0:
            self.ends.append(copy.deepcopy(pl_module.model).eval())


def test_task_metrics_on_the_lm_stream_equal_direct_scores_of_each_tasks_end():
    steps = 3
    stream = LMTaskStream(design={"windows_per_task": 16}, num_tasks=3, steps_per_task=steps, seed=1, **SMALL)
    copies, metrics = EndOfTaskCopies(steps), TaskMetrics(stability_tasks=2, probe_steps=3, probe_lr=3e-3)
    L.seed_everything(0)
    trainer = L.Trainer(max_epochs=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[copies, metrics])
    module = GPTLightningModule({"n_layer": 1, "n_embd": 32, "n_head": 2, "n_kv_head": 2, "sequence_len": 16},
                                {"schedule": "constant"})
    trainer.fit(module, datamodule=stream)
    assert [row["task"] for row in metrics.history] == [0, 1, 2]
    for row, model in zip(metrics.history, copies.ends):
        x, y = stream.eval_data(row["task"])
        with torch.no_grad():
            logits = model(x)
        last = logits[:, -1]  # only the last byte of each window is a target
        assert row["accuracy"] == pytest.approx(float((last.argmax(-1) == y[:, -1]).float().mean()))
        assert row["loss"] == pytest.approx(float(F.cross_entropy(last, y[:, -1])), rel=1e-5)
        if row["task"]:
            earlier = range(max(0, row["task"] - 2), row["task"])
            with torch.no_grad():
                retained = [float((model(stream.eval_data(j)[0])[:, -1].argmax(-1) == stream.eval_data(j)[1][:, -1])
                                  .float().mean()) for j in earlier]
            assert row["retained_accuracy"] == pytest.approx(sum(retained) / len(retained))
        assert 0 <= row["online_accuracy"] <= 1  # the module now returns its accuracy
        probe = copy.deepcopy(model).train()  # the probe by hand: full-batch Adam on the last bytes only
        px, py = stream.probe_data()
        optimizer = torch.optim.Adam(probe.parameters(), lr=3e-3)
        for _ in range(3):
            optimizer.zero_grad()
            F.cross_entropy(probe(px)[:, -1], py[:, -1]).backward()
            optimizer.step()
        with torch.no_grad():
            expected = float((probe(px)[:, -1].argmax(-1) == py[:, -1]).float().mean())
        assert row["probe_accuracy"] == pytest.approx(expected)
    assert (stream.probe_data()[1][:, :-1] == IGNORE_INDEX).all()
