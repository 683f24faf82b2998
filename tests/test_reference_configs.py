"""Each paper config (configs/method/{fire_lm,fire_continual,dash,redo}.yaml) against the reference's loop on the same model and inputs.

The reference loops below are re-derived from the papers' math and the facts in ALGORITHMS.md
(FIRE: isaac7778/FIRE; DASH: baekrok/DASH-Direction-Aware-SHrinking; ReDo: google/dopamine
labs/redo), written as plainly as possible, and compared with our callbacks built from the configs.
"""
import copy
import math
from pathlib import Path

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from hydra.utils import instantiate
from omegaconf import OmegaConf
from torch import nn

from plasticity_callbacks.distributed.strategy import rank_identical_generator
from hydra_app import compose_config
from tiny import TinyMLPModule, cpu_trainer, regression_loader, tiny_gpt_module, token_loader

METHODS = Path(__file__).resolve().parents[1] / "configs" / "method"


def method_callback(name: str, key: str, **overrides):
    """The callback ``key`` of ``configs/method/<name>.yaml`` as composed (callbacks/<key>.yaml + overrides)."""
    cfg = compose_config(f"+method={name}").method.callbacks[key]
    return instantiate(OmegaConf.merge(cfg, overrides))


class Snapshot(L.Callback):
    """Parameters as the callbacks listed before it left them in on_train_start."""

    def on_train_start(self, trainer, pl_module):
        self.params = {n: p.detach().clone() for n, p in pl_module.named_parameters()}


def run_fit_start(module, loader, callback):
    snapshot = Snapshot()
    cpu_trainer(max_steps=1, callbacks=[callback, snapshot]).fit(module, loader)
    return snapshot.params


# --------------------------------------------------------------------------------------- FIRE


def reference_fire(model: nn.Module, iterations: int = 5) -> None:
    """Every nn.Linear: W ← √(d_out/d_in) · NS^k(W / ‖W‖_F), cubic steps on the tall orientation,
    float32; a fused c_attn would be split into Q, K, V (our GPT has them separate already)."""
    with torch.no_grad():
        for module in model.modules():
            if not isinstance(module, nn.Linear):
                continue
            W = module.weight.detach().clone()
            X = W.T if W.shape[1] > W.shape[0] else W
            X = X / X.norm()
            for _ in range(iterations):
                X = 1.5 * X - 0.5 * X @ (X.T @ X)
            X = X.T if W.shape[1] > W.shape[0] else X
            module.weight.copy_(X * math.sqrt(W.shape[0] / W.shape[1]))


@pytest.mark.parametrize("tied", [False, True])
def test_fire_config_reproduces_the_reference_gpt_loop(tied):
    torch.manual_seed(0)
    module = tiny_gpt_module(n_layer=2, n_embd=32, n_head=2, n_kv_head=2)
    with torch.no_grad():  # as after training: the zero-initialized projections and head are non-zero
        for p in module.parameters():
            if p.dim() == 2 and not p.any():
                p.normal_(0.0, 0.05)
    if tied:  # GPT-2's layout: the head's weight is the token embedding
        module.model.lm_head.weight = module.model.wte.weight
    expected = copy.deepcopy(module)
    reference_fire(expected)
    linears = [n for n, m in expected.named_modules() if isinstance(m, nn.Linear)]
    assert "model.lm_head" in linears and {"model.blocks.0.attn.c_q", "model.blocks.0.attn.c_k"} <= set(linears)
    before = {n: p.detach().clone() for n, p in module.named_parameters()}
    params = run_fit_start(module, token_loader(), method_callback("fire_lm", "fire", save_spectra=False))
    for name, p in expected.named_parameters():
        torch.testing.assert_close(params[name], p.detach(), rtol=1e-5, atol=1e-6, msg=name)
        treated = name.rsplit(".", 1)[0] in linears or (tied and name == "model.wte.weight")
        assert treated != torch.equal(params[name], before[name]), name  # treated exactly where the reference is
    if tied:  # still one tensor, orthogonalized once through the head
        assert module.model.wte.weight is module.model.lm_head.weight


