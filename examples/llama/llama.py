"""A LLaMA-shaped causal language model in plain torch, with random weights and synthetic tokens.

The field notes' question (a 6.7 B LLaMA OOMs under DDP on an A6000; does 13 B fit, and how?)
asked of ``orchestrate plan`` without downloading anything: ``build`` makes the model of a
preset's shape (LLaMA-7B: width 4096, 32 blocks, 32 heads, SwiGLU 11,008, vocabulary 32,000:
6.74e9 parameters; LLaMA-13B: 5120, 40, 40, 13,824: 13.0e9; ``tiny`` for a run on CPUs), and
``tokens`` a dataset of random token sequences whose target is the sequence shifted by one.
The planner traces a training step on fake tensors (nothing is allocated), so the 7B and 13B
shapes are planned on a laptop; ``tiny`` trains for real in seconds.

Each block is pre-norm (RMSNorm), causal self-attention (``scaled_dot_product_attention``;
no rotary embedding: it has no parameters and changes no memory figure), and a SwiGLU MLP; the
head is not tied to the embedding (as in LLaMA).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import TensorDataset

#: width, blocks, heads, MLP width, vocabulary
PRESETS = {
    "tiny": (64, 2, 4, 172, 256),
    "7b": (4096, 32, 32, 11008, 32000),
    "13b": (5120, 40, 40, 13824, 32000),
}


class Block(nn.Module):
    """One decoder block: attention and a gated MLP, each behind an RMSNorm and a residual."""

    def __init__(self, width: int, heads: int, hidden: int) -> None:
        super().__init__()
        self.heads = heads
        self.attn_norm = nn.RMSNorm(width)
        self.q, self.k, self.v, self.o = (nn.Linear(width, width, bias=False) for _ in range(4))
        self.mlp_norm = nn.RMSNorm(width)
        self.gate = nn.Linear(width, hidden, bias=False)
        self.up = nn.Linear(width, hidden, bias=False)
        self.down = nn.Linear(hidden, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        h = self.attn_norm(x)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2)
                   for z in (self.q(h), self.k(h), self.v(h)))
        a = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(a.transpose(1, 2).reshape(b, t, c))
        h = self.mlp_norm(x)
        return x + self.down(nn.functional.silu(self.gate(h)) * self.up(h))


class Llama(nn.Module):
    """Embedding, the blocks, a final RMSNorm and the head: logits for every position."""

    def __init__(self, width: int, depth: int, heads: int, hidden: int, vocab: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(Block(width, heads, hidden) for _ in range(depth))
        self.norm = nn.RMSNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x)).flatten(0, 1)  # (batch x positions, vocabulary)


def build(preset: str = "tiny") -> nn.Module:
    """The model of ``preset`` (tiny, 7b, 13b), randomly initialised."""
    return Llama(*PRESETS[preset])


def tokens(seq: int = 64, samples: int = 256, vocab: int = 256, seed: int = 0
           ) -> tuple[TensorDataset, None]:
    """``samples`` random sequences of ``seq`` tokens below ``vocab`` (every preset's vocabulary
    holds them); the target of each position is the next token."""
    data = torch.randint(0, vocab, (samples, seq + 1),
                         generator=torch.Generator().manual_seed(seed))
    return TensorDataset(data[:, :-1], data[:, 1:]), None


def next_token_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of every position's logits against the next token."""
    return nn.functional.cross_entropy(logits.float(), target.flatten())
