"""FSDP2 (Lightning's ModelParallelStrategy, 2 CPU ranks over gloo): FIRE, ReDo, DASH (both rules), Shrink &
Perturb, FullReset, WeightClip, L2Init, HareTortoise, ContinualBackprop and AdaptiveSVDSwitch (projection) on
sharded weights equal them on one process over the same global batches, and so do TaskMetrics' per-task metrics
on a digits stream and GateLogger's gates of the GPT's reciprocal blocks; a killed run resumes to the
uninterrupted weights and callback state; ``plasticity-train trainer=fsdp2`` runs the GPT end to end; every
other strategy or callback that cannot act on shards refuses at setup with the fix.

The 2-rank runs share one launch (``fsdp2_runs``): starting a process group and Lightning costs more than
the few steps each run trains.
"""
from __future__ import annotations

import math
import os
from types import SimpleNamespace

import pytest
import torch

from fsdp_harness import assert_close, assert_same_as_single, run_fsdp2, run_single
from plasticity_callbacks.functional.isometry import FireRecord

FIRE = {"_target_": "plasticity_callbacks.FIREReinit", "schedule": {"steps": [2]}, "options": {"method": "svd"}}
# The authors' LM recipe (method/fire_lm.yaml): 5 Newton–Schulz steps, a partial orthogonalization.
FIRE_NS = dict(FIRE, options={"method": "newton_schulz", "normalize": "frobenius", "steps": 5})
REDO = {"_target_": "plasticity_callbacks.ReDoMonitor", "tau": 1.0, "collect_every_n_steps": 1, "log_every_n_steps": 1,
        "schedule": {"every_n_steps": 2}}
DASH = {"_target_": "plasticity_callbacks.DASHShrink", "n_batches": 3, "min_factor": 0.3}
# cos(W, g) ≥ -1: every row shrinks, by its own factor 1 − 0.5·(cos + 1) (floored at 0.1)
DASH_PERIODIC = {"_target_": "plasticity_callbacks.DASHPeriodic", "schedule": {"steps": [2]}, "cosine_threshold": -1.0,
                 "shrink_rate": 0.5, "min_factor": 0.1}
SHRINK_PERTURB = {"_target_": "plasticity_callbacks.ShrinkPerturb", "shrink": 0.5, "perturb": 0.3,
                  "schedule": {"steps": [2]}, "reset_optimizer": True, "seed": 3}
# val/loss never improves by 1e9 (mode max): the second validation is a plateau, and the only one acted on
AT_SECOND_VALIDATION = {"monitor": "val/loss", "mode": "max", "min_delta": 1e9, "patience": 1, "max_plateau_fires": 1}
METRICS = {"_target_": "plasticity_callbacks.callbacks.task_metrics.TaskMetrics", "probe_steps": 3, "probe_lr": 1e-2,
           "stability_tasks": 1, "grad_norm_every_n_steps": 1}
L2_INIT = {"_target_": "plasticity_callbacks.L2Init", "strength": 0.5}
MONITOR = {"_target_": "plasticity_callbacks.PlasticityMonitor", "activations_every_n_steps": 1,
           "weights_every_n_steps": 1, "spectra_every_n_steps": 1, "plot": False}
# η = 0.5: the tortoise moves visibly in a few steps; reset at step 2 with the optimizer state dropped
HARE_TORTOISE = {"_target_": "plasticity_callbacks.HareTortoise", "decay": 0.5, "schedule": {"steps": [2]},
                 "reset_optimizer": True}
# mature after one step, a fifth of the mature units replaced per step: units are replaced from step 2 on
CBP = {"_target_": "plasticity_callbacks.ContinualBackprop", "replacement_rate": 0.2, "maturity_threshold": 1,
       "seed": 7}
# Resumed with FIRE below: the three methods' state goes through the checkpoint, acting on both sides of it.
STATEFUL = [L2_INIT, dict(HARE_TORTOISE, schedule={"steps": [2, 5]}), CBP]
# Every matrix goes "minor" at each cycle (clobber_alignment 0: any principal share of the gradient), so from
# step 2 on each trains only its r minor left singular directions; r from the spectrum, then grown or shrunk.
SVD = {"_target_": "plasticity_callbacks.AdaptiveSVDSwitch", "schedule": {"steps": [2, 4]}, "r_min": 2,
       "thresholds": {"clobber_alignment": 0.0}, "save_figure": False}
# Linear rows sharded unevenly (15 rows: 8 and 7), in epochs of 3 steps (the resume below stops at a boundary)
SVD_MLP = {"model": "mlp", "hidden": 15, "optimizer": "sgd", "steps": 6, "epoch_steps": 3, "callbacks": [SVD]}
# GPT-2's epochs are 8 steps (the model zoo's 64 samples): a resume at step 8, a cycle after it at step 9
SVD_GPT2 = {"model": "gpt2", "optimizer": "sgd", "steps": 10,
            "callbacks": [dict(SVD, initial_rank=6, schedule={"steps": [2, 9]})]}
