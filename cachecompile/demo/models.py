"""Small bundled models for the demo, the tests and the benchmarks.

Everything here depends on torch only. The forward methods are pure: they read
parameters and buffers but never assign to them or to any attribute of ``self``,
so Dynamo traces each of them as a single graph (``fullgraph=True``) with
``dynamic=False`` and with ``dynamic=True``.

``TinyDecoderLM`` has two entry points that compile to different graphs:

- ``prefill(tokens)``: logits for every position (causal attention);
- ``decode(tokens)``: logits for the last position only. There is no KV cache:
  the whole sequence is recomputed, which keeps the method free of side effects.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = [
    "AddOne",
    "Attention",
    "BufferModule",
    "DecoderBlock",
    "DecoderConfig",
    "MLP",
    "RMSNorm",
    "RotaryEmbedding",
    "SwiGLU",
    "TinyDecoderLM",
    "anchor_config",
    "apply_rotary",
    "build_decoder",
    "demo_config",
    "make_inputs",
    "make_mlp_input",
    "with_config",
]


@dataclass(frozen=True)
class DecoderConfig:
    """Shape of a :class:`TinyDecoderLM` and of its default inputs.

    ``seq`` and ``batch`` are the default input shape (used by :func:`make_inputs`);
    ``max_seq`` bounds the rotary tables and defaults to ``seq``.
    """

    vocab: int = 512
    hidden: int = 128
    layers: int = 2
    heads: int = 4
    seq: int = 64
    batch: int = 2
    intermediate: int | None = None
    max_seq: int | None = None
    rope_base: float = 10000.0
    eps: float = 1e-6

    def __post_init__(self) -> None:
        if self.hidden % self.heads != 0:
            raise ValueError(f"hidden ({self.hidden}) must be a multiple of heads ({self.heads})")
        if self.head_dim % 2 != 0:
            raise ValueError(f"head_dim ({self.head_dim}) must be even for rotary embeddings")
        if self.seq_limit < self.seq:
            raise ValueError(f"max_seq ({self.max_seq}) must be >= seq ({self.seq})")
        for name in ("vocab", "hidden", "layers", "heads", "seq", "batch"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def ffn_dim(self) -> int:
        """SwiGLU inner width: ``intermediate`` or about 8/3 of hidden, rounded up to 32."""
        if self.intermediate is not None:
            return self.intermediate
        return ((8 * self.hidden // 3) + 31) // 32 * 32

    @property
    def seq_limit(self) -> int:
        return self.max_seq if self.max_seq is not None else self.seq


def demo_config() -> DecoderConfig:
    """A decoder small enough to compile in seconds on two CPU cores."""
    return DecoderConfig(vocab=512, hidden=128, layers=2, heads=4, seq=64, batch=2)


def anchor_config() -> DecoderConfig:
    """The 4-layer decoder used for the reference figures (hidden 256, seq 128, batch 2)."""
    return DecoderConfig(vocab=1024, hidden=256, layers=4, heads=4, seq=128, batch=2)


class RMSNorm(nn.Module):
    """Root-mean-square layer norm with a learned scale."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        variance = x.pow(2).mean(dim=-1, keepdim=True)
        return x * torch.rsqrt(variance + self.eps) * self.weight


class RotaryEmbedding(nn.Module):
    """Precomputed rotary tables: ``cos`` and ``sin`` buffers of shape (max_seq, head_dim)."""

    cos: Tensor
    sin: Tensor

    def __init__(self, head_dim: int, max_seq: int, base: float = 10000.0) -> None:
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        positions = torch.arange(max_seq, dtype=torch.float32)
        freqs = torch.outer(positions, inv_freq)
        angles = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, seq_len: int) -> tuple[Tensor, Tensor]:
        """Return the (seq_len, head_dim) cos and sin tables for positions 0..seq_len-1."""
        return self.cos[:seq_len], self.sin[:seq_len]


