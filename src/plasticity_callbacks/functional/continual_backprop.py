"""Continual Backprop's generate-and-test (Dohare et al., Nature 2024), as plain tensor functions.

Every hidden unit ``i`` of a layer carries a running utility and a running mean activation, both
exponential averages with decay ``η`` and Adam-style bias correction by ``1 - η^age``:

    f̄_i ← η f̄_i + (1-η) E_batch[h_i]                      f̂_i = f̄_i / (1 - η^age_i)
    u_i ← η u_i + (1-η) · mean_k|w_out[k, i]| · E_batch|h_i - f̂_i| / mean_j|w_in[i, j]|
    û_i = u_i / (1 - η^age_i)

(contribution × adaptation: the reference code's ``adaptable_contribution``, which its permuted-MNIST
and slowly-changing-regression configs use; ``kind="contribution"`` drops the mean and the ``1/mean|w_in|``
factor). Units older than the maturity threshold ``m`` are eligible; ``ρ · #eligible`` accumulates
per step and its integer part is the number of eligible units with the smallest ``û`` that are
replaced: incoming weights re-drawn (:func:`draw_rows`, :func:`redraw_incoming_`), incoming bias
zeroed, the unit's mean contribution ``w_out[:, i] · f̂_i`` moved into the next layer's bias and its
outgoing weights zeroed (:func:`retire_outgoing_`); its age, utility and mean restart at 0.

Example:
    >>> util, mean, corrected = update_statistics(util, mean, age + 1, 0.99, activity, batch_mean, out_mag, in_mag)
    >>> units, carry = units_to_replace(corrected, age + 1, maturity=100, rate=1e-4, carry=carry)
"""
from __future__ import annotations

import math

import torch

KINDS = ("adaptable_contribution", "contribution")
# Uniform init bounds of a re-drawn row, by fan-in: the reference's ``kaiming`` is ``gain·√(3/fan_in)``
# with ReLU's gain √2; ``lecun`` is its SELU choice; ``default`` is PyTorch's Linear init ``1/√fan_in``.
BOUNDS = {"kaiming": lambda fan_in: math.sqrt(2) * math.sqrt(3 / fan_in),
          "lecun": lambda fan_in: math.sqrt(3 / fan_in),
          "default": lambda fan_in: math.sqrt(1 / fan_in)}


def bias_correction(decay: float, age: torch.Tensor) -> torch.Tensor:
    """``1 - η^age`` (float32): the share of an exponential average that data has filled so far."""
    return 1 - decay ** age.float()


def corrected_mean(mean: torch.Tensor, batch_mean: torch.Tensor, age: torch.Tensor, decay: float) -> torch.Tensor:
    """``f̂``: the bias-corrected running mean after this step's batch, ``age`` counting this step."""
    return (decay * mean + (1 - decay) * batch_mean) / bias_correction(decay, age)


def update_statistics(util: torch.Tensor, mean: torch.Tensor, age: torch.Tensor, decay: float,
                      activity: torch.Tensor, batch_mean: torch.Tensor, out_magnitude: torch.Tensor,
                      in_magnitude: torch.Tensor, kind: str = "adaptable_contribution"):
    """One step of the per-unit statistics; returns ``(util, mean, corrected_util)`` as new tensors.

    Args:
        util, mean: running utility ``u`` and mean activation ``f̄`` per unit (before this step).
        age: per unit, counting this step (the reference increments ages first).
        decay: ``η`` in [0, 1).
        activity: ``E_batch|h - f̂|`` per unit (``kind="contribution"``: ``E_batch|h|``).
        batch_mean: ``E_batch[h]`` per unit.
        out_magnitude: ``mean_k |w_out[k, i]|`` per unit, read after the optimizer step.
        in_magnitude: ``mean_j |w_in[i, j]|`` per unit, read after the optimizer step.
        kind: ``adaptable_contribution`` (contribution × adaptation) or ``contribution``.
    """
    if kind not in KINDS:
        raise ValueError(f"kind={kind!r} is not one of {KINDS}")
    new = out_magnitude * activity
    if kind == "adaptable_contribution":
        new = new / in_magnitude
    util = decay * util + (1 - decay) * new
    mean = decay * mean + (1 - decay) * batch_mean
    return util, mean, util / bias_correction(decay, age)