RUNS = [
    # Linear rows sharded: a tall (16×8) and a square (16×16) matrix, Gram route.
    {"name": "fire_mlp", "model": "mlp", "steps": 3, "callbacks": [FIRE]},
    # GPT-2's Conv1D stored (in, out): c_attn's Q/K/V blocks are column sets of each rank's rows (Gram route on
    # X = Wᵀ), c_fc is wide in that orientation (gathered), c_proj is tall (Gram route).
    {"name": "fire_gpt2", "model": "gpt2", "optimizer": "sgd", "steps": 3, "callbacks": [FIRE]},
    # nn.MultiheadAttention's in_proj (48×16): rank 0 holds rows 0..23, so the K block (16..31) is split across ranks.
    {"name": "fire_encoder", "model": "torch_encoder", "optimizer": "sgd", "steps": 3, "callbacks": [FIRE]},
    # A fixed Newton–Schulz count stops short of the polar factor: every block gathered and iterated as on one
    # process (Linear rows; GPT-2's Conv1D with its fused Q/K/V blocks).
    {"name": "fire_ns_mlp", "model": "mlp", "steps": 3, "callbacks": [FIRE_NS]},
    {"name": "fire_ns_gpt2", "model": "gpt2", "optimizer": "sgd", "steps": 3, "callbacks": [FIRE_NS]},
    # The package's GPT sharded by its own configure_model, its head included, at fit start; AdamW's state of
    # the treated weights is reset at step 2 (lr = 0: Adam would turn the rounding noise of two gradient
    # reduction orders, on entries whose gradient is near zero, into lr-sized steps that differ).
    {"name": "fire_gpt", "model": "gpt", "lr": 0.0, "steps": 3,
     "callbacks": [dict(FIRE, schedule={"at_fit_start": True}, selection={"include_head": True})]},
    # ReDo: statistics all-reduced; recycled rows of each rank's shard of up (a fresh draw of the whole weight,
    # its rows kept), zero columns of down in every rank's rows, those slices' Adam/SGD moments.
    {"name": "redo_mlp", "model": "mlp", "steps": 4, "callbacks": [REDO]},
    {"name": "redo_gpt2", "model": "gpt2", "optimizer": "sgd", "steps": 4, "callbacks": [REDO]},
    # DASH, both rules: the paper's gradient pass (FSDP2's reduce-scattered gradients, each rank's EMA rows) at fit
    # start, then the per-step rule on .grad shards. Linear rows are local; GPT-2's Conv1D (stored (in, out)) holds
    # each neuron's row across ranks: gathered per matrix. The encoder's in_proj is a bare matrix split mid-block.
    {"name": "dash_mlp", "model": "mlp", "steps": 3, "callbacks": [DASH, DASH_PERIODIC]},
    {"name": "dash_gpt2", "model": "gpt2", "optimizer": "sgd", "steps": 3, "callbacks": [DASH, DASH_PERIODIC]},
    {"name": "dash_encoder", "model": "torch_encoder", "optimizer": "sgd", "steps": 3,
     "callbacks": [dict(DASH, selection={"include_head": True}), DASH_PERIODIC]},
    # Shrink & Perturb and FullReset: every rank draws the whole fresh model as one process does (same seed) and
    # keeps its rows; the package's GPT is drawn whole by its init_weights (lr = 0: only the callback moves it),
    # GPT-2 by Hugging Face's _init_weights, the MLP layer by layer with AdamW's state dropped.
    {"name": "sp_mlp", "model": "mlp", "steps": 3, "callbacks": [SHRINK_PERTURB]},
    {"name": "sp_gpt", "model": "gpt", "lr": 0.0, "steps": 3, "callbacks": [SHRINK_PERTURB]},
    # Right after a validation (a plateau trigger at the second one, step 2): the evaluation left the root unit
    # (embeddings, head) gathered, and step 3 must compute with the shrunk weights, not that stale copy.
    # A pipeline phase after an FSDP2 phase carries the moments from its distributed checkpoint (0 steps: the
    # carried state is the result), under another learning rate.
    {"name": "carry_source", "model": "gpt", "steps": 2, "ckpt_every": 2, "distributed_checkpoint": True},
    {"name": "carry_target", "model": "gpt", "lr": 0.5, "steps": 0, "carry_from": "carry_source_2/ckpt/last.ckpt"},
    {"name": "sp_gpt_after_validation", "model": "gpt", "lr": 0.0, "steps": 3, "val_every": 1,
     "callbacks": [dict(SHRINK_PERTURB, schedule=AT_SECOND_VALIDATION)]},
    {"name": "reset_gpt2", "model": "gpt2", "optimizer": "sgd", "steps": 3,
     "callbacks": [{"_target_": "plasticity_callbacks.FullReset", "schedule": {"steps": [2]}, "seed": 5}]},
    # WeightClip: elementwise on each rank's shard, GPT-2's Conv1D bounded by its stored rows (κ small: entries clip).
    {"name": "clip_gpt2", "model": "gpt2", "optimizer": "sgd", "steps": 3,
     "callbacks": [{"_target_": "plasticity_callbacks.WeightClip", "kappa": 0.1}]},
    # L2Init, HareTortoise and ContinualBackprop: their state is sharded like the weights (L2Init's θ₀, the
    # tortoise) or whole on every rank (CBP's per-unit statistics). GPT-2's Conv1D (stored (in, out)): each rank
    # holds some inputs of every unit of c_fc and some units' outgoing rows of c_proj.
    {"name": "l2_mlp", "model": "mlp", "steps": 3, "callbacks": [L2_INIT]},
    {"name": "monitor_mlp", "model": "mlp", "steps": 3, "callbacks": [MONITOR]},
    {"name": "l2_gpt2", "model": "gpt2", "optimizer": "sgd", "lr": 0.1, "steps": 3,  # SGD: a strong pull to see
     "callbacks": [dict(L2_INIT, strength=5.0)]},
    {"name": "ht_mlp", "model": "mlp", "steps": 3, "callbacks": [HARE_TORTOISE]},
    {"name": "ht_gpt2", "model": "gpt2", "optimizer": "sgd", "steps": 3, "callbacks": [HARE_TORTOISE]},
    # The tortoise evaluated at step 2, the hare trained on and reset at step 3: FSDP2 keeps the root unit's
    # weights (GPT-2's embeddings) gathered after an evaluation forward, so a write to the shards must reshard.
    {"name": "ht_gpt2_val", "model": "gpt2", "optimizer": "sgd", "lr": 0.1, "steps": 4, "val_every": 2,
     "callbacks": [dict(HARE_TORTOISE, decay=0.9, schedule={"steps": [3]})]},
    {"name": "cbp_mlp", "model": "mlp", "steps": 4, "callbacks": [CBP]},
    {"name": "cbp_gpt2", "model": "gpt2", "optimizer": "sgd", "steps": 4, "callbacks": [CBP]},
    # 13 hidden units: rank 0 holds 7 rows, rank 1 six. The package GPT's relu² MLP (lr = 0: only CBP moves it).
    {"name": "cbp_mlp_uneven", "model": "mlp", "hidden": 13, "steps": 4, "callbacks": [CBP]},
    {"name": "cbp_gpt", "model": "gpt", "lr": 0.0, "steps": 3, "callbacks": [CBP]},
    # Phi-3's fused gate_up_proj: a unit is a row in each half, the halves on different ranks.
    {"name": "cbp_phi3", "model": "phi3", "optimizer": "sgd", "steps": 3, "callbacks": [CBP]},
    # The same three resumed from a full (one-file) checkpoint written at step 3 of the uninterrupted run.
    {"name": "state_full_reference", "model": "mlp", "steps": 6, "epoch_steps": 3, "ckpt_every": 3,
     "callbacks": STATEFUL},
    {"name": "state_full_resumed", "model": "mlp", "steps": 6, "epoch_steps": 3,
     "resume": "state_full_reference_2/ckpt/epoch=0-step=3.ckpt", "callbacks": STATEFUL},
    # AdaptiveSVDSwitch: Linear rows (U split by rows, the projection one all-reduce a step; the two matrices' SVDs
    # on different ranks) and GPT-2's Conv1D (each rank holds columns of the (out, in) view: U_m whole, a local
    # projection).
    {"name": "svd_mlp", **SVD_MLP},
    # AdamW: its exp_avg (a DTensor sharded like the weight) projected at each switch, as on one process.
    {"name": "svd_mlp_adamw", **dict(SVD_MLP, optimizer="adamw")},
    {"name": "svd_gpt2", **SVD_GPT2},
    # nn.MultiheadAttention's bare in_proj_weight (48 × 16, one matrix to AdaptiveSVD) and out_proj, the FFN.
    {"name": "svd_encoder", "model": "torch_encoder", "optimizer": "sgd", "steps": 7, "callbacks": [SVD]},
    # svd_mlp stopped after a distributed checkpoint (each rank writes its rows of U) and svd_gpt2 after a one-file
    # one (each U gathered whole), then resumed: each rank's rows placed again (Conv1D: its minor columns whole);
    # the projections and the next cycle (its angle to the saved U) use what was saved.
    {"name": "svd_mlp_stopped", **dict(SVD_MLP, steps=3), "ckpt_every": 3, "distributed_checkpoint": True},
    {"name": "svd_mlp_resumed", **SVD_MLP, "resume": "svd_mlp_stopped_2/ckpt/last.ckpt",
     "distributed_checkpoint": True},
    {"name": "svd_gpt2_stopped", **dict(SVD_GPT2, steps=8), "ckpt_every": 8},
    {"name": "svd_gpt2_resumed", **SVD_GPT2, "resume": "svd_gpt2_stopped_2/ckpt/last.ckpt"},
    # Resume: FIRE at steps 1 and 4, uninterrupted, and resumed from the crashed run's step-3 checkpoint (epochs of
    # 3 steps: the test's sampler keeps no position, so the crash falls on an epoch boundary).
    {"name": "resume_reference", "model": "mlp", "steps": 6, "epoch_steps": 3,
     "callbacks": [dict(FIRE, schedule={"steps": [1, 4]}), *STATEFUL]},
    {"name": "resume_resumed", "model": "mlp", "steps": 6, "epoch_steps": 3, "resume": "crashed_2/ckpt/last.ckpt",
     "distributed_checkpoint": True, "callbacks": [dict(FIRE, schedule={"steps": [1, 4]}), *STATEFUL]},
    # TaskMetrics on a digits task stream (each rank trains on half of every batch): online metrics averaged over
    # ranks, end-of-task metrics on the whole evaluation data on every rank, the probe trained on the shards.
    {"name": "metrics_digits", "model": "digits", "steps": 6,
     "stream": {"num_tasks": 2, "steps_per_task": 3, "batch_size": 16, "samples_per_task": 64, "seed": 0},
     "callbacks": [METRICS]},
    # The output layer in the root unit, which the evaluations leave gathered: the probe and the next steps must
    # see the shards (the probe trains, then restores, the head's rows).
    {"name": "metrics_digits_root_head", "model": "digits_root_head", "steps": 6,
     "stream": {"num_tasks": 2, "steps_per_task": 3, "batch_size": 16, "samples_per_task": 64, "seed": 0},
     "callbacks": [METRICS]},
    # The same stream under DDP: every rank holds the whole model; the probe's backward runs outside DDP's forward.
    {"name": "metrics_digits_ddp", "model": "digits", "steps": 6, "ddp": True,
     "stream": {"num_tasks": 2, "steps_per_task": 3, "batch_size": 16, "samples_per_task": 64, "seed": 0},
     "callbacks": [METRICS]},
    # GateLogger on the package's GPT with reciprocal attention and MLP: their 1-element gates sharded like any weight.
    {"name": "gates_gpt", "model": "gpt", "steps": 3, "gpt": {"attention": "reciprocal", "mlp": "reciprocal"},
     "callbacks": [{"_target_": "plasticity_callbacks.GateLogger", "every_n_steps": 1}]},
]
# Both ranks die right after the distributed checkpoint at step 3 (its own launch: the processes end there).
CRASHED = {"name": "crashed", "model": "mlp", "steps": 6, "epoch_steps": 3, "crash_at": 3, "ckpt_every": 3,
           "distributed_checkpoint": True, "callbacks": [dict(FIRE, schedule={"steps": [1, 4]}), *STATEFUL]}


