"""What a run shows: figures a reader can read, one line for a FIRE on fresh weights, logs that reach train.log."""
import logging
import warnings

import lightning as L
import torch

from plasticity_callbacks import FIREReinit
from plasticity_callbacks.callbacks.adaptive_svd import modes_figure
from plasticity_callbacks.callbacks.fire import spectra_figure
from plasticity_callbacks.functional.isometry import FireRecord
from plasticity_callbacks.models import GPTLightningModule


def record(name: str, n: int = 6) -> FireRecord:
    before = torch.rand(n).sort(descending=True).values + 0.1
    return FireRecord(name, (n, n), spectrum_before=before, spectrum_after=torch.ones(n))


def test_spectra_figure_has_a_panel_per_kind_of_weight_and_a_block_colorbar():
    names = [f"model.blocks.{b}.{kind}.weight" for b in range(4) for kind in ("attn.c_q", "attn.c_proj", "mlp.c_fc")]
    fig = spectra_figure([record(n) for n in names], "FIRE at fit_start")
    panels = [ax for ax in fig.axes if ax.get_visible() and ax.get_title()]
    assert sorted(ax.get_title() for ax in panels) == ["attn.c_proj", "attn.c_q", "mlp.c_fc"]
    assert all(len(ax.lines) == 8 for ax in panels)  # 4 blocks × before/after
    colorbar = [ax for ax in fig.axes if ax.get_ylabel() == "index in model.blocks"]
    assert len(colorbar) == 1 and list(colorbar[0].get_yticks()) == [0, 1, 2, 3]
    assert {text.get_text() for legend in fig.legends for text in legend.get_texts()} == {"before", "after"}
    assert all(ax.get_ylabel() == "singular value" for ax in panels if ax.get_subplotspec().is_first_col())


def test_spectra_figure_of_a_sequential_colours_its_layers_and_keeps_the_legend_off_the_title():
    names = ["net.0.weight", "net.2.weight", "net.4.weight"]  # an nn.Sequential: layers, not blocks
    fig = spectra_figure([record(n) for n in names], "FIRE at fit start (step 0): singular values of each treated "
                                                     "weight, a title long enough to reach the legend")
    panels = [ax for ax in fig.axes if ax.get_visible() and ax.get_title()]
    assert [ax.get_title() for ax in panels] == ["net"] and len(panels[0].lines) == 6
    assert [ax.get_ylabel() for ax in fig.axes if ax not in panels] == ["index in net"]
    fig.canvas.draw()
    title = fig._suptitle.get_window_extent()
    legend = fig.legends[0].get_window_extent()
    assert not title.overlaps(legend) and legend.y1 < title.y0


def test_modes_figure_colours_low_rank_cells_by_r_over_g_and_writes_r():
    history = [(10, "a", "minor", 4), (10, "b", "full", 8), (20, "a", "minor", 2), (20, "b", "minor", 8)]
    fig = modes_figure(history, {"a": 16, "b": 32})
    ax = fig.axes[0]
    mesh = ax.collections[0].get_array()
    assert mesh.mask.tolist() == [[False, False], [True, False]]  # b at step 10 trained in full: grey
    assert mesh.compressed().tolist() == [4 / 16, 2 / 16, 8 / 32]
    assert sorted(t.get_text() for t in ax.texts) == ["2", "4", "8"]
    assert "r / g" in fig.axes[1].get_ylabel() and ax.get_xlabel().startswith("optimizer step")


def test_fire_on_fresh_zero_initialized_weights_is_one_line_no_warnings(caplog):
    module = GPTLightningModule({"n_layer": 2, "n_embd": 32, "n_head": 2, "n_kv_head": 2, "sequence_len": 16,
                                 "vocab_size": 64})
    zero = [n for n, p in module.named_parameters() if "blocks" in n and p.dim() == 2 and not p.any()]
    assert len(zero) == 4  # the attention and MLP output projections of 2 blocks
    fire = FIREReinit()  # at fit start
    trainer = L.Trainer(max_steps=0, logger=False, enable_checkpointing=False, enable_progress_bar=False)
    trainer.strategy.connect(module)
    with warnings.catch_warnings(record=True) as caught, caplog.at_level(logging.INFO):
        warnings.simplefilter("always")
        fire.act_if("fit start", trainer, module)
    assert not [w for w in caught if "zero" in str(w.message)]
    lines = [r.getMessage() for r in caplog.records if "FIREReinit" in r.getMessage()]
    assert len(lines) == 1 and "left 4 weights unchanged: 4 all zero" in lines[0]
    assert all(not dict(module.named_parameters())[n].any() for n in zero)  # left as they were