def reference_fire_gpt2(model: nn.Module, iterations: int = 5) -> None:
    """The reference's loop translated to Hugging Face GPT-2, whose Linears are ``Conv1D`` stored
    ``(in, out)``: each in ``(out, in)`` orientation, the fused ``c_attn`` as Q, K and V row blocks,
    each ``√(d_out/d_in) · NS^k(W/‖W‖_F)``; the head is tied to the token embedding."""
    def ns(W):
        X = W.T if W.shape[1] > W.shape[0] else W
        X = X / X.norm()
        for _ in range(iterations):
            X = 1.5 * X - 0.5 * X @ (X.T @ X)
        X = X.T if W.shape[1] > W.shape[0] else X
        return X * math.sqrt(W.shape[0] / W.shape[1])

    with torch.no_grad():
        for name, module in model.named_modules():
            if type(module).__name__ == "Conv1D":
                W = module.weight.T  # (out, in)
                blocks = W.split(W.shape[1]) if name.endswith("c_attn") else (W,)
                module.weight.copy_(torch.cat([ns(block.clone()) for block in blocks]).T)
            elif isinstance(module, nn.Linear):
                module.weight.copy_(ns(module.weight.detach().clone()))


def test_fire_config_reproduces_the_reference_on_gpt2_with_fused_qkv_and_tied_head():
    pytest.importorskip("transformers")
    from model_zoo import Wrapped

    module = Wrapped("gpt2")
    assert module.model.lm_head.weight is module.model.transformer.wte.weight
    expected = copy.deepcopy(module)
    reference_fire_gpt2(expected)
    before = {n: p.detach().clone() for n, p in module.named_parameters()}
    snapshot = Snapshot()
    cpu_trainer(max_steps=1, callbacks=[method_callback("fire_lm", "fire", save_spectra=False), snapshot]).fit(module)
    changed = set()
    for name, p in expected.named_parameters():
        torch.testing.assert_close(snapshot.params[name], p.detach(), rtol=1e-5, atol=1e-6, msg=name)
        if not torch.equal(snapshot.params[name], before[name]):
            changed.add(name)
    assert "model.transformer.wte.weight" in changed  # orthogonalized through the tied head
    assert {"model.transformer.h.0.attn.c_attn.weight", "model.transformer.h.1.mlp.c_proj.weight"} <= changed


def reference_fire_vision(model: nn.Module, iterations: int = 10) -> None:
    """The authors' continual-classification loop (vision/interventions/fire.py): every nn.Linear and
    nn.Conv2d, the output head included; a conv kernel one matrix per tap (i, j), each NS^k(W/‖W‖_F) on the
    tall orientation, all scaled by √(C_out/C_in) / (k_h·k_w)."""
    def ns(W):
        X = W.T if W.shape[1] > W.shape[0] else W
        X = X / X.norm()
        for _ in range(iterations):
            X = 1.5 * X - 0.5 * X @ (X.T @ X)
        return X.T if W.shape[1] > W.shape[0] else X

    with torch.no_grad():
        for module in model.modules():
            if not isinstance(module, (nn.Linear, nn.Conv2d)):
                continue
            W = module.weight.detach().clone()
            taps = W.shape[2] * W.shape[3] if W.dim() == 4 else 1
            out = torch.zeros_like(W)
            if W.dim() == 4:
                for i in range(W.shape[2]):
                    for j in range(W.shape[3]):
                        out[:, :, i, j] = ns(W[:, :, i, j])
            else:
                out = ns(W)
            module.weight.copy_(out * math.sqrt(W.shape[0] / W.shape[1]) / taps)


