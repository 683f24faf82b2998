"""The mamba2 state-space mixer: its scan against a step-by-step recurrence in float64, the whole block against a
token-by-token computation from its raw parameters, cached decoding, a short fit, the hybrid config from Hydra,
and what FIRE, ReDo, DASH and AdaptiveSVD do to it."""
import math
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hydra import compose, initialize_config_dir

from plasticity_callbacks.app.train import build_module, config_dir
from plasticity_callbacks.callbacks.adaptive_svd import AdaptiveSVDSwitch
from plasticity_callbacks.callbacks.dash import DASHShrink
from plasticity_callbacks.callbacks.fire import FIREReinit
from plasticity_callbacks.errors import ConfigError
from plasticity_callbacks.functional.isometry import FIREOptions
from plasticity_callbacks.model_map import find_neuron_layers, select_targets
from plasticity_callbacks.models import GPT, GPTConfig, KVCache
from plasticity_callbacks.models.lightning_module import GPTLightningModule
from plasticity_callbacks.models.blocks.ssm import Mamba2Mixer, selective_scan
from tiny import cpu_trainer, tiny_gpt_module, token_loader

HYBRID = dict(n_layer=2, n_head=2, n_kv_head=2, n_embd=32, sequence_len=16, vocab_size=64,
              layer_pattern=["attn", "mamba2"], ssm_options={"d_state": 8, "head_dim": 16})


def recurrence(x, dt, A, B, C, state=None):
    """``S_t = exp(dt_t A) S_{t-1} + dt_t x_t ⊗ B_t``, ``y_t = S_t C_t``, one step at a time."""
    batch, T, heads, P = x.shape
    S = torch.zeros(batch, heads, P, B.shape[-1], dtype=x.dtype) if state is None else state.clone()
    ys = []
    for t in range(T):
        S = torch.exp(dt[:, t, :, None, None] * A[None, :, None, None]) * S \
            + dt[:, t, :, None, None] * x[:, t, :, :, None] * B[:, t, None, None, :]
        ys.append(torch.einsum("bhpn,bn->bhp", S, C[:, t]))
    return torch.stack(ys, 1), S