def test_lightning_messages_reach_the_root_handlers_once(tmp_path):
    from lightning.pytorch.utilities import rank_zero_info

    from plasticity_callbacks.app.console import configure_run_output

    root = logging.getLogger()
    handler = logging.FileHandler(tmp_path / "train.log")
    root.addHandler(handler)
    saved = {name: (logging.getLogger(name).propagate, list(logging.getLogger(name).handlers))
             for name in ("lightning", "lightning.pytorch", "lightning.fabric")}
    try:
        configure_run_output()
        rank_zero_info("our own message")  # from this file: always shown
        for _ in range(2):  # Lightning's own notice, as every phase's Trainer logs it
            L.Trainer(logger=False, enable_checkpointing=False, enable_progress_bar=False, accelerator="cpu")
    finally:
        root.removeHandler(handler)
        handler.close()
        for name, (propagate, handlers) in saved.items():
            logging.getLogger(name).propagate, logging.getLogger(name).handlers = propagate, handlers
    text = (tmp_path / "train.log").read_text()
    assert "our own message" in text
    assert text.count("GPU available") == 1, text


def test_a_sweep_ends_by_saying_where_its_runs_are(caplog, tmp_path):
    from omegaconf import OmegaConf

    from plasticity_callbacks.app.console import SweepOutputs

    with caplog.at_level(logging.INFO):
        SweepOutputs().on_multirun_end(OmegaConf.create({"hydra": {"sweep": {"dir": str(tmp_path / "sweep")}}}))
    assert f"plasticity-report {tmp_path / 'sweep'}" in caplog.text


def test_step_lines_print_one_plain_line_per_n_steps_and_at_the_last(caplog):
    from tiny import TinyMLPModule, cpu_trainer, regression_loader

    from plasticity_callbacks.app.progress import StepLines

    class LossOnTheBar(TinyMLPModule):
        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            self.log("bar/loss", loss, prog_bar=True)
            return loss

    lines = StepLines("pretrain", every_n_steps=4)
    trainer = cpu_trainer(max_steps=10, callbacks=[lines], enable_progress_bar=True, limit_val_batches=0)
    with caplog.at_level(logging.INFO):
        trainer.fit(LossOnTheBar(), regression_loader())
    printed = [r.getMessage() for r in caplog.records if r.getMessage().startswith("pretrain: step")]
    assert [line.split(",")[0] for line in printed] == ["pretrain: step 4/10 (40 %)", "pretrain: step 8/10 (80 %)",
                                                        "pretrain: step 10/10 (100 %)"]
    assert all(" s a step, bar/loss " in line and "\r" not in line and "v_num" not in line for line in printed)


def test_step_lines_replace_the_bar_only_when_stdout_is_not_a_terminal(monkeypatch):
    import io
    import sys

    import pytest

    from plasticity_callbacks.app.progress import StepLines, progress_callbacks

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    monkeypatch.setattr(sys, "stdout", io.StringIO())  # a file or a pipe
    assert [type(c) for c in progress_callbacks({})] == [StepLines]
    assert progress_callbacks({"enable_progress_bar": False}) == []  # no progress at all, as configured
    monkeypatch.setattr(sys, "stdout", Terminal())
    assert progress_callbacks({"enable_progress_bar": True}) == []  # Lightning's own bar
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match="every_n_steps"):
            StepLines(every_n_steps=bad)


def test_redo_announces_its_layers_once_across_validate_fit_validate(caplog):
    from tiny import TinyMLPModule, cpu_trainer, regression_loader

    from plasticity_callbacks import ReDoMonitor

    redo, module = ReDoMonitor(log_every_n_steps=1), TinyMLPModule()
    trainer = cpu_trainer(max_steps=2, callbacks=[redo], limit_val_batches=1)
    with caplog.at_level(logging.INFO):
        trainer.validate(module, regression_loader())  # as a pipeline phase runs: validate, fit, validate
        trainer.fit(module, regression_loader(), regression_loader())
        trainer.validate(module, regression_loader())
    assert sum("ReDoMonitor watches" in r.getMessage() for r in caplog.records) == 1
