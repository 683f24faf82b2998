"""FIRE, ALiBi and T5 positional biases against hand-computed values and explicit attention."""
import math

import pytest
import torch

from plasticity_callbacks.errors import ConfigError
from plasticity_callbacks.model_map import select_targets
from plasticity_callbacks.models import GPT, GPTConfig
from plasticity_callbacks.models.blocks import rms_norm
from plasticity_callbacks.models.blocks.position_bias import (
    alibi_slopes, clamped_interpolation, fire_interpolation, relative_distance, t5_causal_buckets)

SMALL = dict(n_layer=2, n_head=4, n_kv_head=2, n_embd=32, sequence_len=16)
BIASES = [("fire", {}), ("fire", {"variant": "clamped"}), ("alibi", {}), ("t5", {})]


def position_block(position, n_head=4, layer=0, **options):
    config = GPTConfig(**{**SMALL, "n_head": n_head, "n_kv_head": n_head, "n_embd": 8 * n_head, "position": position,
                          "position_options": options})
    return GPT(config).blocks[layer].attn.position


def test_alibi_slopes_match_hand_computed_values():
    assert alibi_slopes(4).tolist() == [0.25, 0.0625, 0.015625, 0.00390625]
    assert alibi_slopes(8).tolist() == [2.0 ** -k for k in range(1, 9)]
    # 6 heads: the 4-head slopes, then every other slope of the 8-head set
    assert alibi_slopes(6).tolist() == [0.25, 0.0625, 0.015625, 0.00390625, 0.5, 0.125]
    bias = position_block("alibi", n_head=4).score_bias(5, 5, 0)
    assert bias[1, 4, 1].item() == -0.0625 * 3 and bias[0, 2, 2].item() == 0.0
    assert position_block("alibi", n_head=6).score_bias(3, 3, 0).shape == (6, 3, 3)


def test_t5_causal_buckets_match_hand_computed_values():
    # 32 buckets, max distance 128: 0..15 exact; then 16 + floor(log(n/16)/log(8)·16), capped at 31.
    distances = torch.tensor([0, 1, 15, 16, 20, 32, 64, 127, 128, 1000])
    assert t5_causal_buckets(distances).tolist() == [0, 1, 15, 16, 17, 21, 26, 31, 31, 31]
    assert t5_causal_buckets(torch.tensor([0, 3, 4, 5, 8, 100]), num_buckets=8, max_distance=16).tolist() == \
        [0, 3, 4, 4, 6, 7]  # 4 + floor(log(n/4)/log(4)·4): n=5 -> 4 + 0, n=8 -> 4 + 2, n=100 -> capped 7


def test_t5_bias_reads_its_table_by_bucket():
    block = position_block("t5")
    with torch.no_grad():
        block.table.weight.copy_(torch.randn(32, 4))
    bias = block.score_bias(40, 40, 0)
    i, j = 37, 3  # distance 34 -> bucket 16 + floor(log(34/16)/log 8·16) = 21
    assert torch.equal(bias[:, i, j], block.table.weight[21])
    assert torch.equal(bias[:, 20, 0], block.table.weight[17])


def test_fire_interpolation_is_shift_invariant_below_the_threshold_and_query_normalized_above():
    c, L = torch.tensor(0.1), torch.tensor(8.0)
    distance, query = relative_distance(30, 30, 0)
    x = fire_interpolation(distance, query, c, L)
    assert x[4, 1].item() == pytest.approx(math.log(1.3) / math.log(1.8))  # i=4 < L: ψ(3)/ψ(L)
    assert x[20, 5].item() == pytest.approx(math.log(2.5) / math.log(3.0))  # i=20 > L: ψ(15)/ψ(20)
    # below L a distance maps to the same value whatever the query: ALiBi/T5-like, shift-invariant
    assert x[5, 2].item() == pytest.approx(x[7, 4].item()) and x[7, 4].item() == pytest.approx(x[8, 5].item())
    # above L each query maps its keys onto [0, 1]: the first key is 1, the same distance shrinks with i
    assert torch.allclose(x[8:, 0], torch.ones(22))
    distance_3 = x[torch.arange(8, 30), torch.arange(5, 27)]  # x[i, i-3]
    assert (distance_3[1:] < distance_3[:-1]).all() and (x >= 0).all() and (x <= 1 + 1e-6).all()
    # the seed's variant clamps instead: past L_h everything is 1
    clamped = clamped_interpolation(distance, torch.tensor([4.0, 16.0]))
    assert clamped[0, 20, 10].item() == 1.0 and clamped[1, 20, 10].item() == pytest.approx(math.log(11) / math.log(17))


