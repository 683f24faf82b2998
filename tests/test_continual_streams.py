"""The digits task streams are what they claim: labels re-drawn per task, pixels permuted, subsets
nested, batches a function of (seed, step), boundaries where tasks change."""
import pytest
import torch

pytest.importorskip("sklearn")

from plasticity_callbacks.data.digits import (  # noqa: E402
    FreshRandomLabelDigits, PermutedDigits, RandomLabelDigits, StreamBatches, WarmStartDigits, load_digits_tensors,
)


@pytest.fixture(scope="module")
def digits():
    return load_digits_tensors()


def row_index(images: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Index in ``images`` of each row of ``rows`` (exact match; the digits have duplicates, any match will do)."""
    where = {row.numpy().tobytes(): i for i, row in enumerate(images)}
    keys = [row.numpy().tobytes() for row in rows]
    assert all(k in where for k in keys), "a row is not one of the digits"
    return torch.tensor([where[k] for k in keys])


def test_digits_are_standardized(digits):
    x, y = digits
    assert x.shape == (1797, 64) and y.shape == (1797,) and set(y.tolist()) == set(range(10))
    varying = x.std(0) > 0
    torch.testing.assert_close(x.mean(0), torch.zeros(64), atol=1e-5, rtol=0)
    torch.testing.assert_close(x.std(0)[varying], torch.ones(int(varying.sum())), atol=1e-4, rtol=0)


def test_random_labels_are_redrawn_per_task(digits):
    stream = RandomLabelDigits(num_tasks=3, steps_per_task=5, batch_size=32, samples_per_task=600, seed=0)
    tasks = [stream.task(t) for t in range(3)]
    for task in tasks:
        assert task.train_x.shape == (600, 64) and task.train_y.shape == (600,)
        assert torch.equal(task.eval_x, task.train_x) and torch.equal(task.eval_y, task.train_y)  # memorization
        rows = row_index(digits[0], task.train_x)
        # Random labels: they agree with the true digit about one time in ten, not always.
        assert (task.train_y == digits[1][rows]).float().mean() < 0.2
        assert 0.05 < (task.train_y == 3).float().mean() < 0.15  # all ten classes drawn
    assert (tasks[0].train_y != tasks[1].train_y).float().mean() > 0.7
    assert not torch.equal(tasks[0].train_x, tasks[1].train_x)  # other images, too


def test_permuted_digits_apply_one_permutation_per_task(digits):
    stream = PermutedDigits(num_tasks=2, steps_per_task=5, batch_size=32, held_out_fraction=0.25, seed=1)
    for t in range(2):
        task, perm = stream.task(t), stream.permutation(t)
        assert sorted(perm.tolist()) == list(range(64)) and not torch.equal(perm, torch.arange(64))
        inverse = torch.argsort(perm)
        unpermuted = torch.cat([task.train_x, task.eval_x])[:, inverse]
        rows = row_index(digits[0], unpermuted)
        assert torch.equal(torch.cat([task.train_y, task.eval_y]), digits[1][rows])  # true labels
        assert len(task.eval_y) == round(0.25 * 1797) and len(task.train_y) + len(task.eval_y) == 1797
    assert not torch.equal(stream.permutation(0), stream.permutation(1))
    # The same held-out images in every task (only the pixel order changes).
    a, b = stream.task(0), stream.task(1)
    unpermuted = [t.eval_x[:, torch.argsort(stream.permutation(i))] for i, t in enumerate((a, b))]
    assert torch.equal(*unpermuted)


def test_fresh_images_are_never_seen_twice_and_their_labels_are_random(digits):
    stream = FreshRandomLabelDigits(num_tasks=20, steps_per_task=5, batch_size=32, samples_per_task=89, seed=3)
    tasks = [stream.task(t) for t in range(20)]
    # read back from the pixels, not from the stream's own index: the digits have no exact duplicate rows
    rows = [set(row_index(digits[0], task.train_x).tolist()) for task in tasks]
    assert all(len(r) == 89 for r in rows) and len(set().union(*rows)) == 20 * 89  # pairwise disjoint
    labels = torch.cat([task.train_y for task in tasks])
    true = digits[1][torch.cat([row_index(digits[0], task.train_x) for task in tasks])]
    assert 0.05 < (labels == true).float().mean() < 0.15  # random: right about one time in ten
    counts = torch.bincount(labels, minlength=10).float()
    assert counts.min() > 0.6 * counts.mean() and counts.max() < 1.4 * counts.mean()  # every class drawn
    for task in tasks:
        assert torch.equal(task.eval_x, task.train_x) and torch.equal(task.eval_y, task.train_y)  # memorization
    # another seed: other blocks of other images, other labels
    other = FreshRandomLabelDigits(num_tasks=20, steps_per_task=5, batch_size=32, samples_per_task=89, seed=4)
    assert rows[0] != set(row_index(digits[0], other.task(0).train_x).tolist())
    with pytest.raises(ValueError, match="1800 fresh images, more than the 1797 digits; at most 89"):
        FreshRandomLabelDigits(num_tasks=20, samples_per_task=90)


def test_the_split_seed_moves_the_held_out_split_and_nothing_else(digits):
    def held(stream):
        return set(row_index(digits[0], stream.task(0).eval_x[:, torch.argsort(stream.permutation(0))]).tolist())

    own = PermutedDigits(num_tasks=2, steps_per_task=3, batch_size=32, seed=0)
    assert held(own) == held(PermutedDigits(num_tasks=2, steps_per_task=3, batch_size=32, seed=0, split_seed=0))
    moved = PermutedDigits(num_tasks=2, steps_per_task=3, batch_size=32, seed=0, split_seed=5)
    assert len(held(moved) & held(own)) < 0.4 * len(held(own))  # another split (a fifth overlaps by chance)
    assert torch.equal(moved.permutation(1), own.permutation(1))  # the same permutations
    assert not torch.equal(StreamBatches(moved)[0][0], StreamBatches(own)[0][0])  # other training images
    # the split follows split_seed alone: another init seed on split 5 holds out the same images
    assert held(PermutedDigits(num_tasks=2, steps_per_task=3, batch_size=32, seed=9, split_seed=5)) == held(moved)
    with pytest.raises(ValueError, match="data.split_seed='a' must be an integer or null"):
        PermutedDigits(split_seed="a")


def test_warm_start_subsets_are_nested_and_share_the_held_out_split(digits):
    stream = WarmStartDigits(fractions=[0.1, 0.5, 1.0], steps_per_task=5, batch_size=16, seed=2)
    tasks = [stream.task(t) for t in range(3)]
    sizes = [len(t.train_y) for t in tasks]
    assert sizes[0] == round(0.1 * sizes[2]) and sizes[1] == round(0.5 * sizes[2]) and stream.num_tasks == 3
    for small, large in zip(tasks, tasks[1:]):
        assert torch.equal(large.train_x[: len(small.train_y)], small.train_x)  # each subset contains the previous
        assert torch.equal(large.eval_x, small.eval_x)
    train_rows = set(row_index(digits[0], tasks[2].train_x).tolist())
    held_rows = set(row_index(digits[0], tasks[2].eval_x).tolist())
    assert sizes[2] + len(tasks[2].eval_y) == 1797 and len(train_rows & held_rows) < 5  # duplicates only


def test_boundaries_and_batches_follow_the_tasks():
    stream = RandomLabelDigits(num_tasks=4, steps_per_task=7, batch_size=64, samples_per_task=200, seed=0)
    assert stream.task_boundary_steps == [7, 14, 21] and stream.total_steps == 28
    batches = StreamBatches(stream)
    assert len(batches) == 28
    for step in (0, 6, 7, 20, 27):
        x, y = batches[step]
        task = stream.task(stream.task_at(step))
        assert x.shape == (64, 64) and y.shape == (64,)
        rows = row_index(task.train_x, x)
        assert torch.equal(task.train_y[rows], y)  # every row comes from this step's task, with its label
    # Within a task the batches walk through epochs: one epoch (3 batches of 64 of 200) has no repeats.
    epoch = torch.cat([row_index(stream.task(0).train_x, batches[s][0]) for s in range(3)])
    assert len(set(epoch.tolist())) == 192


@pytest.mark.parametrize("make", [
    lambda seed: RandomLabelDigits(num_tasks=2, steps_per_task=3, batch_size=32, samples_per_task=100, seed=seed),
    lambda seed: PermutedDigits(num_tasks=2, steps_per_task=3, batch_size=32, seed=seed),
    lambda seed: FreshRandomLabelDigits(num_tasks=2, steps_per_task=3, batch_size=32, samples_per_task=89, seed=seed),
    lambda seed: WarmStartDigits(fractions=[0.1, 1.0], steps_per_task=3, batch_size=32, seed=seed),
])
def test_streams_are_deterministic_per_seed(make):
    def fingerprint(stream):
        batches = StreamBatches(stream)
        return [batches[s] for s in range(stream.total_steps)] + [stream.eval_data(t) for t in range(stream.num_tasks)]

    first, again, other = fingerprint(make(0)), fingerprint(make(0)), fingerprint(make(1))
    for (xa, ya), (xb, yb) in zip(first, again):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
    assert any(not torch.equal(xa, xc) for (xa, _), (xc, _) in zip(first, other))


def test_loader_starts_at_the_current_step():
    """A new iterator (a resumed fit, or DASH's pass over the new task's data) starts where training is."""
    stream = RandomLabelDigits(num_tasks=2, steps_per_task=4, batch_size=32, samples_per_task=100, seed=0)

    class Clock:
        global_step, global_rank, world_size, accumulate_grad_batches = 0, 0, 1, 1

    clock = Clock()
    stream.trainer = clock
    loader = stream.train_dataloader()
    assert len(loader) == 8
    clock.global_step = 5
    x, y = next(iter(loader))
    expected = StreamBatches(stream)[5]
    assert torch.equal(x, expected[0]) and torch.equal(y, expected[1])
    assert sum(1 for _ in loader) == 3


@pytest.mark.parametrize("kwargs,match", [
    (dict(num_tasks=0), "num_tasks"),
    (dict(steps_per_task=2.5), "steps_per_task"),
    (dict(samples_per_task=5000), "samples_per_task"),
    (dict(seed="a"), "seed"),
])
def test_bad_stream_arguments_name_the_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        RandomLabelDigits(**kwargs)


def test_bad_fractions_and_too_large_batches_are_refused():
    with pytest.raises(ValueError, match="fractions"):
        WarmStartDigits(fractions=[0.5, 0.2])
    with pytest.raises(ValueError, match="batch_size"):
        RandomLabelDigits(samples_per_task=50, batch_size=64).task(0)


def test_ranks_share_each_batch_and_an_uneven_split_is_refused():
    stream = RandomLabelDigits(num_tasks=2, steps_per_task=4, batch_size=12, samples_per_task=100, seed=0)
    whole = StreamBatches(stream)
    shares = [StreamBatches(stream, rank, 3) for rank in range(3)]
    for step in (0, 5):
        x, y = whole[step]
        for rank, share in enumerate(shares):  # rank r: rows r, r+3, ... of the step's batch
            xs, ys = share[step]
            assert torch.equal(xs, x[rank::3]) and torch.equal(ys, y[rank::3])

    class Ranks:
        global_step, global_rank, world_size, accumulate_grad_batches = 0, 0, 5, 1

    stream.trainer = Ranks()
    with pytest.raises(ValueError, match="batch_size=12 does not split evenly over 5 ranks"):
        stream.setup("fit")
