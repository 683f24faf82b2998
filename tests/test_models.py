import itertools

import pytest
import torch

from plasticity_callbacks.errors import ConfigError
from plasticity_callbacks.model_map import select_targets
from plasticity_callbacks.models import ATTENTIONS, GPT, MLPS, POSITIONS, GPTConfig, KVCache
from plasticity_callbacks.models.blocks.mlp import gated_hidden_width

SMALL = dict(n_layer=2, n_head=4, n_kv_head=2, n_embd=32, sequence_len=16)


@pytest.mark.parametrize("mlp,attention,position",
                         list(itertools.product(MLPS.names(), ATTENTIONS.names(), POSITIONS.names())))
def test_every_block_combination_runs_forward_and_backward(mlp, attention, position):
    model = GPT(GPTConfig(mlp=mlp, attention=attention, position=position, **SMALL))
    idx = torch.randint(0, 256, (3, 16))
    logits = model(idx)
    assert logits.shape == (3, 16, 264) and logits.dtype == torch.float32
    # The zero-initialized head gives zero logits and no gradient below it; train one step's worth first.
    torch.nn.init.normal_(model.lm_head.weight, std=0.02)
    for block in model.blocks:  # the output projections: c_proj, an SSM's out_proj, the experts' down_proj
        for p in block.parameters():
            if p.dim() >= 2 and p.abs().sum() == 0:
                torch.nn.init.normal_(p, std=0.02)
    torch.nn.functional.cross_entropy(model(idx).flatten(0, 1), idx.flatten()).backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
        assert p.grad.abs().sum() > 0, f"{name} got no gradient"


def test_gated_mlp_matches_relu2_parameter_count():
    d = 128
    relu2 = GPT(GPTConfig(n_embd=d, mlp="relu2", n_layer=1)).blocks[0].mlp
    swiglu = GPT(GPTConfig(n_embd=d, mlp="swiglu", n_layer=1, mlp_options={"multiple_of": 32})).blocks[0].mlp
    n_relu2 = sum(p.numel() for p in relu2.parameters())
    n_swiglu = sum(p.numel() for p in swiglu.parameters())
    assert n_relu2 == 8 * d * d
    assert 0 <= n_swiglu - n_relu2 < 3 * 32 * d  # equal up to rounding the width to a multiple of 32
    assert gated_hidden_width(768, 4, 256) == 2048  # LLaMA's rule: 8/3·d rounded up


def test_init_matches_the_seed():
    model = GPT(GPTConfig(n_layer=2, n_embd=64, n_head=4))
    assert model.lm_head.weight.abs().sum() == 0
    for block in model.blocks:
        assert block.attn.c_proj.weight.abs().sum() == 0 and block.mlp.c_proj.weight.abs().sum() == 0
    w = model.blocks[0].mlp.c_fc.weight  # fan_out 256 > fan_in 64: std = 1/sqrt(64)
    assert abs(w.std().item() - 1 / 8) < 0.01
    assert abs(model.wte.weight.std().item() - 1.0) < 0.05


def _randomize(model):
    with torch.no_grad():
        for p in model.parameters():
            if p.abs().sum() == 0:
                p.normal_(0, 0.05)
    return model


@pytest.mark.parametrize("position", POSITIONS.names())
@pytest.mark.parametrize("n_kv_head", [4, 2])
def test_kv_cache_decoding_matches_full_recompute(position, n_kv_head):
    model = _randomize(GPT(GPTConfig(**{**SMALL, "n_kv_head": n_kv_head, "position": position}))).eval()
    idx = torch.randint(0, 256, (2, 12))
    full = model(idx)
    cache = KVCache(model.config.n_layer)
    pieces = [model(idx[:, :5], cache)]  # multi-token prefill
    pieces += [model(idx[:, t : t + 1], cache) for t in range(5, 9)]  # one token at a time
    pieces += [model(idx[:, 9:], cache)]  # a chunk on top of a non-empty cache
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, rtol=1e-5, atol=1e-5)


def test_generate_matches_greedy_recompute():
    model = _randomize(GPT(GPTConfig(**SMALL))).eval()
    prompt = torch.randint(0, 256, (1, 5))
    out = model.generate(prompt, max_new_tokens=6, temperature=0)
    seq = prompt
    for _ in range(6):  # greedy decoding without any cache
        seq = torch.cat([seq, model(seq)[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(out, seq)


def test_generation_beyond_training_length():
    model = _randomize(GPT(GPTConfig(**SMALL))).eval()
    out = model.generate(torch.randint(0, 256, (1, 4)), max_new_tokens=40, temperature=1.0, top_k=5)
    assert out.shape == (1, 44)


def test_bad_block_name_names_the_field_and_choices():
    with pytest.raises(ConfigError, match=r"model.mlp='swiglo'.*relu2.*swiglu"):
        GPTConfig(mlp="swiglo")
    with pytest.raises(ConfigError, match="n_kv_head"):
        GPTConfig(n_head=4, n_kv_head=3)
    with pytest.raises(ConfigError, match="bad options"):
        GPT(GPTConfig(mlp="relu2", mlp_options={"hiden_mult": 4}))


def test_projection_weights_have_roles():
    model = GPT(GPTConfig(**{**SMALL, "mlp": "swiglu"}))
    found = {t.name: t.role for t in select_targets(model)}
    assert found["blocks.0.attn.c_q.weight"] == "attention"
    assert found["blocks.1.attn.c_proj.weight"] == "attention"
    assert found["blocks.0.mlp.c_gate.weight"] == "mlp"
    assert "lm_head.weight" not in found and "wte.weight" not in found
    assert len(found) == 2 * (4 + 3)


def test_rope_table_grown_past_training_length_equals_one_built_that_long():
    short = GPT(GPTConfig(**SMALL)).blocks[0].attn.position
    long = GPT(GPTConfig(**{**SMALL, "sequence_len": 64})).blocks[0].attn.position
    assert short.cos.shape[0] == 16  # built once for the training length: a compiled forward never re-traces
    q, k = torch.randn(1, 4, 5, 8), torch.randn(1, 2, 5, 8)
    for a, b in zip(short.rotate(q, k, offset=40), long.rotate(q, k, offset=40)):  # positions 40..44
        torch.testing.assert_close(a, b)
    assert short.cos.shape[0] >= 45 and not short.cos.is_inference()


@pytest.mark.parametrize("mlp", ["relu2", "swiglu", "reciprocal"])
def test_hidden_observer_sees_exactly_the_down_projection_input(mlp):
    model = GPT(GPTConfig(mlp=mlp, **SMALL))
    block = model.blocks[1].mlp
    observed, entering = [], []
    block.hidden_observer = lambda module, h: observed.append((module, h))
    block.c_proj.register_forward_pre_hook(lambda module, args: entering.append(args[0]))
    model(torch.randint(0, 256, (2, 16)))
    assert len(observed) == 1 and observed[0][0] is block
    assert torch.equal(observed[0][1], entering[0])
    assert all(b.mlp.hidden_observer is None for b in model.blocks if b.mlp is not block)
