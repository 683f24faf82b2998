"""Reciprocal attention and reciprocal MLP (seed 002) against explicit computations; the
GateLogger; every attention × MLP × position combination composed from Hydra and trained."""
import itertools
import math

import pytest
import torch
import torch.nn.functional as F
from hydra_app import compose_config
from tiny import build, cpu_trainer, tiny_gpt_module, token_loader

from plasticity_callbacks.callbacks.gate_logger import GateLogger
from plasticity_callbacks.errors import ConfigError
from plasticity_callbacks.app.runs.resume import check_shapes
from plasticity_callbacks.models import ATTENTIONS, GPT, MLPS, POSITIONS, GPTConfig, KVCache
from plasticity_callbacks.models.blocks import rms_norm
from plasticity_callbacks.models.blocks.reciprocal_attention import fold_reciprocal, reciprocal_dim_mask
from plasticity_callbacks.app.train import build_module

SMALL = dict(n_layer=2, n_head=4, n_kv_head=2, n_embd=64, sequence_len=16)  # head_dim 16


def make_attention(position="none", n_kv_head=2, **options):
    config = GPTConfig(**{**SMALL, "n_kv_head": n_kv_head, "attention": "reciprocal", "position": position,
                          "attention_options": options})
    attn = GPT(config).blocks[0].attn.double()
    with torch.no_grad():
        attn.c_proj.weight.normal_(0, 0.1)
        attn.skip_std.fill_(0.7)  # off their init so each factor is visible in the scores
        attn.skip_rec.fill_(0.3)
        attn.w_std.fill_(0.8)
        attn.w_rec.fill_(-0.6)  # a learned weight may go negative: the fused form must still hold
    return attn


