"""Eager sanity checks of the bundled models, and one real torch.compile check."""

from __future__ import annotations

import pytest
import torch

from cachecompile.demo.models import (
    MLP,
    AddOne,
    BufferModule,
    DecoderConfig,
    TinyDecoderLM,
    anchor_config,
    build_decoder,
    demo_config,
    make_inputs,
    make_mlp_input,
)


def _tiny() -> DecoderConfig:
    return DecoderConfig(vocab=64, hidden=32, layers=2, heads=2, seq=16, batch=2)


def test_configs() -> None:
    demo = demo_config()
    assert (demo.hidden, demo.layers, demo.vocab) == (128, 2, 512)
    anchor = anchor_config()
    assert (anchor.hidden, anchor.layers, anchor.seq, anchor.batch) == (256, 4, 128, 2)
    assert anchor.head_dim * anchor.heads == anchor.hidden
    with pytest.raises(ValueError):
        DecoderConfig(hidden=30, heads=4)
    with pytest.raises(ValueError):
        DecoderConfig(seq=32, max_seq=16)


def test_shapes() -> None:
    cfg = _tiny()
    model = build_decoder(cfg)
    tokens = make_inputs(model)
    assert tokens.shape == (cfg.batch, cfg.seq) and tokens.dtype == torch.int64
    with torch.no_grad():
        assert model.prefill(tokens).shape == (cfg.batch, cfg.seq, cfg.vocab)
        assert model.decode(tokens).shape == (cfg.batch, cfg.vocab)
        assert model(tokens).shape == (cfg.batch, cfg.seq, cfg.vocab)
        # Shorter sequences and other batch sizes use a prefix of the rotary tables.
        short = make_inputs(model, batch=3, seq=5, seed=1)
        assert model.prefill(short).shape == (3, 5, cfg.vocab)
    with pytest.raises(ValueError):
        make_inputs(model, seq=cfg.seq + 1)


def test_determinism() -> None:
    cfg = _tiny()
    torch.manual_seed(123)
    a = TinyDecoderLM(cfg).eval()
    torch.manual_seed(123)
    b = TinyDecoderLM(cfg).eval()
    tokens = make_inputs(cfg, seed=7)
    assert torch.equal(tokens, make_inputs(cfg, seed=7))
    assert not torch.equal(tokens, make_inputs(cfg, seed=8))
    with torch.no_grad():
        assert torch.equal(a.prefill(tokens), b.prefill(tokens))
    # build_decoder depends only on its seed and leaves the global RNG alone.
    torch.manual_seed(5)
    before = torch.rand(1)
    torch.manual_seed(5)
    c = build_decoder(cfg, seed=3)
    after = torch.rand(1)
    assert torch.equal(before, after)
    d = build_decoder(cfg, seed=3)
    for (name, p), (_, q) in zip(c.named_parameters(), d.named_parameters(), strict=True):
        assert torch.equal(p, q), name


def test_causal_and_decode_matches_prefill() -> None:
    model = build_decoder(_tiny())
    tokens = make_inputs(model)
    changed = tokens.clone()
    changed[:, -1] = (changed[:, -1] + 1) % model.config.vocab
    with torch.no_grad():
        full = model.prefill(tokens)
        full_changed = model.prefill(changed)
        last = model.decode(tokens)
    torch.testing.assert_close(full[:, :-1], full_changed[:, :-1])
    assert not torch.allclose(full[:, -1], full_changed[:, -1])
    torch.testing.assert_close(last, full[:, -1])


def test_forward_methods_do_not_mutate_state() -> None:
    model = build_decoder(_tiny())
    before = {k: v.clone() for k, v in model.state_dict(keep_vars=False).items()}
    buffers = {k: v.clone() for k, v in model.named_buffers()}
    attrs = dict(vars(model))
    with torch.no_grad():
        model.prefill(make_inputs(model))
        model.decode(make_inputs(model))
    for k, v in model.state_dict().items():
        assert torch.equal(before[k], v), k
    for k, v in model.named_buffers():
        assert torch.equal(buffers[k], v), k
    assert dict(vars(model)).keys() == attrs.keys()


def test_small_modules() -> None:
    torch.manual_seed(0)
    mlp = MLP()
    x = make_mlp_input()
    assert mlp.forward_impl(x).shape == x.shape
    torch.testing.assert_close(mlp(x), mlp.forward_impl(x))
    buf = BufferModule(dim=8)
    assert "offset" in dict(buf.named_buffers())
    x8 = torch.randn(3, 8)
    plain = buf.run(x8)
    torch.testing.assert_close(buf.run(x8, scale=2.0), plain * 2.0)
    assert (buf.run(x8, flag=True) >= 0).all()
    assert torch.equal(AddOne().add(torch.zeros(4)), torch.ones(4))


@pytest.mark.slow
def test_compile_matches_eager_demo() -> None:
    torch._dynamo.reset()
    model = build_decoder(demo_config())
    tokens = make_inputs(model)
    with torch.no_grad():
        expected = model.prefill(tokens)
        compiled = torch.compile(model.prefill, fullgraph=True, dynamic=False)
        actual = compiled(tokens)
    torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-4)
