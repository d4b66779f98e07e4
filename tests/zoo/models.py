"""Tiny transformers / diffusers models and the serving wrappers their users write.

Configs are built in code with random weights (seeded): nothing is downloaded
(``HF_HUB_OFFLINE=1``). Each builder returns a wrapper ``nn.Module`` whose methods are
what a serving team caches, and a function that makes example inputs:

* :func:`build_llm` (``build_llama``, ``build_qwen2``, ``build_mistral``, ``build_gpt2``)
  -> ``(LlmRunner, make_inputs(batch, seq))``: ``prefill(input_ids, past_key_values)``
  returns the default ``ModelOutput`` with a ``DynamicCache`` (serve it with
  ``dynamic=True``); ``decode(input_ids, cache_position, past_key_values)`` returns the
  logits of a ``StaticCache`` step (``dynamic=False``). ``make_inputs`` gives prefill's
  arguments; :func:`dynamic_generate` / :func:`static_generate` drive whole requests;
* :func:`build_unet` -> ``(UNetRunner, make_inputs(batch))``: one denoising ``step``,
  driven by :func:`run_unet_loop` (a real DDIM loop whose timesteps are 0-d tensors);
* :func:`build_dit` -> ``(DiTRunner, make_inputs(batch))``: a DiT ``step`` with class
  labels.

Every runner has ``cached(compile_fn, **kw)``, which sets ``cached_<method>`` for each
served method with that method's ``dynamic`` (``runner.cached(cache_compile,
cache_dir=d)``); a test may as well assign ``runner.cached_prefill =
cache_compile(runner.prefill, dynamic=True, cache_dir=d)`` itself. The generate/loop
helpers of a runner use ``cached_<method>`` when it is set, else the eager method.

This module does not import cachecompile: tests attach ``cache_compile`` themselves.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

LLM_FAMILIES = ("llama", "qwen2", "mistral", "gpt2")
# Families whose StaticCache slides a window: its layers keep a Python int position
# (``cumulative_length_int``) that Dynamo guards by value, so a static (dynamic=False)
# decode step is a new compile at every position, in torch.compile as in cache_compile.
# Their decode is cached with dynamic=True, the fix the churn warning names (the int is
# then symbolic and one entry serves every position).
SLIDING_WINDOW = ("mistral",)


def decode_dynamic(family: str) -> bool:
    return family in SLIDING_WINDOW
VOCAB = 128
MAX_LEN = 32


class _Served(nn.Module):
    """A wrapper whose ``SERVED`` methods (name -> ``dynamic``) a server compiles."""

    SERVED: dict[str, bool] = {}

    def cached(self, compile_fn: Callable[..., Any], **kwargs: Any) -> _Served:
        """``self.cached_<name> = compile_fn(self.<name>, dynamic=SERVED[name], **kwargs)``."""
        for name, dynamic in self.SERVED.items():
            setattr(self, f"cached_{name}", compile_fn(getattr(self, name), dynamic=dynamic,
                                                       **kwargs))
        return self

    def serving(self, name: str) -> Callable[..., Any]:
        """The cached method when one is attached, else the eager one."""
        fn = getattr(self, f"cached_{name}", None)
        return fn if fn is not None else getattr(self, name)


# ------------------------------------------------------------------------ LLMs

def llm_config(family: str, **overrides: Any) -> Any:
    import transformers

    if family == "gpt2":
        gpt2: dict[str, Any] = dict(vocab_size=VOCAB, n_embd=64, n_inner=128, n_layer=2,
                                    n_head=4, n_positions=64, bos_token_id=0,
                                    eos_token_id=0, attn_implementation="sdpa")
        gpt2.update(overrides)
        return transformers.GPT2Config(**gpt2)
    common: dict[str, Any] = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                                  num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=2, max_position_embeddings=64,
                                  attn_implementation="sdpa")
    common.update(overrides)
    cls = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config,
           "mistral": transformers.MistralConfig}[family]
    return cls(**common)


class LlmRunner(_Served):
    """What a serving loop around an HF causal LM looks like."""

    SERVED = {"prefill": True, "decode": False}

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

    def static_cache(self, max_cache_len: int = MAX_LEN, early: int | None = None) -> Any:
        """A ``StaticCache``: its layers allocate on the first ``update`` (lazily), or now
        for batch size ``early`` (``early_initialization``, float32 on CPU)."""
        from transformers import StaticCache

        cache = StaticCache(config=self.config, max_cache_len=max_cache_len)
        if early is not None:
            cfg = self.config
            heads = cfg.num_attention_heads
            kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
            head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
            cache.early_initialization(early, kv_heads, head_dim, torch.float32,
                                       torch.device("cpu"))
        return cache

    def generate_dynamic(self, batch: int, **kw: Any) -> torch.Tensor:
        return dynamic_generate(self, self.serving("prefill"), batch, **kw)

    def generate_static(self, batch: int, **kw: Any) -> torch.Tensor:
        return static_generate(self, self.serving("decode"), batch, **kw)


def tokens(batch: int, seq: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))


def build_llm_inputs(runner: LlmRunner, batch: int, seq: int,
                     seed: int = 1) -> tuple[torch.Tensor, Any]:
    """``prefill``'s arguments: ``(input_ids[batch, seq], DynamicCache())``."""
    return tokens(batch, seq, seed), runner.dynamic_cache()