def test_every_callback_that_declares_fsdp2_is_run_under_fsdp2():
    """A callback with ``supports_fsdp2 = True`` must be in a two-rank run here (found from the declarations:
    a new method that declares it fails this until it has one)."""
    from plasticity_callbacks.callbacks.base import fsdp2_callbacks

    def targets(runs):
        return {spec["_target_"].rsplit(".", 1)[-1] for run in runs for spec in run.get("callbacks", [])}

    missing = set(fsdp2_callbacks()) - targets([*RUNS, CRASHED])
    assert not missing, f"{sorted(missing)} declare supports_fsdp2 but no run of RUNS uses them under FSDP2"


def single_and_sharded(fsdp2_runs, name: str) -> tuple[dict, dict]:
    """The run ``name`` in one process, beside its result on two ranks."""
    out, results = fsdp2_runs
    return run_single(out, next(r for r in RUNS if r["name"] == name)), results[name]


@pytest.fixture(scope="module")
def fsdp2_runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp2")
    run_fsdp2(out, [CRASHED], crash=True)
    return out, run_fsdp2(out, RUNS)


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", ["fire_mlp", "fire_gpt2", "fire_encoder", "fire_gpt"])
def test_fire_under_fsdp2_equals_one_process(fsdp2_runs, name):
    single, sharded = single_and_sharded(fsdp2_runs, name)
    assert float(sharded["metrics"]["fire/layers"]) > 0
    assert float(sharded["metrics"]["fire/dfi_after"]) < 1e-6 * float(sharded["metrics"]["fire/dfi_before"])
    assert_same_as_single(single, sharded, metrics=("fire/dfi_before", "fire/sfe", "fire/layers"))


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", ["fire_ns_mlp", "fire_ns_gpt2"])
def test_fire_with_a_fixed_iteration_count_under_fsdp2_equals_one_process(fsdp2_runs, name):
    single, sharded = single_and_sharded(fsdp2_runs, name)
    assert float(sharded["metrics"]["fire/layers"]) > 0
    # 5 steps leave the weights measurably off an isometry: not the exact polar factor in disguise
    assert float(sharded["metrics"]["fire/dfi_after"]) > 1e-3 * float(sharded["metrics"]["fire/dfi_before"])
    assert_same_as_single(single, sharded, metrics=("fire/dfi_before", "fire/dfi_after", "fire/sfe", "fire/layers"))


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", ["redo_mlp", "redo_gpt2"])
def test_redo_under_fsdp2_equals_one_process(fsdp2_runs, name):
    single, sharded = single_and_sharded(fsdp2_runs, name)
    assert float(sharded["metrics"]["redo/recycled"]) > 0
    assert_same_as_single(single, sharded, metrics=("redo/recycled", "redo/dormant"))


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", ["dash_mlp", "dash_gpt2", "dash_encoder"])
def test_dash_under_fsdp2_equals_one_process(fsdp2_runs, name):
    single, sharded = single_and_sharded(fsdp2_runs, name)
    assert float(sharded["metrics"]["dash/shrunk"]) > 0  # the paper's rule shrank rows
    assert float(sharded["metrics"]["dash_periodic/shrunk_fraction"]) == 1.0  # every row, each by its own factor
    assert_same_as_single(single, sharded, metrics=("dash/shrunk", "dash/factor_min", "dash_periodic/shrunk",
                                                    "dash_periodic/factor_min"))


