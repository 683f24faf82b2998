"""What plasticity is read from, as tensor functions whose partial results add up over batches and ranks.

Each statistic is split into a *sum* (computed per batch, per rank, per FSDP2 shard, then added) and a
*finish* that turns the total into the number. Adding the sums of every rank gives exactly what one
process computes on the union of their data, so a distributed run logs one process's values.

- Dormant / dead units (ReDo, Sokar et al. 2023; Plasticine's dormant ratio; Dohare et al. 2024's dead
  units): :func:`abs_activation_sum` per unit, then :func:`unit_fractions` of the ReDo scores
  ``s_i = E|h_i| / mean_k E|h_k|`` (dormant: ``s_i <= tau``; dead: ``s_i = 0``).
- Feature rank (Kumar et al. 2021; Lyle et al. 2023; Dohare et al. 2024; Plasticine's effective and
  stable rank): :func:`feature_gram` ``ΦᵀΦ`` of the features ``Φ`` (samples × units), then
  :func:`gram_ranks`: the effective rank ``exp(H(p))``, ``p_i = σ_i / Σσ`` (Roy & Vetterli 2007), and the
  stable rank ``Σσ² / σ²_max`` of ``Φ``, from ``σ² = eig(ΦᵀΦ)``.
- Weight spectra (Plasticine's weight stable rank; FIRE's deviation from isometry, Chung et al. 2025):
  :func:`column_gram` ``WᵀW`` of a matrix (its row shards add up), then :func:`gram_ranks` and
  :func:`gram_isometry_deviation` ``Σ(σ_i² − s²)² = ‖WᵀW − s²I‖²_F`` over the ``min(m, n)`` singular values.
- Norms (Plasticine's weight magnitude and gradient norm; Dohare et al. 2024's weight magnitude; Lyle
  et al. 2023's parameter norm): :func:`squared_sum`, :func:`squared_difference_sum`; the relative
  distance from the initial weights ``‖θ − θ₀‖ / ‖θ₀‖`` and the update-to-weight ratio ``‖Δθ‖ / ‖θ‖``
  are square roots of their quotients (:func:`norm_ratio`).
- Curvature (Lyle et al. 2023: sharpness as the top Hessian eigenvalue): :func:`top_hessian_eigenvalue`
  by power iteration on Hessian-vector products.

Sums are float64; no function reads a device value on the host. No Lightning import.

Example:
    >>> sums, count = abs_activation_sum(h, unit_dim=-1), h.numel() // h.shape[-1]
    >>> unit_fractions(dormancy_scores(sums / count), tau=0.025)   # {"dormant": ..., "dead": ...}
    >>> gram_ranks(feature_gram(h))                                  # {"effective_rank": ..., "stable_rank": ...}
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from .dormancy import dormant_fraction


def abs_activation_sum(h: torch.Tensor, unit_dim: int = -1) -> torch.Tensor:
    """``Σ|h_i|`` per unit (float64), summed over every dim but ``unit_dim`` (batch, time, space).

    Divide by ``h.numel() // h.shape[unit_dim]`` (summed over batches and ranks too) for ``E|h_i|``.
    """
    unit_dim = unit_dim % h.dim()
    dims = tuple(d for d in range(h.dim()) if d != unit_dim)
    return h.detach().abs().sum(dim=dims, dtype=torch.float32).double()


def unit_fractions(scores: torch.Tensor, tau: float) -> dict[str, torch.Tensor]:
    """Fractions (0-D tensors) of the units whose ReDo score is ``<= tau`` (``dormant``) and ``0`` (``dead``).

    Args:
        scores: ``dormancy_scores`` of one layer, or several layers' scores concatenated.
        tau: the dormancy threshold (ReDo: 0.025 or 0.1).
    """
    return {"dormant": dormant_fraction(scores, tau), "dead": dormant_fraction(scores, 0.0)}


def feature_gram(h: torch.Tensor, unit_dim: int = -1) -> torch.Tensor:
    """``ΦᵀΦ`` (float64, units × units) of the features ``Φ`` = ``h`` with one row per sample and position.

    In float64: the effective rank reads every singular value, and a float32 product buries the small ones
    under its rounding (measured: 0.1 % off on a GPT MLP's 512 x 128 features).
    """
    units = h.detach().movedim(unit_dim, -1).reshape(-1, h.shape[unit_dim]).double()  # (samples·positions, units)
    return units.mT @ units


def column_gram(matrix: torch.Tensor) -> torch.Tensor:
    """``WᵀW`` (float64) of ``matrix`` read as ``(rows, everything else)``: a conv kernel's rows are its output
    channels. Row blocks (an FSDP2 shard of dim 0) give grams that add up to the whole matrix's."""
    W = matrix.detach().reshape(matrix.shape[0], -1)
    W = W.float() if W.dtype != torch.float64 else W
    return (W.mT @ W).double()


def _squared_singular_values(gram: torch.Tensor) -> torch.Tensor:
    """``σ²`` of the matrix behind a gram, descending. Eigenvalues within rounding of 0 (``n·eps·λ_max``, the
    rank tolerance of ``matrix_rank``) are 0: their square roots (``~1e-7·σ_max``) would add phantom
    singular values to the effective rank of a wide matrix's ``WᵀW``."""
    squared = torch.linalg.eigvalsh(gram.double()).flip(-1)
    tolerance = squared[0].clamp_min(0.0) * gram.shape[-1] * torch.finfo(torch.float64).eps
    return torch.where(squared > tolerance, squared, 0.0)


def gram_ranks(gram: torch.Tensor) -> dict[str, torch.Tensor]:
    """Effective rank ``exp(H(σ/Σσ))`` (Roy & Vetterli) and stable rank ``Σσ²/σ²_max`` of the matrix whose
    ``ΦᵀΦ`` is ``gram``; both 0 for a zero matrix (float64, 0-D)."""
    squared = _squared_singular_values(gram)
    sigma = squared.sqrt()
    total = sigma.sum()
    p = sigma / total.clamp_min(1e-300)
    entropy = -(p * p.clamp_min(1e-300).log()).sum()
    zero = total <= 0
    return {"effective_rank": torch.where(zero, 0.0, entropy.exp()),
            "stable_rank": torch.where(zero, 0.0, squared.sum() / squared[0].clamp_min(1e-300))}


def gram_isometry_deviation(gram: torch.Tensor, rows: int, scale: float = 1.0) -> torch.Tensor:
    """DfI ``‖WᵀW − s²I‖²_F`` (``WWᵀ`` for a wide ``W``: the sum over its ``min(m, n)`` singular values of
    ``(σ² − s²)²``) from ``gram = WᵀW`` of an ``(rows, n)`` matrix, float64 0-D; as
    :func:`~functional.spectral.deviation_from_isometry` computes from ``W`` itself.

    ``‖G‖²_F − 2s²·tr G + k·s⁴`` with ``k = min(rows, n)``: float64 loses about ``1e-16 · ‖G‖²_F`` to
    cancellation, far below any deviation worth reading.
    """
    k = min(rows, gram.shape[-1])
    gram = gram.double()
    return gram.square().sum() - 2 * scale**2 * gram.diagonal().sum() + k * scale**4


def squared_sum(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """``Σ‖t‖²`` over ``tensors`` (float64, 0-D; 0 when empty)."""
    total = torch.zeros((), dtype=torch.float64)
    for t in tensors:
        total = total.to(t.device) + t.detach().float().square().sum().double()
    return total


def squared_difference_sum(xs: Sequence[torch.Tensor], ys: Sequence[torch.Tensor]) -> torch.Tensor:
    """``Σ‖x − y‖²`` over the pairs (float64, 0-D)."""
    total = torch.zeros((), dtype=torch.float64)
    for x, y in zip(xs, ys, strict=True):
        total = total.to(x.device) + (x.detach().float() - y.detach().float()).square().sum().double()
    return total


def norm_ratio(squared_numerator: torch.Tensor, squared_denominator: torch.Tensor) -> torch.Tensor:
    """``√(a / b)`` of two squared norms: ``‖θ − θ₀‖/‖θ₀‖`` or ``‖Δθ‖/‖θ‖``; NaN when ``b`` is 0 (a weight
    initialized to zero has no relative change: NaN leaves a gap in a curve, where 0 or inf would mislead)."""
    return torch.where(squared_denominator > 0, squared_numerator / squared_denominator.clamp_min(1e-300),
                       torch.nan).sqrt()


def top_hessian_eigenvalue(loss: Callable[[], torch.Tensor], params: Sequence[torch.Tensor], iterations: int = 10,
                           generator: torch.Generator | None = None,
                           average: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """The Hessian's eigenvalue of largest magnitude (sharpness, Lyle et al. 2023) of ``loss()`` with respect
    to ``params``, by ``iterations`` steps of power iteration on Hessian-vector products.

    Cost: one forward and backward with a graph kept for double backward, then ``iterations``
    Hessian-vector products (each about two backward passes), and two parameter-sized float32 vectors.

    Args:
        loss: computes the scalar loss (a forward with gradients enabled).
        params: the parameters the Hessian is taken over (plain tensors, not FSDP2 shards).
        iterations: power-iteration steps (the Rayleigh quotient of the last is returned).
        generator: draws the starting vector (the same on every rank when seeded alike).
        average: applied to each flat Hessian-vector product (e.g. a mean over ranks, so the Hessian is that
            of the ranks' mean loss); None: this process's.

    Returns:
        ``vᵀHv`` with ``v`` the last unit vector (float64, 0-D).
    """
    params = [p for p in params if p.requires_grad]
    with torch.enable_grad():
        grads = torch.autograd.grad(loss(), params, create_graph=True, allow_unused=True)
        pairs = [(p, g) for p, g in zip(params, grads) if g is not None]
        params, grads = [p for p, _ in pairs], [g for _, g in pairs]
        size = sum(p.numel() for p in params)
        v = torch.randn(size, generator=generator, dtype=torch.float32).to(params[0].device)
        v /= v.norm()
        eigenvalue = torch.zeros((), dtype=torch.float64, device=v.device)
        for index in range(iterations):
            parts = [t.view_as(p).to(p.dtype) for t, p in zip(v.split([p.numel() for p in params]), params)]
            hv = torch.autograd.grad(grads, params, grad_outputs=parts, retain_graph=index < iterations - 1)
            hv = torch.cat([t.reshape(-1).float() for t in hv])
            if average is not None:
                hv = average(hv)
            eigenvalue = (v.double() @ hv.double())
            v = hv / hv.norm().clamp_min(1e-30)
    return eigenvalue.detach()
