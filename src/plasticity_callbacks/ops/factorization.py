"""Training only the minor components of a weight: two implementations behind one switch.

``minor_training="factorize"`` (MiLoRA's split): the weight becomes ``W_p + B @ A`` with
``B = U_m √S_m`` and ``A = √S_m V_mᵀ`` from the ``r`` smallest singular triplets and
``W_p = W − BA``; ``W_p`` is frozen and only ``B, A`` train. It is a
``torch.nn.utils.parametrize`` parametrization, so ``module.weight`` keeps returning the effective
weight to every caller (Linear, conv, ``MultiheadAttention.in_proj_weight``), and the frozen
``W_p`` *is* the original ``Parameter`` object (``parametrizations.weight.original``).

Optimizer surgery, and why in place: Lightning has no API to swap an optimizer mid-fit, and a
rebuilt optimizer would lose every other parameter's moments and the LR scheduler's binding.
So ``B, A`` are appended to the *param group that holds the weight* (same learning rate, weight
decay, scheduler lambda; no new group, so schedulers and LR monitors need no change), and the
frozen ``W_p`` stays in its group with no gradient, which every ``torch.optim`` optimizer skips.
Its moments are dropped (stale, and the memory is the point). ``CombinedOptimizer`` shares its
group dicts with the inner Muon/AdamW, so one append reaches both. Appending in a fixed order
(target order, after removing all previous ``B, A``) makes the layout a function of which
matrices are factorized, which is what lets a checkpoint resume into it.

``minor_training="project"``: the weight stays one parameter; in "minor" phases its gradient is replaced
by ``U_m U_mᵀ ∇W`` before the optimizer step (no parameter surgery; DDP and FSDP2). Relation to the
factorized form: at ``W = W_p + BA`` a gradient step on ``B, A`` changes the weight by
``−η (B Bᵀ ∇W + ∇W AᵀA) = −η (U_m S_m U_mᵀ ∇W + ∇W V_m S_m V_mᵀ)`` to first order: a
σ-weighted projection onto the minor *left* subspace plus one onto the minor *right* subspace
(so its left factor is not confined to ``U_m``). Projection keeps the left, unweighted part only:
the update of a momentum-SGD or Muon step stays exactly in ``span(U_m)`` (their linear
momentum is projected at each switch too), an AdamW step only up to its per-coordinate
rescaling ``1/√v``, which mixes directions again.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.nn.utils import parametrize

from ..functional.subspace import SVD, as_matrix
from .optimizer_state import leaf_optimizers, reset_optimizer_state

MINOR_TRAINING = ("project", "factorize")  # how a matrix in the "minor" state trains
_LINEAR_STATE = ("exp_avg", "momentum_buffer")  # moments that are linear in the gradient (projectable)


class MinorComponents(nn.Module):
    """Parametrization ``original ↦ original + B @ A`` (reshaped to a conv kernel if needed).

    While ``capture`` is on, a zero ``probe`` shaped like the weight is added to it, so autograd
    sums the gradient with respect to the effective weight into ``probe.grad`` (over
    micro-batches), read back as ``captured``: the callback's gradient alignment needs ``∇W``,
    which the optimizer never sees in this mode. A leaf tensor rather than a tensor hook, so a
    compiled forward keeps one graph (a hook that writes module state is a graph break).
    """

    plasticity_factorization = True  # the model map's holding: W_p trains through B, A (not frozen, not the user's)

    def __init__(self, B: torch.Tensor, A: torch.Tensor, transposed: bool = False, shape: torch.Size | None = None):
        super().__init__()
        self.B = nn.Parameter(B)  # (d_out, r)
        self.A = nn.Parameter(A)  # (r, d_in·∏k)
        self.transposed = transposed  # the weight is stored (in, out), as HF Conv1D: BA is added transposed
        out_in = (A.shape[1], B.shape[0]) if transposed else (B.shape[0], A.shape[1])
        self.shape = torch.Size(shape if shape is not None else out_in)  # the stored weight's shape
        self.probe: torch.Tensor | None = None

    @property
    def capture(self) -> bool:
        return self.probe is not None

    @capture.setter
    def capture(self, on: bool) -> None:
        if on and self.probe is None:  # kept while on: micro-batches of one step add up
            self.probe = torch.zeros(self.shape, dtype=self.B.dtype, device=self.B.device, requires_grad=True)
        elif not on:
            self.probe = None

    @property
    def captured(self) -> torch.Tensor | None:
        return None if self.probe is None else self.probe.grad

    def delta(self, original: torch.Tensor) -> torch.Tensor:
        """``BA`` shaped like the stored weight."""
        product = self.B @ self.A
        if not self.transposed:
            return product.reshape(original.shape)
        # stored (in, out, *k) (HF Conv1D, ConvTranspose): BA is (out, in·∏k), swap its first two dims back
        return product.reshape(original.shape[1], original.shape[0], *original.shape[2:]).transpose(0, 1)

    def forward(self, original: torch.Tensor) -> torch.Tensor:
        weight = original + self.delta(original)
        if self.probe is not None:
            weight = weight + self.probe  # adds zero; its gradient is ∇W
        return weight


def minor_factors(svd: SVD, r: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """MiLoRA's balanced split of the ``r`` smallest triplets: ``B = U_m √S_m``, ``A = √S_m V_mᵀ``."""
    U, S, V = svd  # the last r of each (S and V may hold only the trailing triplets)
    root = S[-r:].clamp_min(0).sqrt()
    return (U[:, -r:] * root).to(dtype).contiguous(), (root[:, None] * V[:, -r:].mT).to(dtype).contiguous()


