"""The callbacks inside a Hugging Face ``transformers.Trainer`` (tiny random-init GPT-2, CPU, a few steps).

Each test checks the effect against an independent computation: FIRE's Q/K/V blocks against the
float64 SVD polar factor of the weights just before, DASH's rows against the cosine rule computed
here, ReDo's dormant fraction against neurons made dead by hand, and a resumed run against an
uninterrupted one.
"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments  # noqa: E402

from plasticity_callbacks.callbacks.dash_periodic import DASHPeriodic  # noqa: E402
from plasticity_callbacks.callbacks.fire import FIREReinit  # noqa: E402
from plasticity_callbacks.callbacks.redo import ReDoMonitor  # noqa: E402
from plasticity_callbacks.callbacks.schedule import Schedule  # noqa: E402
from plasticity_callbacks.integrations.hf import STATE_FILE, HFTrainerCallback  # noqa: E402

D = 32  # n_embd


def tiny_gpt2(seed: int = 0) -> GPT2LMHeadModel:
    torch.manual_seed(seed)
    return GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=D, n_head=2, vocab_size=64, n_positions=16))


def token_data(n: int = 48, seed: int = 1) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [{"input_ids": (ids := torch.randint(0, 64, (16,), generator=g)), "labels": ids} for _ in range(n)]


def make_trainer(tmp_path, model, *callbacks, max_steps: int = 4, save_steps: int = 100, **adapter_kwargs) -> Trainer:
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=max_steps, per_device_train_batch_size=4,
                             learning_rate=1e-3, report_to=[], save_steps=save_steps, logging_steps=1, use_cpu=True,
                             disable_tqdm=True, seed=0, data_seed=0)
    trainer = Trainer(model=model, args=args, train_dataset=token_data())
    plastic = [c for c in callbacks if not isinstance(c, TrainerCallback)]
    probes = [c for c in callbacks if isinstance(c, TrainerCallback)]
    for probe in probes[:1]:  # a probe that records the state before the adapter acts
        trainer.add_callback(probe)
    trainer.add_callback(HFTrainerCallback(*plastic, trainer=trainer, **adapter_kwargs))
    for probe in probes[1:]:  # and one that reads it after
        trainer.add_callback(probe)
    return trainer


class Snapshot(TrainerCallback):
    """Copies the named weights (and which have optimizer state) in ``hook`` at ``step``."""

    def __init__(self, hook: str, step: int, names: list[str]):
        self.step, self.names, self.weights, self.has_state, self.grads = step, names, {}, {}, {}
        setattr(self, hook, self._record)

    def _record(self, args, state, control, model=None, optimizer=None, **kwargs):
        if state.global_step != self.step or self.weights:
            return
        params = dict(model.named_parameters())
        inner = getattr(optimizer, "optimizer", optimizer)
        for name in self.names:
            self.weights[name] = params[name].detach().double().clone()
            self.has_state[name] = bool(inner.state.get(params[name]))
        self.grads = {n: params[n].grad.detach().double().clone() for n in self.names if params[n].grad is not None}


def polar(w: torch.Tensor) -> torch.Tensor:
    u, _, vh = torch.linalg.svd(w, full_matrices=False)
    return u @ vh


def test_fire_at_a_step_makes_qkv_blocks_isometric_and_resets_their_optimizer_state(tmp_path):
    attn = "transformer.h.1.attn.c_attn.weight"  # GPT-2's fused Conv1D (d_in, 3·d_out): Q, K, V side by side
    names = [attn, "transformer.h.1.attn.c_proj.weight", "transformer.h.1.mlp.c_fc.weight"]
    before, after = Snapshot("on_step_begin", 2, names), Snapshot("on_step_begin", 2, names)
    fire = FIREReinit(schedule=Schedule(steps=[2]), selection={"scope": "attention"})
    make_trainer(tmp_path, tiny_gpt2(), before, fire, after, max_steps=3).train()

    for block in range(3):  # each of Q, K, V is its own nearest isometry (square: scale 1)
        cols = slice(block * D, (block + 1) * D)
        expected = polar(before.weights[attn][:, cols])
        torch.testing.assert_close(after.weights[attn][:, cols], expected, atol=2e-4, rtol=0)
    fused = polar(before.weights[attn])  # one polar factor of the fused matrix is not what FIRE computes
    assert (after.weights[attn] - fused).abs().max() > 1e-2
    proj = "transformer.h.1.attn.c_proj.weight"
    torch.testing.assert_close(after.weights[proj], polar(before.weights[proj]), atol=2e-4, rtol=0)
    mlp = "transformer.h.1.mlp.c_fc.weight"
    torch.testing.assert_close(after.weights[mlp], before.weights[mlp], atol=0, rtol=0)  # scope="attention"
    assert before.has_state == {attn: True, proj: True, mlp: True}
    assert after.has_state == {attn: False, proj: False, mlp: True}  # exactly the treated weights reset
    assert [h["global_step"] for h in fire.history] == [2]


def test_dash_rows_and_redo_dead_neurons_in_the_trainer_log(tmp_path):
    model = tiny_gpt2()
    dead = [3, 17, 40]  # three hidden units of block 0 that never fire: zero incoming weights, bias far below 0
    with torch.no_grad():
        model.transformer.h[0].mlp.c_fc.weight[:, dead] = 0.0
        model.transformer.h[0].mlp.c_fc.bias[dead] = -30.0
    proj = "transformer.h.1.attn.c_proj.weight"
    before, after = Snapshot("on_pre_optimizer_step", 2, [proj]), Snapshot("on_pre_optimizer_step", 2, [proj])
    alpha, rate, floor = -1.0, 0.1, 0.5  # alpha=-1: every row is shrunk a little, by its own cosine
    dash = DASHPeriodic(schedule=Schedule(steps=[2]), cosine_threshold=alpha, shrink_rate=rate, min_factor=floor,
                        selection={"scope": "attention", "include": ["*.1.attn.c_proj.*"]}, shrink_bias=False)
    redo = ReDoMonitor(collect_every_n_steps=1, log_every_n_steps=2)
    trainer = make_trainer(tmp_path, model, before, dash, redo, after, max_steps=4)
    trainer.train()

    # DASH, computed here: Conv1D stores W transposed, a row (output unit) is a column of the stored weight.
    w, g = before.weights[proj].T, before.grads[proj].T
    cos = torch.nn.functional.cosine_similarity(w, g, dim=1)
    factor = (1 - rate * (cos - alpha).clamp_min(0)).clamp(floor, 1)
    torch.testing.assert_close(after.weights[proj].T, w * factor[:, None], atol=1e-6, rtol=1e-5)
    assert factor.min() < 0.95  # the test sees a real shrink, not factors of one

    logged = [h for h in trainer.state.log_history if "redo/dormant" in h]
    assert [h["step"] for h in logged] == [2, 4]
    width = 4 * D
    for h in logged:
        assert h["redo/dormant/transformer.h.0.mlp"] == pytest.approx(len(dead) / width)
        assert h["redo/dormant/transformer.h.1.mlp"] == 0.0
    shrinks = [h for h in trainer.state.log_history if "dash_periodic/shrinks" in h]
    assert [(h["step"], h["dash_periodic/shrinks"]) for h in shrinks] == [(2, 1.0)]


def test_resume_from_a_trainer_checkpoint_continues_the_schedule(tmp_path):
    def run(output, resume=None):
        fire = FIREReinit(schedule=Schedule(steps=[2, 3, 5]), selection={"scope": "attention"})
        trainer = make_trainer(output, tiny_gpt2(), fire, max_steps=6, save_steps=3)
        trainer.train(resume_from_checkpoint=resume)
        return fire, trainer

    whole, whole_trainer = run(tmp_path / "whole")
    assert (tmp_path / "whole" / "checkpoint-3" / STATE_FILE).is_file()
    # The checkpoint at step 3 is written after step 2's application and before step 3's.
    resumed, resumed_trainer = run(tmp_path / "whole", resume=str(tmp_path / "whole" / "checkpoint-3"))
    fired = [h["global_step"] for h in resumed.history]
    assert fired == [h["global_step"] for h in whole.history] == [2, 3, 5]  # none repeated, none skipped
    logged = [h["step"] for h in resumed_trainer.state.log_history if "fire/applications" in h]
    assert logged == [2, 3, 5]  # the history up to step 3 comes from the checkpoint, then 3 and 5 logged anew
    for (name, a), b in zip(whole_trainer.model.named_parameters(), resumed_trainer.model.parameters()):
        torch.testing.assert_close(a, b, msg=name)


def test_a_resume_without_the_callback_state_says_where_it_looked(tmp_path):
    plain = Trainer(model=tiny_gpt2(), args=TrainingArguments(
        output_dir=str(tmp_path), max_steps=2, save_steps=2, per_device_train_batch_size=4, report_to=[],
        use_cpu=True, disable_tqdm=True), train_dataset=token_data())
    plain.train()  # a checkpoint written without the adapter
    trainer = make_trainer(tmp_path, tiny_gpt2(), FIREReinit(schedule=Schedule(steps=[3])), max_steps=4)
    with pytest.raises(FileNotFoundError, match=r"resumes at global step 2, but .*checkpoint-2/" + STATE_FILE):
        trainer.train(resume_from_checkpoint=str(tmp_path / "checkpoint-2"))


def test_the_adapter_refuses_what_is_not_a_callback():
    with pytest.raises(TypeError, match="got Linear"):
        HFTrainerCallback(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="at least one callback"):
        HFTrainerCallback()