def build_llm(family: str, seed: int = 0,
              **config: Any) -> tuple[LlmRunner, Callable[..., tuple[torch.Tensor, Any]]]:
    runner = LlmRunner(family, seed, **config)

    def make_inputs(batch: int, seq: int, seed: int = 1) -> tuple[torch.Tensor, Any]:
        return build_llm_inputs(runner, batch, seq, seed)

    return runner, make_inputs


def build_llama(seed: int = 0, **config: Any) -> tuple[LlmRunner, Callable[..., Any]]:
    return build_llm("llama", seed, **config)


def build_qwen2(seed: int = 0, **config: Any) -> tuple[LlmRunner, Callable[..., Any]]:
    return build_llm("qwen2", seed, **config)


def build_mistral(seed: int = 0, **config: Any) -> tuple[LlmRunner, Callable[..., Any]]:
    return build_llm("mistral", seed, **config)


def build_gpt2(seed: int = 0, **config: Any) -> tuple[LlmRunner, Callable[..., Any]]:
    return build_llm("gpt2", seed, **config)


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
                    steps: int = 3, max_cache_len: int = MAX_LEN,
                    early: bool = False) -> torch.Tensor:
    """Greedy decoding through a StaticCache: the prompt token by token, then new tokens.

    ``decode`` is the (cached or eager) decode method; ``early`` allocates the cache
    before the first step instead of lazily inside it. Returns every step's logits.
    """
    cache = runner.static_cache(max_cache_len, early=batch if early else None)
    ids = tokens(batch, prompt)
    outs: list[torch.Tensor] = []
    nxt = ids[:, :1]
    for pos in range(prompt + steps):
        tok = ids[:, pos:pos + 1] if pos < prompt else nxt
        logits = decode(tok, torch.tensor([pos]), cache)
        outs.append(logits)
        nxt = logits[:, -1:].argmax(-1)
    return torch.cat(outs, dim=1)


# ------------------------------------------------------------------------ diffusers