def is_factorized(module: nn.Module, attr: str) -> bool:
    return parametrize.is_parametrized(module, attr)


def components(module: nn.Module, attr: str) -> MinorComponents:
    return getattr(module.parametrizations, attr)[0]


def factorize(module: nn.Module, attr: str, B: torch.Tensor, A: torch.Tensor,
              frozen: torch.Tensor | None = None, transposed: bool = False) -> MinorComponents:
    """Split ``module.<attr>`` into frozen ``W_p = W − BA`` (or the given ``frozen``) plus trainable ``B, A``.

    ``B, A`` factor the ``(out, in)`` matrix; ``transposed`` says the weight is stored ``(in, out)``.
    The module's output is unchanged up to rounding, since ``W_p + BA`` reproduces ``W``.
    """
    weight = getattr(module, attr)
    parts = MinorComponents(B, A, transposed, weight.shape)
    with torch.no_grad():
        weight.copy_(frozen if frozen is not None else weight - parts.delta(weight))
    weight.requires_grad_(False)
    weight.grad = None
    parametrize.register_parametrization(module, attr, parts, unsafe=True)
    return parts


def resplit(module: nn.Module, attr: str, B: torch.Tensor, A: torch.Tensor) -> MinorComponents:
    """Move a factorized weight to new factors of the same shapes, in place: ``W_p ← W − BA`` for
    the current effective ``W``, and ``B, A`` overwritten. The parametrization (and so the
    module's class) stays, so a compiled graph stays valid; callers reset the factors' moments."""
    parts = components(module, attr)
    if parts.B.shape != B.shape or parts.A.shape != A.shape:
        raise ValueError(f"resplit: factors {tuple(B.shape)}, {tuple(A.shape)} do not match the current "
                         f"{tuple(parts.B.shape)}, {tuple(parts.A.shape)}; fold and factorize instead")
    original = getattr(module.parametrizations, attr).original
    with torch.no_grad():
        effective = original + parts.delta(original)
        parts.B.copy_(B)
        parts.A.copy_(A)
        original.copy_(effective - parts.delta(original))
    return parts


def fold(module: nn.Module, attr: str) -> nn.Parameter:
    """Fold ``BA`` back: the original ``Parameter`` object (still in its optimizer group) becomes ``W_p + BA``."""
    parametrize.remove_parametrizations(module, attr, leave_parametrized=True)
    weight = getattr(module, attr)
    weight.requires_grad_(True)
    return weight


def param_group_of(optimizers, param: torch.Tensor) -> dict | None:
    """The param-group dict holding ``param`` (shared with the inner optimizers of a ``CombinedOptimizer``)."""
    for opt in optimizers:
        opt = getattr(opt, "_optimizer", opt)  # LightningOptimizer
        for group in opt.param_groups:
            if any(p is param for p in group["params"]):
                return group
    return None


def attach(optimizers, weight: torch.Tensor, new_params: list[torch.Tensor]) -> None:
    """Append ``new_params`` to the group of ``weight`` and drop ``weight``'s now-stale state."""
    group = param_group_of(optimizers, weight)
    if group is None:
        raise RuntimeError("the factorized weight is in no optimizer param group; was it frozen before training?")
    group["params"].extend(new_params)
    reset_optimizer_state(optimizers, [weight])


def detach(optimizers, params: list[torch.Tensor]) -> None:
    """Remove ``params`` (and their state) from every param group."""
    reset_optimizer_state(optimizers, params)
    ids = {id(p) for p in params}
    for opt in optimizers:
        opt = getattr(opt, "_optimizer", opt)
        for group in opt.param_groups:
            group["params"][:] = [p for p in group["params"] if id(p) not in ids]


