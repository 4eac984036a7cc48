"""Modules a user brings, built by hand for the any-module tests of DP, ZeRO and the parameter server.

- TinyResNet: ResNet's shape (He et al. 2016) at toy size: a stem, stages that are
  nn.Sequential of BasicBlocks (each with BatchNorm, the first of a stage with a
  downsample nn.Sequential), a head. No nn.ModuleList anywhere. Built here because
  torchvision must not be installed beside the CPU torch.
- Branchy: a frozen input layer, a ModuleList of blocks, a branch no rank uses and a
  branch only some ranks use (a keyword argument switches it on), inputs by keyword.
- tiny Hugging Face models from local configs (transformers builds them; nothing is
  downloaded), dropout off.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.downsample = (nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
                           if stride != 1 or cin != cout else None)

    def forward(self, x):
        identity = x if self.downsample is None else self.downsample(x)
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + identity)


class TinyResNet(nn.Module):
    def __init__(self, width: int = 8, classes: int = 4):
        super().__init__()
        self.conv1 = nn.Conv2d(3, width, 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.layer1 = nn.Sequential(BasicBlock(width, width, 1), BasicBlock(width, width, 1))
        self.layer2 = nn.Sequential(BasicBlock(width, 2 * width, 2), BasicBlock(2 * width, 2 * width, 1))
        self.fc = nn.Linear(2 * width, classes)

    def forward(self, pixel_values):
        x = F.relu(self.bn1(self.conv1(pixel_values)))
        x = self.layer2(self.layer1(x))
        return self.fc(x.mean(dim=(2, 3)))

    def blocks(self) -> list[nn.Module]:
        return [*self.layer1, *self.layer2]


class Branchy(nn.Module):
    """`unused` is called by no rank; `extra` only where forward gets use_extra=True."""

    def __init__(self, width: int = 16):
        super().__init__()
        self.frozen = nn.Linear(8, width)
        self.frozen.requires_grad_(False)
        self.blocks = nn.ModuleList(nn.Linear(width, width) for _ in range(2))
        self.unused = nn.Linear(width, width)
        self.extra = nn.Linear(width, width)
        self.head = nn.Linear(width, 4)

    def forward(self, pixel_values, use_extra: bool = False):
        h = torch.tanh(self.frozen(pixel_values))
        for block in self.blocks:
            h = h + torch.tanh(block(h))
        if use_extra:
            h = h + self.extra(h)
        return self.head(h)


def image_batch(step: int, rank: int, n: int = 4, size: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(n, 3, size, size, generator=g), torch.randint(0, 4, (n,), generator=g)


def vector_batch(step: int, rank: int, n: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(n, 8, generator=g), torch.randint(0, 4, (n,), generator=g)


def token_batch(step: int, rank: int, vocab: int = 128, n: int = 2, seq: int = 16) -> torch.Tensor:
    return torch.randint(0, vocab, (n, seq), generator=torch.Generator().manual_seed(1000 * step + rank))


def tiny_llama(seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                      attention_dropout=0.0, tie_word_embeddings=False)
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg)


def tiny_gpt2(seed: int = 0):
    from transformers import GPT2Config, GPT2LMHeadModel
    cfg = GPT2Config(vocab_size=128, n_embd=32, n_layer=2, n_head=4, n_positions=32, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(seed)
    return GPT2LMHeadModel(cfg)