class UNetRunner(_Served):
    SERVED = {"step": False}

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        from diffusers import UNet2DConditionModel

        torch.manual_seed(seed)
        # One resolution: a cross-attention down block, the cross-attention mid block and
        # a cross-attention up block (with its skip connection), the timestep embedding:
        # a Stable Diffusion UNet's parts, less its down- and upsampling convolutions. With
        # a second, plain resolution it built 44 kernels against 26, and its compile cost
        # ~40% more (issue 36); what the zoo holds it to is the DDIM loop's guards.
        self.unet = UNet2DConditionModel(
            sample_size=8, in_channels=4, out_channels=4, layers_per_block=1,
            block_out_channels=(32,), down_block_types=("CrossAttnDownBlock2D",),
            up_block_types=("CrossAttnUpBlock2D",), cross_attention_dim=32,
            attention_head_dim=8, norm_num_groups=8).eval()

    def step(self, sample: torch.Tensor, t: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        return self.unet(sample, t, encoder_hidden_states=context).sample


def unet_inputs(batch: int, seed: int = 3) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One ``step``'s arguments: latents [b,4,8,8], a 0-d timestep, context [b,6,32]."""
    g = torch.Generator().manual_seed(seed)
    latents = torch.randn(batch, 4, 8, 8, generator=g)
    context = torch.randn(batch, 6, 32, generator=g)
    return latents, torch.tensor(981), context


def build_unet(seed: int = 0) -> tuple[UNetRunner, Callable[..., Any]]:
    return UNetRunner(seed), unet_inputs


def unet_loop(runner: UNetRunner, step: Any, batch: int, steps: int = 10) -> torch.Tensor:
    """A real DDIM loop: ``steps`` timesteps, each a 0-d tensor from the scheduler."""
    from diffusers import DDIMScheduler

    sched = DDIMScheduler(num_train_timesteps=1000)
    sched.set_timesteps(steps)
    latents, _, context = unet_inputs(batch)
    for t in sched.timesteps:
        noise = step(latents, t, context)
        latents = sched.step(noise, t, latents).prev_sample
    return latents


def run_unet_loop(runner: UNetRunner, batch: int, steps: int = 10) -> torch.Tensor:
    """:func:`unet_loop` through ``runner.cached_step`` if set, else the eager step."""
    return unet_loop(runner, runner.serving("step"), batch, steps)


class DiTRunner(_Served):
    SERVED = {"step": False}

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
    """``step``'s arguments: latents [b,4,8,8], timesteps [b] (int64), labels [b] in 0..9."""
    g = torch.Generator().manual_seed(4)
    return (torch.randn(batch, 4, 8, 8, generator=g), torch.tensor([t] * batch),
            torch.randint(0, 10, (batch,), generator=g))


def build_dit(seed: int = 0) -> tuple[DiTRunner, Callable[..., Any]]:
    return DiTRunner(seed), dit_inputs


# ------------------------------------------------------------- graph breaks in their code
# Models whose own code breaks Dynamo's graph (cached with fullgraph=False). Each builder
# returns the module and its calls' arguments, a list of tuples.

def build_qwen2_vl(seed: int = 0) -> tuple[nn.Module, list[dict[str, Any]]]:
    """Qwen2-VL, the whole model: its vision tower splits the patches by
    ``lengths.tolist()`` (a break in its attention), transformers' decorators put its
    forwards in try blocks (Dynamo compiles the frames they call rather than their own),
    and its M-RoPE positions are computed in Python from the image grids."""
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    torch.manual_seed(seed)
    cfg = Qwen2VLConfig(
        text_config=dict(vocab_size=200, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                         max_position_embeddings=256,
                         rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]}),
        vision_config=dict(depth=1, embed_dim=32, hidden_size=32, num_heads=2, mlp_ratio=2,
                           in_channels=3, patch_size=2, spatial_merge_size=2,
                           temporal_patch_size=2),
        image_token_id=150, video_token_id=151, vision_start_token_id=152)
    cfg._attn_implementation = "sdpa"
    model = Qwen2VLForConditionalGeneration(cfg).eval()
    # Varied inputs, as a server sees them (issue 61): three image sizes, a longer prompt,
    # two images in one prompt. Each image's sizes reach Python through .tolist().
    calls = []
    for i, (grids, words) in enumerate((([[1, 4, 4]], 6), ([[1, 4, 8]], 6),
                                        ([[1, 8, 8]], 10), ([[1, 4, 4], [1, 4, 4]], 6))):
        g = torch.tensor(grids)
        gen = torch.Generator().manual_seed(seed + 1 + i)
        ids: list[int] = []
        for n in (int(x.prod()) // 4 for x in g):
            ids += [152] + [150] * n
        ids += torch.randint(1, 140, (words,), generator=gen).tolist()
        input_ids = torch.tensor([ids])
        calls.append(dict(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                          pixel_values=torch.randn(int(g.prod(-1).sum()), 3 * 2 * 2 * 2,
                                                   generator=gen),
                          image_grid_thw=g, mm_token_type_ids=(input_ids == 150).long()))
    return model, calls


def build_longformer(seed: int = 0) -> tuple[nn.Module, list[dict[str, Any]]]:
    """Longformer with global attention on its first token: its sliding-window attention
    breaks in four helpers, its global attention on ``.item()`` and ``nonzero``. Three
    lengths: the second switches ``dynamic=None`` to dynamic in the sequence dim only, as
    torch.compile does (the whole method dynamic made Inductor fail: issue 61)."""
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.LongformerConfig(
        vocab_size=100, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=64, attention_window=[4], max_position_embeddings=64,
        pad_token_id=1)
    model = transformers.LongformerModel(cfg).eval()
    calls = []
    for i, n in enumerate((16, 24, 32)):
        ids = torch.randint(2, 100, (1, n), generator=torch.Generator().manual_seed(seed + i))
        glob = torch.zeros_like(ids)
        glob[:, 0] = 1
        calls.append(dict(input_ids=ids, global_attention_mask=glob))
    return model, calls


# Models transformers runs otherwise under Dynamo than in eager: compared with plain
# torch.compile's outputs, the spec, rather than eager's.
TRACED_DIFFERS = {"paligemma"}


def build_paligemma(seed: int = 0) -> tuple[nn.Module, list[dict[str, Any]]]:
    """PaliGemma: a SigLIP tower's image tokens merged into Gemma's prompt, its mask
    checked with ``.item()`` (breaks). Varied: batches of one and two, a longer prompt."""
    from transformers import PaliGemmaConfig, PaliGemmaForConditionalGeneration

    torch.manual_seed(seed)
    cfg = PaliGemmaConfig(
        text_config=dict(model_type="gemma", vocab_size=300, hidden_size=32,
                         intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=1, head_dim=16),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                           num_attention_heads=2, image_size=16, patch_size=4,
                           projection_dim=32),
        image_token_index=257, projection_dim=32)
    model = PaliGemmaForConditionalGeneration(cfg).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    calls = []
    for b, words in ((1, 4), (2, 4), (1, 8)):
        ids = torch.cat([torch.full((b, 16), 257), torch.full((b, 1), 2),
                         torch.randint(3, 250, (b, words), generator=gen)], dim=1)
        # No token_type_ids: then it breaks (with them it is one graph), and transformers
        # builds another mask under Dynamo than in eager: the spec is torch.compile's.
        calls.append(dict(input_ids=ids, attention_mask=torch.ones_like(ids),
                          pixel_values=torch.randn(b, 3, 16, 16, generator=gen)))
    return model, calls