@pytest.mark.parametrize("variant", ["paper", "clamped"])
def test_fire_bias_shape_and_near_zero_init(variant):
    block = position_block("fire", variant=variant)
    bias = block.score_bias(64, 64, 0)
    assert bias.shape == (4, 64, 64) and torch.isfinite(bias).all()
    # small next to QK-normed scores (up to √hd ≈ 2.8 here), yet not identically zero: it can learn
    assert 0 < bias.abs().max() < 0.25
    assert bias[:, 40, :41].std() > 0  # it varies with distance


def test_fire_bias_is_added_before_softmax_under_the_causal_mask():
    model = GPT(GPTConfig(**{**SMALL, "n_kv_head": 4, "position": "fire"}))
    attn = model.blocks[0].attn
    with torch.no_grad():
        attn.position.fire.mlp[2].weight.normal_(0, 1.0)  # a bias large enough to matter
        attn.c_proj.weight.normal_(0, 0.1)
    x = torch.randn(2, 12, 32)
    B, T, H, D = 2, 12, 4, 8
    q = rms_norm(attn.c_q(x).view(B, T, H, D).transpose(1, 2))
    k = rms_norm(attn.c_k(x).view(B, T, H, D).transpose(1, 2))
    v = attn.c_v(x).view(B, T, H, D).transpose(1, 2)
    scores = q @ k.transpose(-1, -2) / math.sqrt(D) + attn.position.score_bias(T, T, 0)
    scores = scores.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
    y = (torch.softmax(scores, -1) @ v).transpose(1, 2).reshape(B, T, -1)
    torch.testing.assert_close(attn(x), attn.c_proj(y))
    # causal: changing the last token leaves every earlier output alone
    x2 = x.clone()
    x2[:, -1] = torch.randn(2, 32)
    torch.testing.assert_close(attn(x2)[:, :-1], attn(x)[:, :-1])


@pytest.mark.parametrize("position,options", BIASES)
def test_bias_rows_for_new_queries_equal_the_full_matrix(position, options):
    block = position_block(position, **options)
    with torch.no_grad():
        for p in block.parameters():
            p.add_(torch.randn_like(p) * 0.3)  # off init: rows must match for any parameters
    full = block.score_bias(40, 40, 0)
    for t in (0, 1, 17, 39):  # one new query over a cache of t keys
        # equal up to float rounding (FIRE's MLP runs a matmul of another shape)
        torch.testing.assert_close(block.score_bias(1, t + 1, t), full[:, t : t + 1, : t + 1], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(block.score_bias(6, 30, 24), full[:, 24:30, :30], rtol=1e-6, atol=1e-7)  # a chunk


@pytest.mark.parametrize("position,options", BIASES)
def test_evaluating_at_2x_and_4x_the_training_length_works(position, options):
    model = GPT(GPTConfig(**{**SMALL, "position": position, "position_options": options})).eval()
    for length in (32, 64):
        logits = model(torch.randint(0, 256, (1, length)))
        assert logits.shape == (1, length, 264) and torch.isfinite(logits).all()
    out = model.generate(torch.randint(0, 256, (1, 4)), max_new_tokens=60, temperature=1.0, top_k=5)
    assert out.shape == (1, 64)


def test_shared_option_uses_one_module_for_all_layers_of_one_model():
    config = GPTConfig(**{**SMALL, "n_layer": 3, "position": "fire", "position_options": {"shared": True}})
    a, b = GPT(config), GPT(config)
    fires = [block.attn.position.fire for block in a.blocks]
    assert fires[0] is fires[1] is fires[2]
    assert b.blocks[0].attn.position.fire is not fires[0]  # a second model from the same config has its own
    per_layer = GPT(GPTConfig(**{**SMALL, "n_layer": 3, "position": "fire"}))
    assert per_layer.blocks[0].attn.position.fire is not per_layer.blocks[1].attn.position.fire
    count = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    fire_params = count(fires[0])
    assert count(per_layer) - count(a) == 2 * fire_params
    t5 = GPT(GPTConfig(**{**SMALL, "position": "t5", "position_options": {"shared": True}}))
    assert t5.blocks[0].attn.position.table is t5.blocks[1].attn.position.table


def test_positional_parameters_are_left_to_adamw_and_bad_options_name_the_field():
    model = GPT(GPTConfig(**{**SMALL, "position": "fire"}))
    assert not [t.name for t in select_targets(model) if "position" in t.name]
    with pytest.raises(ConfigError, match="variant"):
        GPT(GPTConfig(**{**SMALL, "position": "fire", "position_options": {"variant": "linear"}}))
    with pytest.raises(ConfigError, match="max_distance"):
        GPT(GPTConfig(**{**SMALL, "position": "t5", "position_options": {"max_distance": 8}}))
    with pytest.raises(ConfigError, match="bad options"):
        GPT(GPTConfig(**{**SMALL, "position": "alibi", "position_options": {"slope": 1}}))
