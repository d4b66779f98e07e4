"""Tiny transformers / diffusers models and the serving wrappers their users write.

Configs are built in code with random weights (seeded): nothing is downloaded. Each
builder returns a wrapper ``nn.Module`` whose methods are what a serving team caches:

* :class:`LlmRunner`: ``prefill`` (a ``DynamicCache``, the default ``ModelOutput``
  returned as is) and ``decode`` (a ``StaticCache`` with ``cache_position``);
* :class:`UNetRunner`: one denoising step, called in a real DDIM scheduler loop whose
  timesteps are 0-d tensors;
* :class:`DiTRunner`: a DiT transformer step with class labels.

This module does not import cachecompile: tests attach ``cache_compile`` themselves.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

LLM_FAMILIES = ("llama", "qwen2", "mistral")
VOCAB = 128
MAX_LEN = 32


def llm_config(family: str, **overrides: Any) -> Any:
    import transformers

    common: dict[str, Any] = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                                  num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=2, max_position_embeddings=64,
                                  attn_implementation="sdpa")
    common.update(overrides)
    cls = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config,
           "mistral": transformers.MistralConfig}[family]
    return cls(**common)


class LlmRunner(nn.Module):
    """What a serving loop around an HF causal LM looks like."""

    def __init__(self, family: str, seed: int = 0, **config: Any) -> None:
        super().__init__()
        import transformers

        torch.manual_seed(seed)
        self.config = llm_config(family, **config)
        self.model = transformers.AutoModelForCausalLM.from_config(self.config).eval()

    def prefill(self, input_ids: torch.Tensor, past_key_values: Any) -> Any:
        # The default ModelOutput (logits + the cache object), returned as is.
        return self.model(input_ids=input_ids, past_key_values=past_key_values, use_cache=True)

    def decode(self, input_ids: torch.Tensor, cache_position: torch.Tensor,
               past_key_values: Any) -> torch.Tensor:
        out = self.model(input_ids=input_ids, cache_position=cache_position,
                         past_key_values=past_key_values, use_cache=True)
        return out.logits

    def dynamic_cache(self) -> Any:
        from transformers import DynamicCache

        return DynamicCache(config=self.config)

    def static_cache(self, max_cache_len: int = MAX_LEN) -> Any:
        from transformers import StaticCache

        return StaticCache(config=self.config, max_cache_len=max_cache_len)


def tokens(batch: int, seq: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))


def dynamic_generate(runner: LlmRunner, prefill: Any, batch: int, prompt: int = 5,
                     steps: int = 3) -> torch.Tensor:
    """Prefill a prompt into a DynamicCache, then decode ``steps`` tokens through the same
    (cached or eager) ``prefill`` method; returns every call's logits."""
    cache = runner.dynamic_cache()
    out = prefill(tokens(batch, prompt), cache)
    logits = [out.logits]
    for _ in range(steps):
        out = prefill(out.logits[:, -1:].argmax(-1), cache)
        logits.append(out.logits)
    return torch.cat(logits, dim=1)


def static_generate(runner: LlmRunner, decode: Any, batch: int, prompt: int = 4,
                    steps: int = 3, max_cache_len: int = MAX_LEN) -> torch.Tensor:
    """Greedy decoding through a StaticCache: the prompt token by token, then new tokens.

    ``decode`` is the (cached or eager) decode method. Returns every step's logits.
    """
    cache = runner.static_cache(max_cache_len)
    ids = tokens(batch, prompt)
    outs: list[torch.Tensor] = []
    nxt = ids[:, :1]
    for pos in range(prompt + steps):
        tok = ids[:, pos:pos + 1] if pos < prompt else nxt
        logits = decode(tok, torch.tensor([pos]), cache)
        outs.append(logits)
        nxt = logits[:, -1:].argmax(-1)
    return torch.cat(outs, dim=1)


class UNetRunner(nn.Module):
    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        from diffusers import UNet2DConditionModel

        torch.manual_seed(seed)
        self.unet = UNet2DConditionModel(
            sample_size=8, in_channels=4, out_channels=4, layers_per_block=1,
            block_out_channels=(32, 64), down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
            up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), cross_attention_dim=32,
            attention_head_dim=8, norm_num_groups=8).eval()

    def step(self, sample: torch.Tensor, t: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        return self.unet(sample, t, encoder_hidden_states=context).sample


def unet_loop(runner: UNetRunner, step: Any, batch: int, steps: int = 10) -> torch.Tensor:
    """A real DDIM loop: ``steps`` timesteps, each a 0-d tensor from the scheduler."""
    from diffusers import DDIMScheduler

    sched = DDIMScheduler(num_train_timesteps=1000)
    sched.set_timesteps(steps)
    g = torch.Generator().manual_seed(3)
    latents = torch.randn(batch, 4, 8, 8, generator=g)
    context = torch.randn(batch, 6, 32, generator=g)
    for t in sched.timesteps:
        noise = step(latents, t, context)
        latents = sched.step(noise, t, latents).prev_sample
    return latents


class DiTRunner(nn.Module):
    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        from diffusers import DiTTransformer2DModel

        torch.manual_seed(seed)
        self.dit = DiTTransformer2DModel(
            num_attention_heads=2, attention_head_dim=16, in_channels=4, out_channels=4,
            num_layers=2, sample_size=8, patch_size=2, num_embeds_ada_norm=10,
            norm_num_groups=8).eval()

    def step(self, sample: torch.Tensor, t: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.dit(sample, timestep=t, class_labels=labels).sample


def dit_inputs(batch: int, t: int = 500) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(4)
    return (torch.randn(batch, 4, 8, 8, generator=g), torch.tensor([t] * batch),
            torch.randint(0, 10, (batch,), generator=g))
