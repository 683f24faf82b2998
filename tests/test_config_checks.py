"""Configuration checks on composed configs (in process; test_hydra_errors.py runs the CLI)."""
import logging

import pytest
from hydra_app import compose_config

from plasticity_callbacks.app.config_checks import check_command_line, check_config
from plasticity_callbacks.app.train import config_dir
from plasticity_callbacks.errors import ConfigError

EXPERIMENTS = ["pretrain_sft", "continual_pretrain", "pipeline_smoke", "smoke", "study_sft"]


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_every_shipped_experiment_passes(experiment, caplog):
    method = [] if experiment == "smoke" else ["+method=fire_lm"]  # a single fit takes no method (refused below)
    with caplog.at_level(logging.WARNING):
        check_config(compose_config(f"experiment={experiment}", *method), [f"experiment={experiment}"])
    assert not caplog.records


def test_a_method_in_a_single_fit_is_refused_not_ignored():
    with pytest.raises(ConfigError, match=r"\+method=fire_lm has no effect in a single fit.*\+callbacks=<name>"):
        check_config(compose_config("experiment=smoke", "+method=fire_lm"), ["experiment=smoke", "+method=fire_lm"])
    check_config(compose_config("experiment=continual_digits", "+method=fire_lm"), [])  # a task stream acts at its boundaries


def test_a_setting_no_phase_uses_is_refused_and_one_some_phases_drop_is_warned(caplog):
    lr = ["experiment=pipeline_smoke", "optimizer.lr=0.01"]
    with pytest.raises(ConfigError, match=r"optimizer.lr=0.01 has no effect.*phases.pretrain.optimizer.lr=0.003"):
        check_config(compose_config(*lr), lr)
    schedule = ["experiment=pipeline_smoke", "optimizer.min_lr_ratio=0.5"]  # no phase sets it: used
    check_config(compose_config(*schedule), schedule)
    packages = ["experiment=pretrain_sft", "data.packages=[json]"]  # SFT builds its own data
    with caplog.at_level(logging.WARNING):
        check_config(compose_config(*packages), packages)
    assert any("phases.sft.data has its own _target_" in r.getMessage() for r in caplog.records)
    caplog.clear()
    batch = ["experiment=pretrain_sft", "data.batch_size=4"]  # SFT reads ${data.batch_size}: used everywhere
    with caplog.at_level(logging.WARNING):
        check_config(compose_config(*batch), batch)
    assert not caplog.records


@pytest.mark.parametrize("override,message", [
    ("optimizer.momentum=0.9", "optimizer.momentum is not an optimizer setting"),
    ("optimizer.warmup_steps=2.5", "optimizer.warmup_steps=2.5 must be an integer"),
    ("optimizer.betas=[0.9,abc]", "optimizer.betas"),
    ("seed=true", "seed=True must be an integer"),
])
def test_wrong_types_name_the_field(override, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[")):
        check_config(compose_config("experiment=smoke", f"+{override}" if "momentum" in override else override))


def test_command_line_accepts_valid_sweeps_and_refuses_a_bad_option_in_one(tmp_path):
    run_dir = f"hydra.sweep.dir={tmp_path}/sweep"
    check_command_line(["-m", "+method=warm,fire_lm", "seed=0,1", run_dir], config_dir())
    with pytest.raises(ConfigError, match=r"method=fire_exat: no such option.*did you mean 'fire_exact'"):
        check_command_line(["-m", "+method=warm,fire_exat", run_dir], config_dir())


def test_fsdp2_data_parallel_size_must_be_the_rank_count():
    check_config(compose_config("experiment=smoke", "trainer=fsdp2", "trainer.devices=4"))  # derived from devices
    with pytest.raises(ConfigError, match=r"data_parallel_size=2 is not the rank count .* 2 × 2 = 4.*=4$"):
        check_config(compose_config("experiment=smoke", "trainer=fsdp2", "trainer.num_nodes=2"))
    check_config(compose_config("experiment=smoke", "trainer=fsdp2", "trainer.num_nodes=2",
                          "trainer.strategy.data_parallel_size=4"))
    with pytest.raises(ConfigError, match="trainer.devices='auto'.*number of devices"):
        check_config(compose_config("experiment=smoke", "trainer=fsdp2", "trainer.devices=auto"))
    with pytest.raises(ConfigError, match="tensor_parallel_size=2.*=1$"):
        check_config(compose_config("experiment=smoke", "trainer=fsdp2", "trainer.strategy.tensor_parallel_size=2",
                              "trainer.strategy.data_parallel_size=1"))


def test_a_pipeline_under_fsdp2_is_accepted_with_either_kind_of_checkpoint():
    pipeline = ["experiment=pipeline_smoke", "+method=fire_lm", "trainer=fsdp2"]
    check_config(compose_config(*pipeline), pipeline)  # folders of shards: final.ckpt is handed on as a folder
    check_config(compose_config(*pipeline, "trainer.strategy.save_distributed_checkpoint=false"), pipeline)