@pytest.mark.parametrize("with_state", [False, True])
def test_selective_scan_equals_the_recurrence_in_float64(with_state):
    g = torch.Generator().manual_seed(0)
    batch, T, heads, P, N = 2, 13, 3, 4, 5
    x = torch.randn(batch, T, heads, P, generator=g, dtype=torch.float64)
    dt = F.softplus(torch.randn(batch, T, heads, generator=g, dtype=torch.float64))
    A = -torch.rand(heads, generator=g, dtype=torch.float64) * 4
    B, C = (torch.randn(batch, T, N, generator=g, dtype=torch.float64) for _ in range(2))
    state = torch.randn(batch, heads, P, N, generator=g, dtype=torch.float64) if with_state else None
    y, last = selective_scan(x, dt, A, B, C, state)
    y_ref, last_ref = recurrence(x, dt, A, B, C, state)
    torch.testing.assert_close(y, y_ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(last, last_ref, rtol=1e-12, atol=1e-12)


def block_by_hand(block: Mamba2Mixer, u: torch.Tensor) -> torch.Tensor:
    """The block's documented data flow, token by token from its raw parameters (no conv module, no scan)."""
    d_inner, N, heads, P = block.d_inner, block.d_state, block.n_heads, block.head_dim
    W, kernel, bias = block.in_proj.weight, block.conv1d.weight[:, 0], block.conv1d.bias  # kernel (channels, taps)
    taps = kernel.shape[1]
    projected = u @ W.T  # (b, T, ·)
    z, xBC, dt_raw = projected[..., :d_inner], projected[..., d_inner:2 * d_inner + 2 * N], projected[..., -heads:]
    A = -torch.exp(block.A_log)
    S = torch.zeros(u.shape[0], heads, P, N, dtype=u.dtype)
    out = []
    for t in range(u.shape[1]):
        window = [xBC[:, s] if s >= 0 else torch.zeros_like(xBC[:, 0]) for s in range(t - taps + 1, t + 1)]
        conv = F.silu(sum(kernel[:, k] * window[k] for k in range(taps)) + bias)  # (b, channels)
        x, B, C = conv[:, :d_inner].view(-1, heads, P), conv[:, d_inner:d_inner + N], conv[:, d_inner + N:]
        dt = F.softplus(dt_raw[:, t] + block.dt_bias)  # (b, h)
        S = torch.exp(dt * A)[..., None, None] * S + dt[..., None, None] * x[..., None] * B[:, None, None, :]
        y = torch.einsum("bhpn,bn->bhp", S, C) + block.D[:, None] * x
        y = y.reshape(-1, d_inner) * F.silu(z[:, t])
        y = y / torch.sqrt((y * y).mean(-1, keepdim=True) + torch.finfo(y.dtype).eps) * block.norm_weight
        out.append(y @ block.out_proj.weight.T)
    return torch.stack(out, 1)


def test_the_block_equals_its_data_flow_token_by_token_and_decodes_from_a_cache():
    torch.manual_seed(0)
    config = GPTConfig(**{**HYBRID, "attention": "mamba2", "layer_pattern": None,
                          "attention_options": {"d_state": 6, "head_dim": 8, "d_conv": 3}})
    block = Mamba2Mixer(config, 0, None, d_state=6, head_dim=8, d_conv=3).double()
    with torch.no_grad():
        block.out_proj.weight.normal_()  # zero at init: make the output depend on everything
        block.norm_weight.uniform_(0.5, 1.5)
    u = torch.randn(2, 9, 32, dtype=torch.float64)
    torch.testing.assert_close(block(u), block_by_hand(block, u), rtol=1e-10, atol=1e-10)
    cache = KVCache(1)  # prefix, one token, the rest: the state carries the conv taps and the scan
    pieces = [block(u[:, :1], cache), block(u[:, 1:5], cache), block(u[:, 5:6], cache), block(u[:, 6:], cache)]
    torch.testing.assert_close(torch.cat(pieces, 1), block(u), rtol=1e-10, atol=1e-10)


def test_hybrid_gpt_generates_with_its_cache_as_without():
    torch.manual_seed(0)
    model = GPT(GPTConfig(**HYBRID)).eval()
    assert [type(b.attn).__name__ for b in model.blocks] == ["CausalSelfAttention", "Mamba2Mixer"]
    with torch.no_grad():
        for block in model.blocks:  # zero-initialized output projections and head: give the logits content
            block.attn.get_submodule("out_proj" if hasattr(block.attn, "out_proj") else "c_proj").weight.normal_(0, .2)
        model.lm_head.weight.normal_(0, 0.2)
    idx = torch.randint(0, 64, (2, 5))
    out = model.generate(idx, max_new_tokens=6, temperature=0)
    step = idx
    for _ in range(6):  # greedy without a cache: the whole prefix every time
        step = torch.cat([step, model(step)[:, -1].argmax(-1, keepdim=True)], 1)
    assert torch.equal(out, step)


def test_a_hybrid_fits_a_short_sequence():
    torch.manual_seed(0)
    module = tiny_gpt_module(**{**HYBRID, "sequence_len": 16})
    x, y = next(iter(token_loader(n=4, sequence_len=16, vocab=64, batch_size=4)))
    opt = module.configure_optimizers()["optimizer"]
    first = None
    for _ in range(60):
        loss = module.loss(module(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        first = first if first is not None else loss.item()
    assert loss.item() < 0.5 * first, (first, loss.item())


def test_hybrid_and_all_ssm_configs_compose_from_hydra():
    tiny = ["model.n_layer=2", "model.n_embd=32", "model.n_head=2", "model.n_kv_head=2", "model.sequence_len=16",
            "paths.output_dir=/tmp/plasticity-compose"]
    with initialize_config_dir(config_dir=str(Path(config_dir())), version_base="1.3"):
        ssm = build_module(compose("config", overrides=["model/attention=mamba2", *tiny]))
        hybrid = build_module(compose("config", overrides=["model.layer_pattern=[attn,mamba2]",
                                                           "model.ssm_options.head_dim=16", *tiny]))
    assert [type(b.attn).__name__ for b in ssm.model.blocks] == ["Mamba2Mixer"] * 2
    assert [type(b.attn).__name__ for b in hybrid.model.blocks] == ["CausalSelfAttention", "Mamba2Mixer"]
    assert hybrid.model.blocks[1].attn.head_dim == 16
    with pytest.raises(ConfigError, match=r"model.attention='mamba3' is not a known block"):
        GPTConfig(layer_pattern=["attn", "mamba3"])
    with pytest.raises(ConfigError, match="start model.layer_pattern with attn"):
        GPTConfig(layer_pattern=["mamba2", "attn"], position="fire", position_options={"shared": True})


# ---------------------------------------------------------------- the callbacks on the hybrid
def ssm_rows(block: Mamba2Mixer) -> dict[str, slice]:
    """in_proj's row blocks as the forward splits its output: [z | x | B | C | dt]."""
    d, N, h = block.d_inner, block.d_state, block.n_heads
    edges = [0, d, 2 * d, 2 * d + N, 2 * d + 2 * N, 2 * d + 2 * N + h]
    return {name: slice(a, b) for name, a, b in zip(("z", "x", "B", "C", "dt"), edges, edges[1:])}


def _scaled_isometry(M, msg):
    s = torch.linalg.svdvals(M.double())
    scale = math.sqrt(M.shape[0] / M.shape[1])
    torch.testing.assert_close(s, torch.full_like(s, scale), rtol=1e-4, atol=1e-6, msg=f"{msg}: {s}")


def hybrid_module() -> GPTLightningModule:
    """The hybrid at learning rate 0 (every change is a callback's), its SSM output projection made non-zero."""
    torch.manual_seed(0)
    module = GPTLightningModule(HYBRID, {"lr": 0.0, "schedule": "constant"})
    with torch.no_grad():
        module.model.blocks[1].attn.out_proj.weight.normal_()
    return module


def assert_ssm_parameters_untouched(before, module):
    for name, p in module.named_parameters():
        if "blocks.1.attn." in name and not name.endswith(("in_proj.weight", "out_proj.weight")):
            assert torch.equal(before[name], p.detach()), name  # conv1d, A_log, D, dt_bias, norm: left alone


def test_fire_makes_each_in_proj_block_an_isometry_and_leaves_conv_and_ssm_parameters_alone():
    module = hybrid_module()
    block = module.model.blocks[1].attn
    before = {n: p.detach().clone() for n, p in module.named_parameters()}
    fire = FIREReinit(options=FIREOptions(method="svd"))
    cpu_trainer(max_steps=1, callbacks=[fire]).fit(module, token_loader(n=4, sequence_len=16, vocab=64))
    W = block.in_proj.weight.detach()
    for name, rows in ssm_rows(block).items():  # each at its own scale √(rows/cols): B's 0.5, z's √2
        _scaled_isometry(W[rows], f"in_proj {name}")
    _scaled_isometry(block.out_proj.weight.detach(), "out_proj")
    assert_ssm_parameters_untouched(before, module)


def test_redo_names_the_ssm_mixer_and_watches_the_mlps_beside_it():
    model = GPT(GPTConfig(**HYBRID))
    with pytest.warns(UserWarning, match=r"in_proj -> out_proj channels of \['blocks.1.attn \(Mamba2Mixer\)'\]"):
        layers = find_neuron_layers(model)
    assert [layer.name for layer in layers] == ["blocks.0.mlp", "blocks.1.mlp"]


def test_dash_and_adaptive_svd_act_on_in_and_out_proj_not_the_conv():
    model = GPT(GPTConfig(**HYBRID))
    views = {v.name: v for v in select_targets(model)}
    assert {n for n in views if n.startswith("blocks.1.attn.")} == {"blocks.1.attn.in_proj.weight",
                                                                   "blocks.1.attn.out_proj.weight"}
    assert [b.label for b in views["blocks.1.attn.in_proj.weight"].blocks] == ["z", "x", "B", "C", "dt"]
    module = hybrid_module()
    svd, dash = AdaptiveSVDSwitch(save_figure=False), DASHShrink(n_batches=1)
    before = {n: p.detach().clone() for n, p in module.named_parameters()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cpu_trainer(max_steps=1, callbacks=[dash, svd]).fit(module, token_loader(n=4, sequence_len=16, vocab=64))
    treated = {m.target.name for m in svd.matrices}
    assert {"model.blocks.1.attn.in_proj.weight", "model.blocks.1.attn.out_proj.weight"} <= treated
    assert not any("conv1d" in name for name in treated)
    assert not torch.equal(before["model.blocks.1.attn.in_proj.weight"], module.model.blocks[1].attn.in_proj.weight)
    assert_ssm_parameters_untouched(before, module)  # DASH shrank in_proj; the conv and the scan's own: as they were


def test_its_own_init_draws_every_parameter_for_shrink_perturb():
    from plasticity_callbacks.model_map import fresh_parameters

    model = GPT(GPTConfig(**HYBRID))
    fresh = fresh_parameters(model, seed=0)
    assert set(fresh) == {name for name, _ in model.named_parameters()}  # no parameter left to a silent copy
    block = "blocks.1.attn."
    A = torch.exp(fresh[block + "A_log"])
    assert bool(((A >= 1) & (A <= 16)).all()) and not torch.equal(fresh[block + "A_log"], model.blocks[1].attn.A_log)
    dt = F.softplus(fresh[block + "dt_bias"])
    assert bool(((dt >= 1e-4) & (dt <= 0.1 + 1e-6)).all())
    assert bool((fresh[block + "D"] == 1).all()) and bool((fresh[block + "out_proj.weight"] == 0).all())