def units_to_replace(corrected_util: torch.Tensor, age: torch.Tensor, maturity: int, rate: float,
                     carry: float) -> tuple[torch.Tensor, float]:
    """The units to replace this step and the fractional count carried to the next.

    ``ρ · #(age > m)`` is added to ``carry`` and its integer part is taken (the reference's
    ``accumulate=True``, its configs' choice, deterministic where the other draws a coin per step):
    that many eligible units with the smallest ``û`` (``torch.topk`` of ``-û``, as the reference).
    """
    eligible = torch.nonzero(age > maturity).flatten()
    if eligible.numel() == 0:
        return eligible, carry
    carry += rate * eligible.numel()
    count = int(carry)
    carry -= count
    if count == 0:
        return eligible[:0], carry
    return eligible[torch.topk(-corrected_util[eligible], count).indices], carry


def draw_rows(count: int, like: torch.Tensor, bound: float, generator: torch.Generator | None = None) -> torch.Tensor:
    """``count`` new incoming rows shaped like ``like[0]``, from ``U(-bound, bound)`` (float32, ``uniform_``
    as the reference draws them, so one seed gives the reference's rows)."""
    return torch.empty((count, *like.shape[1:]), device=like.device).uniform_(-bound, bound, generator=generator)


@torch.no_grad()
def redraw_incoming_(rows: torch.Tensor, bias: torch.Tensor | None, units: torch.Tensor, new_rows: torch.Tensor) -> None:
    """In place: rows ``units`` of ``rows`` (``(hidden, in, *kernel)``) become ``new_rows``; their bias 0."""
    rows[units] = new_rows.to(rows.dtype)
    if bias is not None:
        bias[units] = 0


def unit_columns(units: torch.Tensor, down_offset: int = 0, group: int = 1) -> torch.Tensor:
    """The inputs of ``down`` that read ``units``: ``down_offset + i·group + [0, group)`` (a conv channel
    flattened over ``group`` positions is read ``group`` times)."""
    return (down_offset + units[:, None] * group + torch.arange(group, device=units.device)).flatten()


@torch.no_grad()
def retire_outgoing_(down_rows: torch.Tensor, down_bias: torch.Tensor | None, units: torch.Tensor,
                     unit_mean: torch.Tensor | None, down_offset: int = 0, group: int = 1) -> None:
    """In place: zero the outgoing weights of ``units``, first moving their mean contribution into the bias.

    Args:
        down_rows: ``(out, reads, *kernel)``, unit ``i`` read at :func:`unit_columns`.
        down_bias: ``(out,)`` or None; gets ``Σ_i w_out[:, i] · f̂_i``, so the next layer's mean output is
            kept when the units' outgoing weights go to 0.
        units: indices of the replaced units.
        unit_mean: ``f̂`` per unit (all units), or None for no bias correction.
        down_offset, group: where ``down`` reads the units.
    """
    if units.numel() == 0:
        return
    columns = unit_columns(units, down_offset, group)
    if down_bias is not None and unit_mean is not None:
        means = unit_mean[units].repeat_interleave(group).to(down_rows.dtype)  # (k·group,)
        outgoing = down_rows[:, columns]  # (out, k·group, *kernel)
        # A conv ``down`` sees a constant input at every kernel tap (padding aside): its mean output is the tap sum.
        down_bias += (outgoing.reshape(*outgoing.shape[:2], -1).sum(2) * means).sum(1).to(down_bias.dtype)
    down_rows[:, columns] = 0