@pytest.mark.multiprocess
def test_a_phase_carries_the_optimizer_moments_of_a_distributed_checkpoint(fsdp2_runs):
    out, results = fsdp2_runs
    source, target = results["carry_source"]["optimizer"], results["carry_target"]["optimizer"]
    assert source and set(source) == set(target)
    for name, state in source.items():
        for key, value in state.items():
            torch.testing.assert_close(target[name][key], value, rtol=0, atol=0, msg=f"{name}.{key}")


@pytest.mark.multiprocess
def test_a_method_acting_right_after_a_validation_under_fsdp2_equals_one_process(fsdp2_runs):
    single, sharded = single_and_sharded(fsdp2_runs, "sp_gpt_after_validation")
    assert sharded["callbacks"][0]["applications"] == single["callbacks"][0]["applications"] == 1
    # Without a reshard before the action, the shrunk shards of the root unit (embeddings, head) do not survive
    # step 3: its gathered copy from the validation is what the step computes with and leaves behind.
    assert_same_as_single(single, sharded, metrics=("train/loss",))


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", ["sp_mlp", "sp_gpt", "reset_gpt2"])
def test_fresh_draws_under_fsdp2_equal_one_process(fsdp2_runs, name):
    single, sharded = single_and_sharded(fsdp2_runs, name)
    assert sharded["callbacks"][0]["applications"] == single["callbacks"][0]["applications"] == 1
    assert_same_as_single(single, sharded)  # the whole fresh draw one process makes, each rank's rows of it