def explicit_terms(attn, x):
    """Independent of the folding: q, k from the projections, then the seed's two score terms (÷√D)."""
    B, T, _ = x.shape
    H, Hkv, D = attn.n_head, attn.n_kv_head, attn.head_dim
    q = attn.c_q(x).view(B, T, H, D).transpose(1, 2)
    k = attn.c_k(x).view(B, T, Hkv, D).transpose(1, 2)
    v = attn.c_v(x).view(B, T, Hkv, D).transpose(1, 2)
    q, k = attn.position.rotate(q, k, 0)
    q, k = rms_norm(q), rms_norm(k)
    k, v = k.repeat_interleave(H // Hkv, 1), v.repeat_interleave(H // Hkv, 1)  # head h reads kv head h // G
    low = attn.low_dims
    q_std, q_low, k_std, k_low = q[..., ~low], q[..., low], k[..., ~low], k[..., low]
    g_std, g_rec = torch.sigmoid(attn.skip_std), torch.sigmoid(attn.skip_rec)
    standard = attn.w_std * g_std * q_std @ k_std.transpose(-1, -2) / math.sqrt(D)
    reciprocal = attn.w_rec * g_rec * k_low @ q_low.transpose(-1, -2) / math.sqrt(D)  # (B, H, T_i, T_j)
    return standard, reciprocal, v


def attend(scores, v, attn):
    B, H, T, _ = scores.shape
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    y = torch.softmax(scores.masked_fill(~causal, float("-inf")), -1) @ v  # (B, H, T, hd)
    return attn.c_proj(y.transpose(1, 2).reshape(B, T, -1))


def test_low_dims_are_the_last_r_half_of_each_half_and_rope_keeps_them_apart():
    assert reciprocal_dim_mask(8, 4).tolist() == [False, False, True, True, False, False, True, True]
    assert reciprocal_dim_mask(16, 2).nonzero().flatten().tolist() == [7, 15]
    with pytest.raises(ValueError, match="rank"):
        reciprocal_dim_mask(16, 3)
    attn = make_attention("rope", rank=4)
    low = attn.low_dims
    x = torch.randn(1, 4, 9, 16, dtype=torch.float64)
    only_low, only_std = x * low, x * ~low
    rotated_low, rotated_std = attn.position.rotate(only_low, only_std, 5)
    assert rotated_low[..., ~low].abs().max() == 0 and rotated_std[..., low].abs().max() == 0
    assert not torch.allclose(rotated_low, only_low)  # it did rotate


def test_fold_swaps_the_low_dims_and_its_hand_written_backward_is_exact():
    low = reciprocal_dim_mask(8, 4)
    q = torch.randn(2, 4, 5, 8, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 2, 5, 8, dtype=torch.float64, requires_grad=True)  # GQA: 2 query heads per kv head
    qf, kf = fold_reciprocal(q, k, low)
    k_of_head = k.repeat_interleave(2, 1)
    assert torch.equal(qf[..., ~low], q[..., ~low]) and torch.equal(qf[..., low], k_of_head[..., low])
    assert torch.equal(kf[..., ~low], k_of_head[..., ~low]) and torch.equal(kf[..., low], q[..., low])
    assert torch.autograd.gradcheck(lambda a, b: fold_reciprocal(a, b, low), (q, k))


@pytest.mark.parametrize("position,n_kv_head", [("none", 2), ("rope", 2), ("rope", 4), ("alibi", 1)])
def test_fused_scores_equal_the_explicit_two_term_scores(position, n_kv_head):
    attn = make_attention(position, n_kv_head, rank=4)
    x = torch.randn(2, 11, 64, dtype=torch.float64)
    qf, kf, _ = attn.folded_qkv(x)
    fused = qf @ kf.transpose(-1, -2) / math.sqrt(attn.head_dim)
    standard, reciprocal, v = explicit_terms(attn, x)
    torch.testing.assert_close(fused, standard + reciprocal)
    assert reciprocal.abs().max() > 1e-3  # the reciprocal term is really there
    # ... and the block's output is softmax over those scores (plus the positional bias).
    bias = attn.position.score_bias(11, 11, 0)
    scores = standard + reciprocal + (0 if bias is None else bias)
    torch.testing.assert_close(attn(x), attend(scores, v, attn))


def test_reciprocal_gate_at_zero_is_standard_attention_of_dimension_d_minus_r():
    attn = make_attention("rope", rank=4)
    with torch.no_grad():
        attn.skip_rec.fill_(-math.inf)  # sigmoid = 0 exactly
    x = torch.randn(2, 10, 64, dtype=torch.float64)
    standard, _, v = explicit_terms(attn, x)
    torch.testing.assert_close(attn(x), attend(standard, v, attn))
    # the same through SDPA on the D−R standard dims alone
    B, T, H, D = 2, 10, attn.n_head, attn.head_dim
    q = rms_norm(attn.c_q(x).view(B, T, H, D).transpose(1, 2))
    k = rms_norm(attn.c_k(x).view(B, T, attn.n_kv_head, D).transpose(1, 2)).repeat_interleave(2, 1)
    q, k = attn.position.rotate(q, k, 0)
    low = attn.low_dims
    gain = attn.w_std * torch.sigmoid(attn.skip_std)
    y = F.scaled_dot_product_attention(q[..., ~low] * gain, k[..., ~low], v, is_causal=True, scale=1 / math.sqrt(D))
    torch.testing.assert_close(attn(x), attn.c_proj(y.transpose(1, 2).reshape(B, T, -1)))


@torch.no_grad()
def test_hard_gated_inference_drops_exactly_the_gated_pathway():
    attn = make_attention("rope", rank=4, hard_gate_threshold=0.1)
    attn.skip_rec.fill_(-2.5)  # gate 0.076 < 0.1: skipped in eval
    attn.c_proj.weight.copy_(torch.eye(64))  # output = attention values, for the bound below
    x = torch.randn(2, 12, 64, dtype=torch.float64)
    soft = attn.train()(x)
    hard = attn.eval()(x)
    standard, reciprocal, v = explicit_terms(attn, x)
    torch.testing.assert_close(hard, attend(standard, v, attn))  # exactly the standard pathway
    # Removing a score term of at most δ moves each softmax weight by a factor in [e^-2δ, e^2δ],
    # so each output moves by at most (e^2δ − 1)·max|v|.
    delta = reciprocal.abs().max()
    change = (soft - hard).abs().max()
    assert 0 < change <= (math.exp(2 * delta) - 1) * v.abs().max()
    attn.skip_rec.fill_(0.0)  # gate 0.5 ≥ threshold: kept, eval equals train
    torch.testing.assert_close(attn.eval()(x), attn.train()(x))


def _randomized(config):
    model = GPT(config)
    with torch.no_grad():
        for p in model.parameters():
            if p.abs().sum() == 0:
                p.normal_(0, 0.05)
    return model.eval()


@pytest.mark.parametrize("n_kv_head", [4, 2])
def test_kv_cache_decoding_matches_full_recompute_for_every_new_block(n_kv_head):
    combos = [("reciprocal", "relu2", p) for p in POSITIONS.names()]
    combos += [("standard", "reciprocal", "rope"), ("reciprocal", "reciprocal", "fire")]
    combos += [("standard", "relu2", "fire", {"variant": "clamped", "shared": True}),
               ("standard", "relu2", "t5", {"shared": True})]
    idx = torch.randint(0, 256, (2, 12))
    for attention, mlp, position, *options in combos:
        config = GPTConfig(**{**SMALL, "n_kv_head": n_kv_head, "attention": attention, "mlp": mlp,
                              "position": position, "position_options": options[0] if options else {}})
        model = _randomized(config)
        full = model(idx)
        cache = KVCache(config.n_layer)
        pieces = [model(idx[:, :5], cache)] + [model(idx[:, t : t + 1], cache) for t in range(5, 9)]
        pieces.append(model(idx[:, 9:], cache))
        torch.testing.assert_close(torch.cat(pieces, 1), full, rtol=1e-5, atol=1e-5,
                                   msg=lambda m: f"{attention}/{mlp}/{position}: {m}")


def make_mlp(**options):
    config = GPTConfig(**{**SMALL, "mlp": "reciprocal", "mlp_options": options})
    mlp = GPT(config).blocks[0].mlp.double()
    with torch.no_grad():
        mlp.c_proj.weight.normal_(0, 0.1)
        mlp.skip_std.fill_(0.4)
        mlp.skip_rec.fill_(-0.2)
        mlp.alpha.fill_(0.7)
    return mlp


def test_reciprocal_mlp_matches_its_formula_and_with_zero_reciprocal_weight_is_a_plain_mlp():
    mlp = make_mlp(reciprocal_fraction=0.25)  # D_ff = 256: 192 standard + 64 reciprocal units
    assert (mlp.std_width, mlp.rec_width) == (192, 64)
    x, attn_out = torch.randn(3, 7, 64, dtype=torch.float64), torch.randn(3, 7, 64, dtype=torch.float64)
    W = mlp.c_proj.weight
    g_std, g_rec = torch.sigmoid(mlp.skip_std), torch.sigmoid(mlp.skip_rec)
    h_std = F.relu(x @ mlp.c_fc.weight.T) ** 2
    h_rec = F.relu((x + mlp.alpha * attn_out) @ mlp.c_fc_rec.weight.T) ** 2
    expected = (mlp.w_std * g_std * h_std) @ W[:, :192].T + (mlp.w_rec * g_rec * h_rec) @ W[:, 192:].T
    torch.testing.assert_close(mlp(x, attn_out=attn_out), expected)
    with torch.no_grad():
        mlp.w_rec.zero_()
    plain = (mlp.w_std * g_std * h_std) @ W[:, :192].T  # a relu² MLP of the standard width
    torch.testing.assert_close(mlp(x, attn_out=attn_out), plain)


def test_reciprocal_mlp_init_is_geometric_and_gates_start_asymmetric():
    mlp = GPT(GPTConfig(**{**SMALL, "mlp": "reciprocal"})).blocks[1].mlp  # D_ff 256, 3/8 reciprocal
    assert (mlp.std_width, mlp.rec_width) == (160, 96)
    assert mlp.w_std.item() == pytest.approx(0.625) and mlp.w_rec.item() == pytest.approx(0.375)
    assert mlp.skip_std.item() == 2.0 and mlp.skip_rec.item() == -3.0
    assert mlp.c_proj.weight.abs().sum() == 0 and mlp.c_fc_rec.weight.std() > 0
    attn = GPT(GPTConfig(**{**SMALL, "attention": "reciprocal", "attention_options": {"rank": 4}})).blocks[1].attn
    assert attn.w_std.item() == pytest.approx(12 / 16) and attn.w_rec.item() == pytest.approx(4 / 16)
    assert attn.skip_std.item() == 2.0 and attn.skip_rec.item() == -3.0


def test_reciprocal_mlp_neuron_layouts_name_the_rows_and_columns_of_each_unit():
    mlp = make_mlp(activation="gelu")
    layouts = mlp.neuron_layouts()
    assert [(lay.up, lay.down_columns) for lay in layouts] == [(mlp.c_fc, slice(0, 160)),
                                                                (mlp.c_fc_rec, slice(160, 256))]
    x, attn_out = torch.randn(2, 5, 64, dtype=torch.float64), torch.randn(2, 5, 64, dtype=torch.float64)
    # A forward pre-hook on the down projection (ReDo's) sees each layout's units in its columns.
    seen = []
    handle = mlp.c_proj.register_forward_pre_hook(lambda module, args: seen.append(args[0]))
    mlp(x, attn_out=attn_out)
    handle.remove()
    rec_units = seen[0][..., layouts[1].down_columns]
    expected = mlp.w_rec * torch.sigmoid(mlp.skip_rec) * F.gelu(mlp.c_fc_rec(x + mlp.alpha * attn_out))
    torch.testing.assert_close(rec_units, expected)
    for layout, unit in itertools.product(layouts, (0, 17, 95)):
        # Silencing a unit's input row (act(0) = 0) must equal cutting its output column.
        with torch.no_grad():
            saved_row = layout.up.weight[unit].clone()
            layout.up.weight[unit] = 0
            silenced = mlp(x, attn_out=attn_out)
            layout.up.weight[unit] = saved_row
            saved_col = layout.down.weight[:, layout.down_offset + unit].clone()
            layout.down.weight[:, layout.down_offset + unit] = 0
            cut = mlp(x, attn_out=attn_out)
            layout.down.weight[:, layout.down_offset + unit] = saved_col
        torch.testing.assert_close(silenced, cut)
        assert not torch.allclose(cut, mlp(x, attn_out=attn_out))


def test_reciprocal_mlp_hard_gating_removes_exactly_the_gated_contribution():
    mlp = make_mlp(hard_gate_threshold=0.1)
    with torch.no_grad():
        mlp.skip_rec.fill_(-3.0)
    x, attn_out = torch.randn(2, 5, 64, dtype=torch.float64), torch.randn(2, 5, 64, dtype=torch.float64)
    soft = mlp.train()(x, attn_out=attn_out)
    h_rec = F.relu(mlp.c_fc_rec(x + mlp.alpha * attn_out)) ** 2
    contribution = (mlp.w_rec * torch.sigmoid(mlp.skip_rec) * h_rec) @ mlp.c_proj.weight[:, 160:].T
    torch.testing.assert_close(mlp.eval()(x, attn_out=attn_out), soft - contribution)
    assert contribution.abs().max() > 1e-4
    with torch.no_grad():
        mlp.skip_std.fill_(-5.0)  # both pathways shut
    assert mlp.eval()(x, attn_out=attn_out).abs().max() == 0


def test_bad_options_name_the_field():
    with pytest.raises(ConfigError, match="rank"):
        GPT(GPTConfig(**{**SMALL, "attention": "reciprocal", "attention_options": {"rank": 16}}))
    with pytest.raises(ConfigError, match="hard_gate_threshold"):
        GPT(GPTConfig(**{**SMALL, "attention": "reciprocal", "attention_options": {"hard_gate_threshold": 1.5}}))
    with pytest.raises(ConfigError, match="reciprocal_fraction"):
        GPT(GPTConfig(**{**SMALL, "mlp": "reciprocal", "mlp_options": {"reciprocal_fraction": 1.0}}))
    with pytest.raises(ConfigError, match="activation"):
        GPT(GPTConfig(**{**SMALL, "mlp": "reciprocal", "mlp_options": {"activation": "tanh"}}))
    with pytest.raises(ValueError, match="every_n_steps"):
        GateLogger(every_n_steps=0)


def test_gate_logger_logs_each_layers_gates_and_refuses_models_without_gates():
    module, _ = build("gpt")  # GPT with standard blocks: nothing to log
    with pytest.raises(ValueError, match="no gated blocks"):
        cpu_trainer(max_steps=1, callbacks=[GateLogger()]).fit(module, token_loader())
    module = tiny_gpt_module(attention="reciprocal", mlp="reciprocal", position="fire", n_kv_head=1)
    trainer = cpu_trainer(max_steps=3, callbacks=[GateLogger(every_n_steps=1)])  # c_proj starts at 0
    trainer.fit(module, token_loader())
    metrics = trainer.callback_metrics
    for layer in (0, 1):
        for kind, keys in (("attn", ("gate_std", "gate_rec", "w_std", "w_rec")),
                           ("mlp", ("gate_std", "gate_rec", "w_std", "w_rec", "alpha"))):
            block = getattr(module.model.blocks[layer], kind)
            for key in keys:
                expected = block.gate_values()[key]
                assert metrics[f"gates/model.blocks.{layer}.{kind}/{key}"].item() == pytest.approx(expected.item())
            assert metrics[f"gates/model.blocks.{layer}.{kind}/std_on"] == 1.0
            assert metrics[f"gates/model.blocks.{layer}.{kind}/rec_on"] == 0.0
    assert module.model.blocks[0].attn.skip_rec.item() != -3.0  # the gates did train, and were logged after


@pytest.mark.slow  # every block combination trained: tens of seconds
def test_every_block_combination_composes_from_hydra_and_trains():
    combos = list(itertools.product(ATTENTIONS.names(), MLPS.names(), POSITIONS.names()))
    assert {"reciprocal"} <= set(ATTENTIONS.names()) and {"fire", "alibi", "t5"} <= set(POSITIONS.names())
    x, y = next(iter(token_loader(n=4, sequence_len=16, batch_size=4)))
    tiny = ["model.n_layer=1", "model.n_embd=32", "model.n_head=2", "model.n_kv_head=1", "model.sequence_len=16"]
    for n, (attention, mlp, position) in enumerate(combos):
        optimizer = ("adamw", "muon")[n % 2]
        cfg = compose_config(f"optimizer={optimizer}", f"model/attention={attention}", f"model/mlp={mlp}",
                             f"model/position={position}", *tiny)
        module = build_module(cfg)
        assert (module.config.attention, module.config.mlp, module.config.position) == (attention, mlp, position)
        opt = module.configure_optimizers()["optimizer"]
        params = dict(module.named_parameters())
        before = {name: p.detach().clone() for name, p in params.items()}
        got_gradient = set()
        for _ in range(3):  # zero-initialized c_proj and head: gradients reach every weight by step 3
            loss = module.loss(module(x), y)
            assert torch.isfinite(loss), (attention, mlp, position)
            opt.zero_grad()
            loss.backward()
            got_gradient |= {name for name, p in params.items() if p.grad is not None and p.grad.abs().sum() > 0}
            opt.step()
        where = f"{attention}/{mlp}/{position}/{optimizer}"
        assert got_gradient == set(params), f"{where}: no gradient for {set(params) - got_gradient}"
        assert all(torch.isfinite(p).all() for p in params.values()), where
        moved = {name for name, p in params.items() if not torch.equal(before[name], p)}
        # (a tiny first gradient, e.g. α's at step 3, may not move a float32 scalar under warmup)
        mixer_input = "in_proj" if attention == "mamba2" else "c_q"
        mlp_output = "experts.down_proj" if mlp == "moe" else "c_proj.weight"
        must_move = {"model.lm_head.weight", f"model.blocks.0.attn.{mixer_input}.weight",
                     f"model.blocks.0.mlp.{mlp_output}"}
        assert must_move <= moved, where


@pytest.mark.parametrize("kind", ["attn", "mlp"])
def test_block_scalars_are_one_element_and_a_0d_state_dict_loads_with_the_same_forward(kind):
    config = GPTConfig(**{**SMALL, "attention": "reciprocal", "mlp": "reciprocal"})
    block = getattr(GPT(config).blocks[0], kind).double()
    with torch.no_grad():
        for name in block.gate_values().keys() - {"gate_std", "gate_rec"} | {"skip_std", "skip_rec"}:
            getattr(block, name).uniform_(-1, 1)  # off their init: every scalar visible in the output
        block.c_proj.weight.normal_(0, 0.1)
    scalars = [n for n, p in block.named_parameters() if p.dim() < 2]
    assert scalars and all(getattr(block, n).shape == (1,) for n in scalars)  # fully_shard takes (1,), not ()
    x, attn_out = torch.randn(2, 5, 64, dtype=torch.float64), torch.randn(2, 5, 64, dtype=torch.float64)
    run = (lambda b: b(x)) if kind == "attn" else (lambda b: b(x, attn_out=attn_out))
    expected = run(block)
    zero_d = {k: v.reshape(()) if k in scalars else v for k, v in block.state_dict().items()}  # scalars stored 0-d
    fresh = getattr(GPT(config).blocks[0], kind).double()
    fresh.load_state_dict(zero_d)
    torch.testing.assert_close(run(fresh), expected, rtol=0, atol=0)
    for name in scalars:  # the same forward when the scalars are 0-d parameters
        setattr(fresh, name, torch.nn.Parameter(getattr(fresh, name).detach().reshape(())))
    torch.testing.assert_close(run(fresh), expected, rtol=0, atol=0)


def test_a_checkpoint_with_0d_block_scalars_resumes_training(tmp_path):
    module = tiny_gpt_module(attention="reciprocal", mlp="reciprocal")
    trainer = cpu_trainer(max_steps=2, default_root_dir=tmp_path)
    trainer.fit(module, token_loader())
    trainer.save_checkpoint(tmp_path / "new.ckpt")
    checkpoint = torch.load(tmp_path / "new.ckpt", weights_only=False)
    scalars = {k for k, v in checkpoint["state_dict"].items() if v.shape == (1,)}
    assert len(scalars) == 2 * (4 + 5)
    checkpoint["state_dict"] = {k: v.reshape(()) if k in scalars else v for k, v in checkpoint["state_dict"].items()}
    for state in checkpoint["optimizer_states"][0]["state"].values():  # Adam's moments of 0-d parameters
        state.update({k: v.reshape(()) for k, v in state.items() if k != "step" and v.shape == (1,)})
    torch.save(checkpoint, tmp_path / "zero_d.ckpt")
    check_shapes(checkpoint["state_dict"], module, "zero_d.ckpt")  # the resume guard lets it through
    resumed = {}
    for name in ("new", "zero_d"):
        module = tiny_gpt_module(attention="reciprocal", mlp="reciprocal")
        cpu_trainer(max_steps=4).fit(module, token_loader(), ckpt_path=tmp_path / f"{name}.ckpt")
        resumed[name] = module.state_dict()
    for key, value in resumed["new"].items():
        assert torch.equal(resumed["zero_d"][key], value), key
