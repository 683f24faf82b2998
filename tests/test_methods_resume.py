"""Crash-and-resume for the per-step methods (CBP, L2-Init, weight clipping, Hare & Tortoise): one
interrupted-and-resumed run per method ends where the uninterrupted run ends, callback state included."""
from __future__ import annotations

import pytest
from resume_harness import assert_same_run, run_resume_scenarios

CB = "plasticity_callbacks.callbacks."
SCENARIOS = {  # 12 steps, checkpoints every 5, interrupted at step 5
    "cbp": [{"_target_": CB + "continual_backprop.ContinualBackprop", "replacement_rate": 0.2,
             "maturity_threshold": 2}],
    "l2_init": [{"_target_": CB + "l2_init.L2Init", "strength": 0.1}],
    "weight_clip": [{"_target_": CB + "weight_clip.WeightClip", "kappa": 0.5}],
    "hare_tortoise": [{"_target_": CB + "hare_tortoise.HareTortoise", "decay": 0.8, "schedule": {"every_n_steps": 3}}],
}


@pytest.mark.multiprocess
def test_resumed_runs_end_where_uninterrupted_runs_end(tmp_path):
    results = run_resume_scenarios(tmp_path, {name: dict(callbacks=callbacks, steps=12, ckpt_every=5, stop_at=5)
                                              for name, callbacks in SCENARIOS.items()})
    acted = {"cbp": lambda s: s["replaced"] > 0, "l2_init": lambda s: len(s["anchors"]) > 0,
             "weight_clip": lambda s: True, "hare_tortoise": lambda s: s["resets"] == 3}
    for name, result in results.items():
        assert acted[name](result["reference"]["callbacks"][0]), f"{name} did not act: the test would prove nothing"
        assert_same_run(result["reference"], result["resumed"])