@pytest.mark.multiprocess
def test_weight_clip_under_fsdp2_equals_one_process(fsdp2_runs):
    single, sharded = single_and_sharded(fsdp2_runs, "clip_gpt2")
    c_fc = sharded["params"]["model.transformer.h.0.mlp.c_fc.weight"]  # stored (16, 64): bound 0.1/√16
    limit = torch.tensor(0.1 / 16**0.5, dtype=c_fc.dtype)
    assert c_fc.abs().max() <= limit and (c_fc.abs() == limit).sum() > 0  # entries were clipped to the box
    assert_same_as_single(single, sharded, metrics=("weight_clip/clipped",))


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", ["l2_mlp", "l2_gpt2", "ht_mlp", "ht_gpt2", "ht_gpt2_val", "cbp_mlp", "cbp_gpt2", "cbp_mlp_uneven",
                                  "cbp_gpt", "cbp_phi3"])
def test_stateful_methods_under_fsdp2_equal_one_process(fsdp2_runs, name):
    out, results = fsdp2_runs
    spec = next(r for r in RUNS if r["name"] == name)
    single, sharded = run_single(out, spec), results[name]
    untreated = run_single(out, dict(spec, name=f"{name}_untreated", callbacks=[]))
    moved = max(float((sharded["params"][k] - untreated["params"][k]).abs().max()) for k in untreated["params"])
    assert moved > 1e-4, "the method did not change the weights"  # ten times the float32 tolerance
    state = sharded["callbacks"][0]
    if name.startswith("l2"):  # pulled toward θ₀ (compared below with the single process's θ₀)
        assert float(sharded["metrics"]["l2_init/distance"]) > 0
    elif name.startswith("ht"):  # reset at step 2, the tortoise an average of the hare since
        assert state["resets"] == 1 and float(sharded["metrics"]["hare_tortoise/distance"]) > 0
    else:  # units replaced inside the run, on both ranks' shards
        assert float(sharded["metrics"]["cbp/replaced"]) >= 4
        assert any(bool((stats["age"] < 2).any()) for stats in state["stats"])
    assert_same_as_single(single, sharded, metrics=("val/loss",) if spec.get("val_every") else ())
    assert_close(single["callbacks"], sharded["callbacks"], "callbacks")  # θ₀ / tortoise / utilities, ages, means


@pytest.mark.multiprocess
def test_the_monitor_under_fsdp2_logs_what_one_process_logs(fsdp2_runs):
    """Shard sums reduced over the ranks: every monitor value equals one process's, and the weights are
    untouched (the monitor only measures)."""
    single, sharded = single_and_sharded(fsdp2_runs, "monitor_mlp")
    logged = {k for k in single["metrics"] if k.startswith("monitor/")}
    assert {"monitor/dormant", "monitor/weight_srank", "monitor/grad_norm"} <= logged
    for key in sorted(logged):
        assert torch.allclose(sharded["metrics"][key].double(), single["metrics"][key].double(), rtol=1e-4,
                              atol=1e-6), key
    assert_same_as_single(single, sharded)


@pytest.mark.multiprocess
@pytest.mark.parametrize("kind", ["distributed", "full"])
def test_stateful_methods_under_fsdp2_resume_to_the_uninterrupted_run(fsdp2_runs, kind):
    """L2Init's θ₀ and the tortoise, sharded like the weights, written as the distributed checkpoint's shards
    (a killed run) or gathered into one file; CBP's per-unit statistics whole on every rank."""
    out, results = fsdp2_runs
    reference, resumed = ((results["resume_reference"], results["resume_resumed"]) if kind == "distributed" else
                          (results["state_full_reference"], results["state_full_resumed"]))
    assert_close(reference["params"], resumed["params"], "params")
    assert_close(reference["optimizer"], resumed["optimizer"], "optimizer")
    # the methods' own state: the schedules' last_epoch is Lightning's epoch count, which differs across this
    # resume (the checkpoint of step 3 is written before epoch 0 ends; no schedule here acts on epochs)
    own = [[{k: v for k, v in state.items() if k != "schedule"} for state in run["callbacks"]]
           for run in (reference, resumed)]
    assert_close(*own, "callbacks")
    tortoise = next(state for state in resumed["callbacks"] if "tortoise" in state)
    assert tortoise["resets"] == 2  # step 2 before the checkpoint, step 5 after


