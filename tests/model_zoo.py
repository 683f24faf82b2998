"""Tiny models of every family the model map supports, each wrapped in one LightningModule.

Hugging Face models are built from small configs with random init (never downloaded). Dropout
is off everywhere, so a gradient pass is deterministic and tests can recompute it.
"""
from __future__ import annotations

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

VOCAB, SEQ, WIDTH = 40, 8, 16
FAMILIES = ("gpt2", "llama", "mistral", "bert", "torch_encoder", "resnet", "mlp")


def _quiet(fn):
    import transformers

    transformers.logging.set_verbosity_error()
    return fn()


def gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_embd=WIDTH, n_layer=2, n_head=2, vocab_size=VOCAB, n_positions=SEQ, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    return _quiet(lambda: GPT2LMHeadModel(config))


def llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=WIDTH, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=SEQ, bos_token_id=0,
                         eos_token_id=0, pad_token_id=0)
    return _quiet(lambda: LlamaForCausalLM(config))


def mistral() -> nn.Module:
    from transformers import MistralConfig, MistralForCausalLM

    config = MistralConfig(hidden_size=WIDTH, intermediate_size=24, num_hidden_layers=1, num_attention_heads=4,
                           num_key_value_heads=1, vocab_size=VOCAB, max_position_embeddings=SEQ, sliding_window=None,
                           bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return _quiet(lambda: MistralForCausalLM(config))


def bert() -> nn.Module:
    from transformers import BertConfig, BertForMaskedLM

    config = BertConfig(hidden_size=WIDTH, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
                        vocab_size=VOCAB, max_position_embeddings=SEQ, hidden_dropout_prob=0.0,
                        attention_probs_dropout_prob=0.0, pad_token_id=0)
    return _quiet(lambda: BertForMaskedLM(config))


class TorchEncoder(nn.Module):
    """``nn.TransformerEncoder`` (fused ``in_proj_weight``, ``linear1 -> relu -> linear2``) and a linear head."""

    def __init__(self):
        super().__init__()
        layer = nn.TransformerEncoderLayer(WIDTH, nhead=2, dim_feedforward=32, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        self.head = nn.Linear(WIDTH, 3)

    def forward(self, x):
        return self.head(self.encoder(x).mean(1))


class BasicBlock(nn.Module):
    """ResNet basic block: conv -> BN -> ReLU -> conv -> BN, plus the identity."""

    def __init__(self, channels: int):
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(out)) + x)


class TinyResNet(nn.Module):
    """Stem, one basic block, then conv -> ReLU -> flatten -> Linear -> ReLU -> head on 6×6 images."""

    def __init__(self, channels: int = 8, classes: int = 3):
        super().__init__()
        self.stem = nn.Conv2d(3, channels, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(channels)
        self.block = BasicBlock(channels)
        self.reduce = nn.Conv2d(channels, 4, 1)
        self.fc = nn.Linear(4 * 6 * 6, 16)
        self.head = nn.Linear(16, classes)

    def forward(self, x):
        x = self.block(F.relu(self.bn(self.stem(x))))
        x = torch.flatten(F.relu(self.reduce(x)), 1)  # (B, 4·6·6)
        return self.head(F.relu(self.fc(x)))


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 3))


MODELS = {"gpt2": gpt2, "llama": llama, "mistral": mistral, "bert": bert, "torch_encoder": TorchEncoder,
          "resnet": TinyResNet, "mlp": mlp}