def _rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate ``x`` of shape (batch, heads, seq, head_dim) by the tables (seq, head_dim)."""
    return x * cos + _rotate_half(x) * sin


class Attention(nn.Module):
    """Multi-head causal self-attention with RoPE and ``scaled_dot_product_attention``."""

    def __init__(self, config: DecoderConfig) -> None:
        super().__init__()
        self.heads = config.heads
        self.head_dim = config.head_dim
        self.qkv = nn.Linear(config.hidden, 3 * config.hidden, bias=False)
        self.out = nn.Linear(config.hidden, config.hidden, bias=False)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        batch, seq, hidden = x.shape
        qkv = self.qkv(x).view(batch, seq, 3, self.heads, self.head_dim)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
        q = apply_rotary(q, cos, sin)
        k = apply_rotary(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = y.transpose(1, 2).reshape(batch, seq, hidden)
        return self.out(y)


class SwiGLU(nn.Module):
    """Gated MLP: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, hidden: int, inner: int) -> None:
        super().__init__()
        self.gate = nn.Linear(hidden, inner, bias=False)
        self.up = nn.Linear(hidden, inner, bias=False)
        self.down = nn.Linear(inner, hidden, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class DecoderBlock(nn.Module):
    """Pre-norm transformer block: attention then SwiGLU, each with a residual."""

    def __init__(self, config: DecoderConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(config.hidden, config.eps)
        self.attn = Attention(config)
        self.mlp_norm = RMSNorm(config.hidden, config.eps)
        self.mlp = SwiGLU(config.hidden, config.ffn_dim)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


class TinyDecoderLM(nn.Module):
    """A small decoder-only language model without a KV cache.

    ``prefill`` and ``decode`` are pure functions of the parameters and the tokens
    (int64, shape (batch, seq) with seq <= ``config.seq_limit``).
    """

    def __init__(self, config: DecoderConfig) -> None:
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab, config.hidden)
        self.rotary = RotaryEmbedding(config.head_dim, config.seq_limit, config.rope_base)
        self.blocks = nn.ModuleList(DecoderBlock(config) for _ in range(config.layers))
        self.norm = RMSNorm(config.hidden, config.eps)
        self.lm_head = nn.Linear(config.hidden, config.vocab, bias=False)

    def extra_repr(self) -> str:
        c = self.config
        return (
            f"vocab={c.vocab}, hidden={c.hidden}, layers={c.layers}, heads={c.heads}, "
            f"max_seq={c.seq_limit}"
        )

    def hidden_states(self, tokens: Tensor) -> Tensor:
        """Final normed hidden states, shape (batch, seq, hidden)."""
        cos, sin = self.rotary(tokens.shape[1])
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x, cos, sin)
        return self.norm(x)

    def prefill(self, tokens: Tensor) -> Tensor:
        """Logits for every position, shape (batch, seq, vocab)."""
        return self.lm_head(self.hidden_states(tokens))

    def decode(self, tokens: Tensor) -> Tensor:
        """Logits for the last position only, shape (batch, vocab)."""
        return self.lm_head(self.hidden_states(tokens)[:, -1, :])

    def forward(self, tokens: Tensor) -> Tensor:
        return self.prefill(tokens)


def build_decoder(config: DecoderConfig | None = None, seed: int = 0) -> TinyDecoderLM:
    """A :class:`TinyDecoderLM` in eval mode whose weights depend only on ``seed``.

    The global RNG state is saved and restored, so callers' random streams are untouched.
    """
    cfg = config if config is not None else demo_config()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = TinyDecoderLM(cfg)
    return model.eval()


def make_inputs(
    model: TinyDecoderLM | DecoderConfig,
    batch: int | None = None,
    seq: int | None = None,
    seed: int = 0,
) -> Tensor:
    """Deterministic int64 tokens of shape (batch, seq); defaults come from the config."""
    cfg = model.config if isinstance(model, TinyDecoderLM) else model
    b = cfg.batch if batch is None else batch
    s = cfg.seq if seq is None else seq
    if s > cfg.seq_limit:
        raise ValueError(f"seq {s} exceeds the model's max_seq {cfg.seq_limit}")
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, cfg.vocab, (b, s), generator=gen, dtype=torch.int64)


class MLP(nn.Module):
    """A two-layer GELU MLP whose entry point is a named method, ``forward_impl``."""

    def __init__(self, dim: int = 32, hidden: int = 64) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward_impl(self, x: Tensor) -> Tensor:
        return self.fc2(F.gelu(self.fc1(x)))

    def forward(self, x: Tensor) -> Tensor:
        return self.forward_impl(x)


def make_mlp_input(dim: int = 32, batch: int = 4, seed: int = 0) -> Tensor:
    """Deterministic float32 input of shape (batch, dim) for :class:`MLP`."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(batch, dim, generator=gen)


class BufferModule(nn.Module):
    """A module with a registered buffer and a method that takes keyword-only options."""

    offset: Tensor

    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        self.register_buffer("offset", torch.linspace(-1.0, 1.0, dim))
        self.proj = nn.Linear(dim, dim)

    def run(self, x: Tensor, *, scale: float = 1.0, flag: bool = False) -> Tensor:
        y = self.proj(x + self.offset) * scale
        if flag:
            y = torch.relu(y)
        return y


class AddOne(nn.Module):
    """The smallest useful graph, ``x + 1``: for per-call overhead measurements."""

    def add(self, x: Tensor) -> Tensor:
        return x + 1

    def forward(self, x: Tensor) -> Tensor:
        return self.add(x)


def with_config(config: DecoderConfig, **changes: int | float | None) -> DecoderConfig:
    """A copy of ``config`` with some fields changed (validated again)."""
    return replace(config, **changes)  # type: ignore[arg-type]