@pytest.mark.multiprocess
def test_fire_under_fsdp2_resumes_to_the_uninterrupted_run(fsdp2_runs):
    out, results = fsdp2_runs
    reference, resumed = results["resume_reference"], results["resume_resumed"]
    assert float(resumed["metrics"]["fire/applications"]) == 2  # step 1 before the kill, step 4 after: not again
    assert_close(reference["params"], resumed["params"], "params")
    assert_close(reference["optimizer"], resumed["optimizer"], "optimizer")
    assert (out / "crashed_2" / "ckpt" / "last.ckpt").is_dir()  # a distributed checkpoint: one shard per rank


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", ["metrics_digits", "metrics_digits_root_head", "metrics_digits_ddp"])
def test_task_metrics_on_two_ranks_equal_one_process(fsdp2_runs, name):
    out, results = fsdp2_runs
    spec = next(r for r in RUNS if r["name"] == name)
    single, sharded = run_single(out, spec), results[name]
    rows, sharded_rows = single["callbacks"][0]["history"], sharded["callbacks"][0]["history"]
    assert [r["task"] for r in sharded_rows] == [0, 1]
    for row, sharded_row in zip(rows, sharded_rows):
        assert set(row) == set(sharded_row)
        for key, value in row.items():
            if key == "retained_accuracy" and row["task"] == 0:
                assert math.isnan(value) and math.isnan(sharded_row[key])
                continue
            assert sharded_row[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
        assert 0 < sharded_row["probe_accuracy"] and 0 < sharded_row["grad_norm"]
    # The probe trained on the shards and put everything back: the weights are those of a run without it.
    assert_same_as_single(single, sharded)
    assert_close(run_single(out, dict(spec, name=f"{name}_plain", callbacks=[]))["params"], sharded["params"])


@pytest.mark.multiprocess
def test_gate_logger_under_fsdp2_logs_the_gates_of_one_process(fsdp2_runs):
    single, sharded = single_and_sharded(fsdp2_runs, "gates_gpt")
    gates = [k for k in single["metrics"] if k.startswith("gates/")]
    assert len(gates) == 2 * (6 + 7)  # per layer: attention's 4 values and 2 decisions, the MLP's 5 and 2
    assert sharded["params"]["model.blocks.0.mlp.skip_rec"].shape == (1,)
    assert float(sharded["metrics"]["gates/model.blocks.0.attn/gate_std"]) != pytest.approx(torch.sigmoid(
        torch.tensor(2.0)).item())  # trained off its init, then logged
    assert_same_as_single(single, sharded, metrics=tuple(gates))


def _svd_state(result: dict) -> dict[str, dict]:
    """AdaptiveSVDSwitch's state per matrix, with its ``U`` (under FSDP2 kept apart, sharded by rows)."""
    state = result["callbacks"][0]
    sharded = dict(zip(state["matrices"], state.get("singular_vectors") or [None] * len(state["matrices"])))
    return {name: dict(entry, U_prev=entry["U_prev"] if sharded[name] is None else sharded[name])
            for name, entry in state["matrices"].items()}


def _principal_part_kept(result: dict, transposed: bool) -> list[str]:
    """The matrices whose principal part ``U_pᵀW`` is still ``S_p V_pᵀ`` of the last cycle's SVD
    (``U_pᵀW (U_pᵀW)ᵀ = diag(S_p²)``), while their minor part moved: the updates since that cycle lay in
    ``span(U_m)``.
    ``transposed``: the weights are stored ``(in, out)`` (GPT-2's Conv1D)."""
    kept = []
    for name, entry in _svd_state(result).items():
        W = result["params"][name].double()
        W = W.T if transposed else W.reshape(W.shape[0], -1)  # (out, in·∏k)
        U, S, k = entry["U_prev"].double(), entry["S_prev"].double(), len(entry["S_prev"]) - entry["r"]
        assert entry["state"] == "minor", name
        principal, minor = U[:, :k].T @ W, U[:, k:].T @ W
        torch.testing.assert_close(principal @ principal.T, torch.diag(S[:k] ** 2), rtol=1e-4, atol=1e-5 * S[0] ** 2,
                                   msg=lambda m: f"{name}: the principal part moved: {m}")
        moved = [(part @ part.T - torch.diag(values**2)).abs().max() for part, values in ((principal, S[:k]),
                                                                                          (minor, S[k:]))]
        assert moved[1] > 10 * moved[0], f"{name}: the minor part moved {moved[1]:.2e}, the principal {moved[0]:.2e}"
        kept.append(name)
    return kept


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", ["svd_mlp", "svd_gpt2", "svd_encoder"])
def test_adaptive_svd_under_fsdp2_projects_as_one_process(fsdp2_runs, name):
    out, results = fsdp2_runs
    spec = next(r for r in RUNS if r["name"] == name)
    single, sharded = run_single(out, spec), results[name]
    history = sharded["callbacks"][0]["history"]
    assert history == single["callbacks"][0]["history"]  # the same state and r per matrix per cycle
    assert {step for step, *_ in history} == set(spec["callbacks"][0]["schedule"]["steps"])
    assert all(state == "minor" for _, _, state, _ in history)
    assert len(_principal_part_kept(sharded, transposed=spec["model"] == "gpt2")) == len(history) // 2 >= 2
    assert "singular_vectors" in sharded["callbacks"][0] and "singular_vectors" not in single["callbacks"][0]
    for matrix, entry in _svd_state(sharded).items():
        reference = _svd_state(single)[matrix]
        U, U_single, r = entry["U_prev"], reference["U_prev"], entry["r"]
        assert_close(reference["S_prev"], entry["S_prev"], f"{matrix}.S")
        # the same minor subspace, up to rounding amplified by 1/(its gap to the principal one) (Davis–Kahan)
        torch.testing.assert_close(U[:, -r:] @ U[:, -r:].T, U_single[:, -r:] @ U_single[:, -r:].T, rtol=0, atol=1e-3)
    assert_same_as_single(single, sharded, metrics=(
        "adaptive_svd/n_minor", "adaptive_svd/mean_angle", "adaptive_svd/mean_principal_alignment",
        "adaptive_svd/mean_minor_alignment", "adaptive_svd/mean_reconstruction_error"))


@pytest.mark.multiprocess
def test_adaptive_svd_under_fsdp2_projects_adam_moments_as_one_process(fsdp2_runs):
    single, sharded = single_and_sharded(fsdp2_runs, "svd_mlp_adamw")
    assert sharded["callbacks"][0]["history"] == single["callbacks"][0]["history"]
    assert all(state["exp_avg"].abs().sum() > 0 for state in sharded["optimizer"].values())
    assert_same_as_single(single, sharded, metrics=("adaptive_svd/n_minor", "adaptive_svd/mean_angle"))


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", ["svd_mlp", "svd_gpt2"])
def test_adaptive_svd_under_fsdp2_resumes_to_the_uninterrupted_run(fsdp2_runs, name):
    out, results = fsdp2_runs
    reference, resumed = results[name], results[f"{name}_resumed"]
    history = resumed["callbacks"][0]["history"]
    assert history == reference["callbacks"][0]["history"] and len({step for step, *_ in history}) == 2
    assert_close(reference["params"], resumed["params"], "params")
    assert_close(reference["optimizer"], resumed["optimizer"], "optimizer")


# ------------------------------------------------------------------ strategies and callbacks that refuse

@pytest.mark.parametrize("strategy", ["FSDPStrategy", "DeepSpeedStrategy"])
def test_flat_parameter_strategies_are_refused_with_the_fsdp2_fix(strategy):
    from plasticity_callbacks.callbacks.gate_logger import GateLogger
    from plasticity_callbacks.callbacks.task_metrics import TaskMetrics
    from lightning.pytorch.utilities.exceptions import MisconfigurationException

    from plasticity_callbacks.distributed.strategy import require_full_parameters

    trainer = SimpleNamespace(strategy=type(strategy, (), {})())
    for fsdp2 in (False, True):
        with pytest.raises(MisconfigurationException, match=f"{strategy}.*ModelParallelStrategy.*fully_shard.*ddp"):
            require_full_parameters(trainer, "Owner", fsdp2=fsdp2)
    for observer in (TaskMetrics(), GateLogger()):  # they read weights too: refused at setup, before any data
        with pytest.raises(MisconfigurationException,
                           match=f"{type(observer).__name__} cannot act under strategy {strategy}.*ModelParallel"):
            observer.setup(trainer, None, "fit")


def test_fsdp2_is_accepted_by_the_callbacks_that_act_on_shards_and_refused_with_the_fix_by_the_others():
    """Every registered method passes the check when it declares ``supports_fsdp2`` and is refused at setup with
    the fix when it does not (a method that needs a whole weight, a full Gram, may refuse); the message lists
    exactly the declared ones, read off the registry, so a new method is checked and listed without an edit."""
    from lightning.pytorch.utilities.exceptions import MisconfigurationException

    from plasticity_callbacks import AdaptiveSVDSwitch, ReDoMonitor
    from plasticity_callbacks.callbacks.base import callback_classes, fsdp2_callbacks, plasticity_methods

    trainer = SimpleNamespace(strategy=type("ModelParallelStrategy", (), {})())
    methods = plasticity_methods()
    assert len(methods) >= 12
    listed = fsdp2_callbacks()
    for name, cls in methods.items():
        method = cls(minor_training="project") if cls is AdaptiveSVDSwitch else cls()  # "factorize": see below
        if cls.supports_fsdp2:
            method.check_strategy(trainer)
        else:
            with pytest.raises(MisconfigurationException, match=f"{name} does not act on FSDP2's sharded weights"):
                method.check_strategy(trainer)
    assert set(listed) == {name for name, cls in callback_classes().items() if cls.supports_fsdp2}
    assert {"FIREReinit", "TaskMetrics", "GateLogger"} <= set(listed)

    class ActsOnWholeWeights(ReDoMonitor):
        supports_fsdp2 = False

    with pytest.raises(MisconfigurationException, match="ActsOnWholeWeights does not act on FSDP2's sharded weights"
                       ) as refused:
        ActsOnWholeWeights().check_strategy(trainer)
    assert f"; {', '.join(listed)} do. Use strategy='ddp'" in str(refused.value)
    with pytest.raises(MisconfigurationException, match="factorize.*ModelParallelStrategy.*neither sharded.*'project'"):
        AdaptiveSVDSwitch(minor_training="factorize").check_strategy(trainer)


@pytest.mark.cli
@pytest.mark.multiprocess
def test_plasticity_train_runs_the_reciprocal_gpt_under_trainer_fsdp2(tmp_path):
    """The Hydra app end to end on 2 CPU ranks: the GPT shards itself (1-element gates included), FIRE acts at
    fit start, GateLogger logs every step, and the checkpoint is a distributed one (a folder of shards)."""
    import csv
    import os
    import subprocess
    import sys

    args = ["experiment=smoke", "trainer=fsdp2", "trainer.max_steps=2", "model/attention=reciprocal",
            "model/mlp=reciprocal", "+callbacks=[fire,gates]", "callbacks.gates.every_n_steps=1",
            f"hydra.run.dir={tmp_path}/run"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PL_DISABLE_FORK="1")
    env.pop("LOCAL_RANK", None)
    proc = subprocess.run([sys.executable, "-m", "plasticity_callbacks.app.train", *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = list(csv.DictReader((tmp_path / "run" / "logs" / "metrics.csv").open()))
    assert any(float(r.get("fire/layers") or 0) > 0 for r in rows)
    gates = [float(r["gates/model.blocks.1.mlp/gate_rec"]) for r in rows if r.get("gates/model.blocks.1.mlp/gate_rec")]
    assert gates and all(0 < g < 0.5 for g in gates)  # sigmoid(-3) trained a little: logged by every rank alike
    assert (tmp_path / "run" / "checkpoints" / "last.ckpt").is_dir()


@pytest.mark.multiprocess
def test_sharded_fire_spreads_the_decompositions_over_ranks_and_equals_one_process(tmp_path):
    """``apply_fire`` on ``Shard(0)`` DTensors (2 gloo ranks, no Lightning): each block's ``eigh`` runs on one rank
    only (round robin), wide blocks by columns included, in one process's precision, and weights, records and
    spectra equal one process's, through every route; with each round's matrices batched into one reduce-scatter
    and one all-gather, and with each block's matrix sent alone (on CPU, and where a round is too large to batch)."""
    import subprocess
    import sys
    from pathlib import Path

    out = tmp_path / "sharded_fire.pt"
    worker = Path(__file__).with_name("sharded_fire_worker.py")
    proc = subprocess.run([sys.executable, str(worker), str(out)], env=dict(os.environ, OMP_NUM_THREADS="1"),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = torch.load(out, weights_only=True)
    records_single = [FireRecord(**r) for r in result["records_single"]]
    # 10 blocks through the Gram route in 5 rounds, then 2 again in float64 in a sixth (below): a Gram matrix per
    # block (12) and a G^-1/2 per decomposed block (8: not the NaN, rank-deficient or retried ones' first tries);
    # each of the 4 wide blocks' columns fetched once and sent back once (8 all-to-alls).
    travel = {"batched": {"reduce_scatter_single": 6, "all_gather_single": 6, "all_to_all_single": 8},
              "per_block": {"reduce": 12, "broadcast": 8, "all_to_all_single": 8}}
    for route in ("batched", "per_block"):
        run = result[route]
        assert run["collectives"] == travel[route], route
        _check_sharded_fire(run, result["single"], records_single)


def _check_sharded_fire(run: dict, single_params: dict, records_single: list) -> None:
    """One sharded run of ``sharded_fire_worker`` against one process's weights and records."""
    records = [[FireRecord(**r) for r in rank] for rank in run["records"]]
    # Every block through the Gram route, world at a time, rank 0 decomposing the first of each pair and rank 1
    # the second: 40x24 | 40x40, wide 12x40 (by columns: 12x12) | conv 10x6 (9 taps), 33x7 | 12x12 rank-deficient,
    # 16x16 NaN | wide conv 4x10 (4 taps), wide Conv1D 11x40 | wide 7x50. Oblong blocks (one process's eigh route)
    # try a float32 Gram matrix, as one process does: 40x24 and the 10x6 conv fail its condition check (no eigh)
    # and are decomposed again in float64 on the owner of a second pass (24x24; 3x3x6x6); square ones are float64.
    # The NaN block is refused before any eigh; the rank-deficient one is then gathered.
    assert run["eigh_calls"] == [[((12, 12), "float32"), ((7, 7), "float32"), ((11, 11), "float32"),
                                  ((24, 24), "float64")],
                                 [((40, 40), "float64"), ((12, 12), "float64"), ((2, 2, 4, 4), "float32"),
                                  ((7, 7), "float32"), ((3, 3, 6, 6), "float64")]]
    assert run["gathered"] == ["5.weight"]  # only the rank-deficient block is solved whole; wide ones never
    for name, single in single_params.items():
        torch.testing.assert_close(run["sharded"][name], single.detach(), rtol=1e-5, atol=2e-6, equal_nan=True,
                                   msg=name)
    def numbers(r):  # what every rank must agree on (NaN included); not its own seconds
        return repr((r.name, r.scale, r.dfi_before, r.dfi_after, r.sfe, r.skipped))

    assert [numbers(r) for r in records[0]] == [numbers(r) for r in records[1]]
    assert any("6.weight contains NaN/Inf" in w for w in run["warnings"])
    for one, two in zip(records_single, records[0], strict=True):
        assert (one.name, one.shape, one.skipped) == (two.name, tuple(two.shape), two.skipped)
        if one.skipped:
            continue
        for field in ("scale", "dfi_before", "sfe", "sfe_normalized"):
            assert math.isclose(getattr(two, field), getattr(one, field), rel_tol=1e-5, abs_tol=1e-9), (one.name, field)
        assert two.dfi_after < 1e-9 * one.dfi_before
        torch.testing.assert_close(two.spectrum_before, one.spectrum_before, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(two.spectrum_after, one.spectrum_after, rtol=1e-4, atol=1e-5)