def build_switch(seed: int = 0) -> tuple[nn.Module, list[dict[str, Any]]]:
    """SwitchTransformers: a mixture of experts whose router picks each token's expert
    in Python (``nonzero`` over the router's mask: a break per layer)."""
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.SwitchTransformersConfig(
        vocab_size=100, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2,
        num_heads=2, num_experts=4, expert_capacity=8, num_sparse_encoder_layers=2,
        num_sparse_decoder_layers=2)
    model = transformers.SwitchTransformersModel(cfg).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    return model, [dict(input_ids=torch.randint(2, 100, (b, n), generator=gen),
                        decoder_input_ids=torch.randint(2, 100, (b, t), generator=gen))
                   for b, n, t in ((1, 8, 4), (2, 8, 4), (1, 12, 6))]


def build_reformer(seed: int = 0) -> tuple[nn.Module, list[tuple[Any, ...]]]:
    """Reformer: it sizes its chunks with numpy (``np.lcm``: a tensor guard on a numpy
    value at the break that follows), returns namedtuples its resume frames rebuild
    through ``_make``, and breaks in its LSH attention. ``hash_seed``: its random
    rotations the same in the eager and the cached call."""
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.ReformerConfig(
        vocab_size=100, hidden_size=32, num_attention_heads=2, attention_head_size=16,
        feed_forward_size=64, attn_layers=["local", "lsh"], axial_pos_embds=False,
        max_position_embeddings=64, lsh_attn_chunk_length=8, local_attn_chunk_length=8,
        num_buckets=4, num_hashes=1, is_decoder=False, hash_seed=seed)
    model = transformers.ReformerModel(cfg).eval()
    # Varied: two batch sizes, a longer sequence.
    return model, [(torch.randint(2, 100, (b, n), generator=torch.Generator().manual_seed(i)),)
                   for i, (b, n) in enumerate(((1, 16), (2, 16), (1, 24)))]


class DenoiseStep(nn.Module):
    """A diffusion pipeline's step as its users write one: the DiT, then the DDIM
    scheduler's update, whose step reads the timestep as a Python number (a break)."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        from diffusers import DDIMScheduler

        self.runner, _ = build_dit(seed)
        sched: Any = DDIMScheduler(num_train_timesteps=100)  # diffusers' stubs lack its API
        sched.set_timesteps(3)
        self.scheduler = sched

    def step(self, latents: torch.Tensor, t: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        noise = self.runner.dit(latents, timestep=t, class_labels=labels).sample
        return self.scheduler.step(noise, t, latents).prev_sample


def denoise(step: Callable[..., torch.Tensor], module: DenoiseStep) -> torch.Tensor:
    """The scheduler's loop over its timesteps with ``step`` (cached or eager)."""
    latents, _, labels = dit_inputs(1)
    for t in module.scheduler.timesteps:
        latents = step(latents, t.reshape(1), labels)
    return latents


BUILDERS: dict[str, Callable[..., tuple[Any, Callable[..., Any]]]] = {
    "llama": build_llama, "qwen2": build_qwen2, "mistral": build_mistral, "gpt2": build_gpt2,
    "unet": build_unet, "dit": build_dit,
}