def order_in_groups(optimizers, params: list[torch.Tensor]) -> None:
    """Move ``params`` to the end of their param groups, in the given order. Optimizer state is
    keyed by parameter, so nothing is lost; the order is what a checkpoint's state maps onto."""
    rank = {id(p): i for i, p in enumerate(params)}
    for opt in optimizers:
        opt = getattr(opt, "_optimizer", opt)
        for group in opt.param_groups:
            ours = sorted((p for p in group["params"] if id(p) in rank), key=lambda p: rank[id(p)])
            if ours:
                group["params"][:] = [p for p in group["params"] if id(p) not in rank] + ours


def project_onto(tensor: torch.Tensor, U_minor: torch.Tensor) -> None:
    """In place: ``T ← U_m U_mᵀ T`` with ``T`` read as its ``(d_out, ·)`` matrix.

    It runs every step for every "minor" matrix, so the common layouts take two matmuls and write
    the result straight into ``tensor`` (no full-size temporary): ``T`` row-major, or ``T`` the
    transpose of a row-major matrix (HF ``Conv1D``), projected as ``Tᵀ ← (Tᵀ U_m) U_mᵀ``.
    """
    T = as_matrix(tensor)
    if T.dtype == U_minor.dtype and T.data_ptr() == tensor.data_ptr():
        if T.is_contiguous():
            torch.mm(U_minor, U_minor.mT @ T, out=T)
            return
        if T.mT.is_contiguous():
            torch.mm(T.mT @ U_minor, U_minor.mT, out=T.mT)
            return
    T = T.to(U_minor.dtype)
    tensor.copy_((U_minor @ (U_minor.mT @ T)).reshape(tensor.shape))


def project_gradient(param: torch.Tensor, U_minor: torch.Tensor, transposed: bool = False) -> None:
    """``∇W ← U_m U_mᵀ ∇W`` with ``∇W`` in ``(out, in)`` orientation (``transposed``: stored ``(in, out)``)."""
    if param.grad is not None:
        project_onto(param.grad.transpose(0, 1) if transposed else param.grad, U_minor)


def project_stack_(tensor: torch.Tensor, view, projections: dict[int, torch.Tensor]) -> None:
    """In place, for each expert ``e`` of a stack: its matrix in ``tensor`` (a gradient or a moment shaped like the
    stored stack) ``← U_e U_eᵀ (·)``, with ``U_e = projections[e]`` (``(out, r_e)``) and the others untouched.

    The experts' matrices are read through the model map's view (``view.oriented``: the stack's ``(E·out, in)``
    matrix, expert ``e``'s rows after expert ``e − 1``'s, whatever the stored layout: ``(E, out, in)``,
    ``(E, in, out)``, or a 2-D parameter the forward views per expert). Where that view is a copy (a stack
    stored ``(in, out)``), the result is written back through ``view.stored``.

    Args:
        tensor: shaped like the stored stack.
        view: the stack's :class:`~model_map.WeightView` (``view.stack`` experts).
        projections: expert index -> its minor basis ``U_e``.

    Example:
        >>> project_stack_(experts.gate_up_proj.grad, view, {0: U_0, 3: U_3})   # experts 0 and 3 are minor
    """
    oriented = view.oriented(tensor)
    experts = as_matrix(oriented).unflatten(0, (view.stack, -1))  # (E, out, in·∏k)
    for e, U in projections.items():
        block = experts[e]
        block.copy_(U @ (U.mT @ block.to(U.dtype)))
    if oriented.untyped_storage().data_ptr() != tensor.untyped_storage().data_ptr():
        tensor.copy_(view.stored(oriented))


def linear_moments(optimizers, param: torch.Tensor) -> list[torch.Tensor]:
    """The optimizer state of ``param`` that is linear in its gradient (Adam's ``exp_avg``, SGD/Muon's
    momentum), shaped like ``param``."""
    moments = []
    for opt in leaf_optimizers(optimizers):
        state = opt.state.get(param) or {}
        moments += [state[key] for key in _LINEAR_STATE
                    if torch.is_tensor(state.get(key)) and state[key].shape == param.shape]
    return moments


def project_optimizer_state(optimizers, param: torch.Tensor, U_minor: torch.Tensor, transposed: bool = False) -> None:
    """Project the moments that are linear in the gradient (Adam's ``exp_avg``, SGD/Muon's momentum),
    so momentum gathered in full mode does not keep pushing principal directions."""
    for moment in linear_moments(optimizers, param):
        project_onto(moment.transpose(0, 1) if transposed else moment, U_minor)