def batches(family: str, n: int = 4, batch: int = 4, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    if family in ("gpt2", "llama", "mistral", "bert", *LAYOUT_MODELS, *FRONTIER_MODELS):
        ids = torch.randint(1, VOCAB, (n * batch, SEQ), generator=g)
        return TensorDataset(ids, ids.clone())
    x = {"torch_encoder": (SEQ, WIDTH), "resnet": (3, 6, 6), "mlp": (8,), "conv_zoo": (8, 4, 4),
         "recurrent": (5, 6)}[family]
    return TensorDataset(torch.randn(n * batch, *x, generator=g), torch.randint(0, 3, (n * batch,), generator=g))


def loss_of(family: str, model: nn.Module, batch) -> torch.Tensor:
    x, y = batch
    if family in ("gpt2", "llama", "mistral", "bert", *LAYOUT_MODELS, *FRONTIER_MODELS):
        return model(input_ids=x, labels=y).loss
    return F.cross_entropy(model(x), y)


class Wrapped(L.LightningModule):
    """Any zoo model under Lightning; SGD with ``lr=0`` by default, so weights change only by callbacks."""

    def __init__(self, family: str, lr: float = 0.0, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.family, self.lr = family, lr
        self.model = MODELS[family]()

    def forward(self, x):
        return self.model(x)

    def training_step(self, batch, batch_idx):
        return loss_of(self.family, self.model, batch)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)

    def train_dataloader(self):
        return DataLoader(batches(self.family), batch_size=4)


# Families by layout class of their fused or structured weights (FIRE and the map's coverage are
# checked on these against each family's own forward code, see test_model_matrix.py).
def _hf(config_name: str, model_name: str, **fields):
    import transformers

    config = getattr(transformers, config_name)(vocab_size=VOCAB, **fields)
    return _quiet(lambda: getattr(transformers, model_name)(config))


HEADS_, KV_ = 4, 2  # query heads, key/value heads of the grouped-query families
LAYOUT_MODELS = {
    # [heads, 3, head_dim]: view(..., heads, 3·head_dim) then chunk(3)
    "gpt_neox": lambda: _hf("GPTNeoXConfig", "GPTNeoXForCausalLM", hidden_size=WIDTH, intermediate_size=32,
                            num_hidden_layers=1, num_attention_heads=HEADS_, max_position_embeddings=SEQ),
    "bloom": lambda: _hf("BloomConfig", "BloomForCausalLM", hidden_size=WIDTH, n_layer=1, n_head=HEADS_),
    # [kv_groups, q_per_kv + 2, head_dim], K/V head count in the config field num_kv_heads
    "falcon_gqa": lambda: _hf("FalconConfig", "FalconForCausalLM", hidden_size=WIDTH, num_hidden_layers=1,
                              num_attention_heads=HEADS_, num_kv_heads=KV_, new_decoder_architecture=True, alibi=False),
    # [q | k | v] with one K/V head, from multi_query=True
    "falcon_mqa": lambda: _hf("FalconConfig", "FalconForCausalLM", hidden_size=WIDTH, num_hidden_layers=1,
                              num_attention_heads=HEADS_, multi_query=True, new_decoder_architecture=False),
    "bigcode_mqa": lambda: _hf("GPTBigCodeConfig", "GPTBigCodeForCausalLM", n_embd=WIDTH, n_layer=1, n_head=HEADS_,
                               multi_query=True, n_positions=SEQ, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
    # [q | k | v] with num_key_value_heads; fused gate_up_proj
    "phi3": lambda: _hf("Phi3Config", "Phi3ForCausalLM", hidden_size=WIDTH, intermediate_size=24, num_hidden_layers=1,
                        num_attention_heads=HEADS_, num_key_value_heads=KV_, max_position_embeddings=SEQ,
                        pad_token_id=0, bos_token_id=0, eos_token_id=0),
}


class ConvZoo(nn.Module):
    """Grouped, depthwise (with a channel multiplier) and transposed convolutions, then a head."""

    def __init__(self):
        super().__init__()
        self.grouped = nn.Conv2d(8, 8, 3, padding=1, groups=4)
        self.depthwise = nn.Conv2d(8, 16, 3, padding=1, groups=8)
        self.up = nn.ConvTranspose2d(16, 6, 2, stride=2)
        self.up_grouped = nn.ConvTranspose2d(6, 4, 3, padding=1, groups=2)
        self.head = nn.Linear(4, 3)

    def forward(self, x):  # (B, 8, H, W)
        x = self.up_grouped(F.relu(self.up(F.relu(self.depthwise(F.relu(self.grouped(x)))))))
        return self.head(x.mean((2, 3)))


class Recurrent(nn.Module):
    """An LSTM (4 gates), a GRU (3 gates), a bidirectional RNN and a head."""

    def __init__(self):
        super().__init__()
        self.lstm = nn.LSTM(6, 8, num_layers=2, batch_first=True)
        self.gru = nn.GRU(8, 5, batch_first=True)
        self.rnn = nn.RNN(5, 4, batch_first=True, bidirectional=True)
        self.head = nn.Linear(8, 3)

    def forward(self, x):  # (B, T, 6)
        x = self.rnn(self.gru(self.lstm(x)[0])[0])[0]
        return self.head(x[:, -1])


MODELS.update(conv_zoo=ConvZoo, recurrent=Recurrent, **LAYOUT_MODELS)


# The frontier (issue 32): mixture-of-experts with fused 3-D expert tensors, latent attention, state-space
# layers and hybrids, a split-input encoder MLP. Two layers where a family mixes layer kinds.
_MOE = dict(hidden_size=WIDTH, intermediate_size=12, num_hidden_layers=1, num_attention_heads=HEADS_,
            num_key_value_heads=KV_, max_position_embeddings=SEQ, pad_token_id=0, bos_token_id=0, eos_token_id=0)
FRONTIER_MODELS = {
    # experts.gate_up_proj (E, 2I, H) used by F.linear, .chunk(2): contiguous (out, in)
    "mixtral": lambda: _hf("MixtralConfig", "MixtralForCausalLM", num_local_experts=4, num_experts_per_tok=2, **_MOE),
    "qwen3_moe": lambda: _hf("Qwen3MoeConfig", "Qwen3MoeForCausalLM", num_experts=4, num_experts_per_tok=2,
                             moe_intermediate_size=12, decoder_sparse_step=1, head_dim=4, **_MOE),
    # experts.gate_up_proj (E, H, 2I) used by x @ W[e], gate = [..., ::2]: interleaved (in, out), with biases
    "gpt_oss": lambda: _hf("GptOssConfig", "GptOssForCausalLM", num_local_experts=4, num_experts_per_tok=2,
                           head_dim=4, sliding_window=SEQ, layer_types=["full_attention"], **_MOE),
    # latent attention: q_a/q_b, kv_a_proj_with_mqa = [latent | rope key], kv_b = per head [k_nope | v]; one MoE layer
    "deepseek_v3": lambda: _hf("DeepseekV3Config", "DeepseekV3ForCausalLM", hidden_size=WIDTH, intermediate_size=24,
                               moe_intermediate_size=8, num_hidden_layers=2, first_k_dense_replace=1,
                               num_attention_heads=HEADS_, num_key_value_heads=HEADS_, q_lora_rank=12,
                               kv_lora_rank=8, qk_nope_head_dim=4, qk_rope_head_dim=2, v_head_dim=6, n_routed_experts=4,
                               num_experts_per_tok=2, n_group=1, topk_group=1, n_shared_experts=1,
                               max_position_embeddings=SEQ, pad_token_id=0, bos_token_id=0, eos_token_id=0),
    # in_proj = [x | z], x_proj = [dt | B | C], depthwise conv1d, A_log (2-D), D
    "mamba": lambda: _hf("MambaConfig", "MambaForCausalLM", hidden_size=WIDTH, state_size=4, num_hidden_layers=1,
                         expand=2, conv_kernel=3, time_step_rank=2, use_mambapy=False, pad_token_id=0,
                         bos_token_id=0, eos_token_id=0),
    # in_proj = [z | x | B | C | dt] (x, B, C cut after the depthwise conv), A_log, D, dt_bias (1-D)
    "mamba2": lambda: _hf("Mamba2Config", "Mamba2ForCausalLM", hidden_size=WIDTH, state_size=4, num_hidden_layers=1,
                          expand=2, head_dim=8, num_heads=4, n_groups=1, conv_kernel=3, chunk_size=4,
                          pad_token_id=0, bos_token_id=0, eos_token_id=0),
    # hybrid: a Mamba layer and an attention layer, each with a MoE MLP
    "jamba": lambda: _hf("JambaConfig", "JambaForCausalLM", hidden_size=WIDTH, intermediate_size=12,
                         num_hidden_layers=2, num_attention_heads=HEADS_, num_key_value_heads=KV_, num_experts=4,
                         num_experts_per_tok=2, expert_layer_period=1, expert_layer_offset=0, attn_layer_period=2,
                         attn_layer_offset=1, mamba_d_state=4, mamba_d_conv=3, mamba_expand=2, mamba_dt_rank=2,
                         use_mamba_kernels=False, max_position_embeddings=SEQ, pad_token_id=0, bos_token_id=0,
                         eos_token_id=0),
    # encoder MLP: Wi(x).chunk(2) -> act(input) * gate; fused Wqkv
    "modernbert": lambda: _hf("ModernBertConfig", "ModernBertForMaskedLM", hidden_size=WIDTH, intermediate_size=12,
                              num_hidden_layers=1, num_attention_heads=HEADS_, max_position_embeddings=SEQ,
                              global_attn_every_n_layers=1, pad_token_id=0, bos_token_id=0, eos_token_id=0,
                              cls_token_id=0, sep_token_id=0),
}
MODELS.update(FRONTIER_MODELS)