def test_fire_continual_config_reproduces_the_authors_vision_loop_on_a_cnn_with_its_head():
    from plasticity_callbacks.models.classifier import DigitsClassifier

    torch.manual_seed(0)
    module = DigitsClassifier("cnn", channels=[4, 8], hidden=16)
    expected = copy.deepcopy(module)
    reference_fire_vision(expected)
    before = {n: p.detach().clone() for n, p in module.named_parameters()}
    data = torch.utils.data.TensorDataset(torch.randn(8, 64), torch.randint(0, 10, (8,)))
    params = run_fit_start(module, torch.utils.data.DataLoader(data, batch_size=8),
                           method_callback("fire_continual", "fire", save_spectra=False))
    for name, p in expected.named_parameters():
        torch.testing.assert_close(params[name], p.detach(), rtol=1e-5, atol=1e-6, msg=name)
        assert name.endswith(".weight") != torch.equal(params[name], before[name]), name  # weights only, head too
    assert "network.9.weight" in [n for n, _ in expected.named_parameters()]  # the output head is among them


# --------------------------------------------------------------------------------------- DASH


class RegressionWithBatchNorm(TinyMLPModule):
    """``Linear → BatchNorm → Dropout → ReLU → Linear → ReLU → Linear``: eval and train mode differ."""

    def __init__(self):
        super().__init__()
        self.net.insert(1, nn.BatchNorm1d(16))
        self.net.insert(2, nn.Dropout(0.3))


def reference_dash(model: nn.Module, loader, alpha: float = 0.3, lam: float = 0.3) -> nn.Module:
    """One pass over the data on a copy left in its mode (eval after an evaluation), EMA of −grad, then
    every Linear/conv weight scaled per row by clamp(cos(G_row, W_row), λ, 1) and its bias by one factor."""
    probe = copy.deepcopy(model)
    layers = [m for m in probe.modules() if isinstance(m, (nn.Linear, nn.Conv2d))]
    ema = {id(p): torch.zeros_like(p) for m in layers for p in m.parameters()}
    for x, y in loader:
        probe.zero_grad()
        F.mse_loss(probe(x), y).backward()
        for m in layers:
            for p in m.parameters():
                ema[id(p)] = (1 - alpha) * ema[id(p)] + alpha * (-p.grad)
    result = copy.deepcopy(model)
    with torch.no_grad():
        for m, m_probe in zip([m for m in result.modules() if isinstance(m, (nn.Linear, nn.Conv2d))], layers):
            G = ema[id(m_probe.weight)]
            cos = F.cosine_similarity(G.flatten(2) if G.dim() > 2 else G,
                                      m.weight.flatten(2) if G.dim() > 2 else m.weight, dim=-1)
            m.weight.mul_(cos.clamp(lam, 1).reshape(cos.shape + (1,) * (G.dim() - cos.dim())))
            if m.bias is not None:
                g = ema[id(m_probe.bias)]
                m.bias.mul_(F.cosine_similarity(g[None], m.bias[None]).clamp(lam, 1))
    return result


def test_dash_config_reproduces_the_reference_pass_in_eval_mode():
    torch.manual_seed(0)
    module, loader = RegressionWithBatchNorm(), regression_loader()
    module.train()
    for x, _ in loader:  # running statistics away from their init, as after training
        module.net[:2](x)
    module.eval()
    expected = reference_dash(module, loader)
    params = run_fit_start(module, loader, method_callback("dash", "dash"))
    changed = set()
    for name, p in expected.named_parameters():
        torch.testing.assert_close(params[name], p.detach(), rtol=1e-5, atol=1e-6, msg=name)
        if not torch.equal(p, module.state_dict()[name]):
            changed.add(name)
    assert {"net.6.weight", "net.6.bias"} <= changed  # the head and its bias are shrunk too
    # The difference is an option: in train mode (batch statistics, dropout) the result differs.
    module_train = RegressionWithBatchNorm()
    module_train.load_state_dict(module.state_dict())
    other = run_fit_start(module_train, loader, method_callback("dash", "dash", gradient_mode="train"))
    assert not torch.allclose(other["net.0.weight"], params["net.0.weight"], atol=1e-4)


# --------------------------------------------------------------------------------------- ReDo


