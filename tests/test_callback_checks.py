"""Callback keys, TaskMetrics' interval and the digits extra are checked on the composed config, before training."""
from __future__ import annotations

import pytest
from hydra_app import compose_config

from plasticity_callbacks.app.callback_checks import check_callbacks
from plasticity_callbacks.errors import ConfigError


@pytest.mark.parametrize("experiment", ["smoke", "pretrain_sft", "continual_pretrain", "continual_digits"])
def test_shipped_experiments_pass(experiment):
    check_callbacks(compose_config(f"experiment={experiment}", "+callbacks=fire", "+callbacks.fire.save_spectra=true"))


@pytest.mark.parametrize("override, message", [
    ("+callbacks.fire.save_spectraa=true", r"callbacks.fire: FIREReinit has no argument 'save_spectraa' "
                                           r"\(did you mean 'save_spectra'\?\); it accepts schedule, options, "),
    ("+callbacks.fire.schedule.stepz=[5]", r"callbacks.fire.schedule: Schedule has no argument 'stepz' "
                                           r"\(did you mean 'steps'\?\)"),
    ("+callbacks.fire.options.methd=svd", r"callbacks.fire.options: FIREOptions has no argument 'methd'"),
])
def test_a_misspelled_callback_key_names_the_accepted_ones(override, message):
    with pytest.raises(ConfigError, match=message) as error:
        check_callbacks(compose_config("experiment=smoke", "+callbacks=fire", override))
    assert "\n" not in str(error.value)


def test_a_log_interval_that_does_not_divide_the_tasks_is_accepted():
    # TaskMetrics writes each task end at its own step (log_at_step), whatever trainer.log_every_n_steps
    check_callbacks(compose_config("experiment=continual_digits", "+method=warm", "trainer.log_every_n_steps=7"))


def test_the_digits_streams_without_scikit_learn_name_the_install_command(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "sklearn", None)  # import sklearn -> ModuleNotFoundError, as when absent
    with pytest.raises(ConfigError, match=r"needs sklearn, which is not installed: pip install (-e '.*\[digits\]'|"
                                          r"'plasticity_callbacks\[digits\]')"):
        check_callbacks(compose_config("experiment=continual_digits", "+method=warm"))