def reference_redo_step(model: nn.Sequential, optimizer, x, y, step: int, tau: float, seed: int) -> None:
    """One training step and, after the update, recycling on that step's pre-update activations:
    score = mean|h| / (layer mean + 1e-9); all incoming rows re-drawn (xavier-uniform) and biases zeroed
    first, then all outgoing columns zeroed; Adam moments of those rows and columns zeroed."""
    linears = [m for m in model if isinstance(m, nn.Linear)]
    hidden = []
    hooks = [act.register_forward_hook(lambda m, i, out: hidden.append(out.detach()))
             for act in model if isinstance(act, nn.ReLU)]
    optimizer.zero_grad()
    F.mse_loss(model(x), y).backward()
    optimizer.step()
    for h in hooks:
        h.remove()
    masks = []
    for h in hidden:
        score = h.abs().mean(0)
        masks.append(score / (score.mean() + 1e-9) <= tau)
    with torch.no_grad():
        for index, (layer, mask) in enumerate(zip(linears, masks)):
            fan_out, fan_in = layer.weight.shape
            g = rank_identical_generator(seed, step, index)
            fresh = (2 * torch.rand(layer.weight.shape, generator=g) - 1) * math.sqrt(6 / (fan_in + fan_out))
            layer.weight[mask] = fresh[mask]
            layer.bias[mask] = 0
            for key in ("exp_avg", "exp_avg_sq"):
                optimizer.state[layer.weight][key][mask] = 0
                optimizer.state[layer.bias][key][mask] = 0  # ours zeroes the bias moments too
        for layer, mask in zip(linears[1:], masks):
            layer.weight[:, mask] = 0
            for key in ("exp_avg", "exp_avg_sq"):
                optimizer.state[layer.weight][key][:, mask] = 0


def test_redo_config_reproduces_the_reference_recycling():
    torch.manual_seed(0)
    module = TinyMLPModule(hidden=16)
    with torch.no_grad():  # dead units in both hidden layers, some of them connected to each other
        module.net[0].bias[:5] = -100.0
        module.net[2].bias[[1, 2, 3, 9]] = -100.0
    loader = regression_loader(n=32, batch_size=8)
    period = 3
    reference = copy.deepcopy(module.net)
    optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    redo = method_callback("redo", "redo", schedule={"every_n_steps": period}, log_every_n_steps=1)
    cpu_trainer(max_steps=period, callbacks=[redo]).fit(module, loader)
    for step, (x, y) in enumerate(loader, start=1):
        if step > period:
            break
        if step < period:
            optimizer.zero_grad()
            F.mse_loss(reference(x), y).backward()
            optimizer.step()
        else:
            reference_redo_step(reference, optimizer, x, y, step, tau=0.025, seed=0)
    fc2 = reference[2].weight
    assert torch.equal(fc2[[1, 2, 3, 9]][:, :5], torch.zeros(4, 5))  # both ends recycled: stays 0
    assert int(redo._recycled.sum()) >= 9
    ours = module.net
    lightning_opt = module.trainer.optimizers[0]
    for (name, p), q in zip(ours.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-5, atol=1e-6, msg=name)
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(lightning_opt.state[p][key], optimizer.state[q][key], rtol=1e-5, atol=1e-7,
                                       msg=f"{name} {key}")


def test_dormancy_score_divisor_is_the_references_mean_plus_1e_9():
    from plasticity_callbacks.functional.dormancy import dormancy_scores, dormant_mask

    tiny = torch.tensor([1e-10, 1e-10, 1e-10, 0.0])  # layer mean 7.5e-11: the +1e-9 dominates
    scores = dormancy_scores(tiny)
    torch.testing.assert_close(scores, tiny / (tiny.mean() + 1e-9))
    assert dormant_mask(scores, 0.1).all()  # a (nearly) silent layer is dormant, as in the references
    loud = torch.tensor([1.0, 1.0, 1.0, 0.0])
    torch.testing.assert_close(dormancy_scores(loud), loud / 0.75)  # at ordinary scales the 1e-9 is invisible
    assert torch.equal(dormancy_scores(torch.zeros(5)), torch.zeros(5))  # an all-dead layer: 0, not NaN
