"""The Gated DeltaNet and gated-attention layers of Qwen3.5-MoE against transformers' own modules
(random fp32 weights): single calls of 1 to 300 tokens, prefill in pieces then step-by-step
decode against one full forward, Hk != Hv and Hk == Hv, GGUF's tiled value-head order, and the
family's norms."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
import torch

from expertcache.config import RopeConfig
from expertcache.errors import ExpertCacheError
from expertcache.kernels import TorchKernels
from expertcache.models.deltanet import (DeltaNetConfig, DeltaNetPaths, DeltaNetState, DeltaNetWeights,
                                         deltanet, gated_rms_norm)
from expertcache.models.gated_attention import (GatedAttentionConfig, GatedAttentionWeights, gated_attention,
                                                rms_norm_fp32, unit_offset)
from expertcache.models.layers import KVCache, Rotary
import transformers as tf
from conftest import CountingModule
from transformers.cache_utils import DynamicCache
from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as ref

D = 64
KERN = TorchKernels()
TOL = 1e-5
# Layer 3 is full attention, the others DeltaNet (full_attention_interval 4).
LINEAR, FULL = 0, 3


def hf_config(k_heads: int = 2, v_heads: int = 4, kv_heads: int = 2, bias: bool = False):
    c = tf.Qwen3_5MoeTextConfig(
        vocab_size=64, hidden_size=D, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=kv_heads,
        head_dim=32, linear_num_key_heads=k_heads, linear_num_value_heads=v_heads, linear_key_head_dim=16,
        linear_value_head_dim=8, linear_conv_kernel_dim=4, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=16, shared_expert_intermediate_size=16, rms_norm_eps=1e-6,
        max_position_embeddings=1024, attention_bias=bias,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25})
    c._attn_implementation = "eager"
    return c


def widen(module: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Random weights large enough that every term matters (init leaves most of them tiny)."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith("conv1d.weight") or name.endswith("dt_bias"):
                p.normal_(0.0, 0.5)
            elif name.endswith("A_log"):
                # decays per step from about 0.99 to about 1e-4: long and short memories
                p.copy_(torch.linspace(-4.0, 2.5, p.numel()))
            elif p.ndim >= 2:
                p.normal_(0.0, 0.12)
            else:
                p.normal_(0.0, 0.05)
        for m in module.modules():
            if isinstance(m, ref.Qwen3_5MoeRMSNorm):  # scales by 1 + w
                m.weight.normal_(0.0, 0.1)
            elif isinstance(m, ref.Qwen3_5MoeRMSNormGated):  # scales by w
                m.weight.normal_(1.0, 0.1)
    return module.eval()


def make_deltanet(seed: int = 0, **cfg):
    c = hf_config(**cfg)
    mod = widen(ref.Qwen3_5MoeGatedDeltaNet(c, LINEAR), seed)
    mod._test_config = c
    return mod


def ours_deltanet(mod) -> tuple[DeltaNetConfig, DeltaNetWeights]:
    cfg = DeltaNetConfig.from_hf(mod._test_config.to_dict())
    return cfg, DeltaNetWeights.from_hf({n: p.detach() for n, p in mod.named_parameters()})


def ref_deltanet(mod, pieces: list[torch.Tensor]) -> tuple[torch.Tensor, DynamicCache]:
    """transformers' layer over consecutive pieces with its cache, as generate() drives it."""
    cache = DynamicCache(config=mod._test_config)
    with torch.no_grad():
        out = [mod(p[None], cache=cache)[0] for p in pieces]
    return torch.cat(out), cache


def run_ours(cfg, w, pieces, state=None, paths=None):
    state = state if state is not None else DeltaNetState.zeros(cfg, "cpu", torch.float32)
    with torch.no_grad():
        return torch.cat([deltanet(KERN, cfg, w, p, state, paths) for p in pieces]), state


def close(a: torch.Tensor, b: torch.Tensor, tol: float = TOL) -> None:
    err = (a - b).abs().max().item()
    assert err <= tol, f"max |difference| {err:.3g} > {tol} (max |reference| {b.abs().max().item():.3g})"


HEADS = [pytest.param((2, 4), id="hk2-hv4"), pytest.param((4, 4), id="hk4-hv4")]


@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("T", [1, 7, 64, 300])
def test_deltanet_matches_transformers(heads, T):
    mod = make_deltanet(k_heads=heads[0], v_heads=heads[1])
    cfg, w = ours_deltanet(mod)
    x = torch.randn(T, D, generator=torch.Generator().manual_seed(T))
    expected, _ = ref_deltanet(mod, [x])
    paths = DeltaNetPaths()
    got, state = run_ours(cfg, w, [x], paths=paths)
    assert expected.abs().max() > 0.1  # the comparison is not between near-zeros
    close(got, expected)
    assert (paths.recurrent, paths.chunked) == ((1, 0) if T == 1 else (0, 1))
    assert state.tokens == T


@pytest.mark.parametrize("heads", HEADS)
def test_deltanet_prefill_in_pieces_then_decode_equals_one_forward(heads):
    mod = make_deltanet(k_heads=heads[0], v_heads=heads[1], seed=1)
    cfg, w = ours_deltanet(mod)
    x = torch.randn(310, D, generator=torch.Generator().manual_seed(5))
    expected, _ = ref_deltanet(mod, [x])
    pieces = [x[:100], x[100:200], x[200:300]] + [x[i:i + 1] for i in range(300, 310)]
    paths = DeltaNetPaths()
    got, state = run_ours(cfg, w, pieces, paths=paths)
    close(got, expected)
    # every decode step ran the recurrent form and never the chunked one
    assert (paths.chunked, paths.recurrent) == (3, 10)
    # the states equal transformers' after the same calls
    _, cache = ref_deltanet(mod, pieces)
    close(state.recurrent, cache.get_recurrent_state(LINEAR)[0])
    K = cfg.conv_kernel
    close(state.conv, cache.get_conv_state(LINEAR)[0][:, -(K - 1):])
    assert state.recurrent.dtype == torch.float32 and state.conv.shape == (cfg.conv_dim, K - 1)


def test_deltanet_short_pieces_and_decode_from_a_fresh_state():
    # pieces shorter than the conv kernel, and decode from the very first token
    mod = make_deltanet(seed=2)
    cfg, w = ours_deltanet(mod)
    x = torch.randn(12, D, generator=torch.Generator().manual_seed(6))
    expected, _ = ref_deltanet(mod, [x])
    got, _ = run_ours(cfg, w, [x[0:1], x[1:3], x[3:4], x[4:6], x[6:12]])
    close(got, expected)


def test_deltanet_state_copy_restores_a_prefix():
    mod = make_deltanet(seed=3)
    cfg, w = ours_deltanet(mod)
    x = torch.randn(140, D, generator=torch.Generator().manual_seed(7))
    state = DeltaNetState.zeros(cfg, "cpu", torch.float32)
    run_ours(cfg, w, [x[:70]], state)
    snapshot = state.copy()
    first, _ = run_ours(cfg, w, [x[70:], x[:3]], state)
    assert snapshot.tokens == 70 and state.tokens == 143
    again, _ = run_ours(cfg, w, [x[70:], x[:3]], snapshot.copy())
    assert torch.equal(first, again)
    assert snapshot.nbytes == 4 * (cfg.v_heads * cfg.k_head_dim * cfg.v_head_dim + cfg.conv_dim * 3)


def tile_v_heads(t: torch.Tensor, dim: int, k_heads: int, per_k: int, size: int) -> torch.Tensor:
    """llama.cpp's converter order: value heads grouped by key head [k0v0, k0v1, k1v0, ...] become
    tiled [k0v0, k1v0, k0v1, ...] along `dim`, in blocks of `size`."""
    shape = list(t.shape)
    t = t.reshape(*shape[:dim], k_heads, per_k, size, *shape[dim + 1:])
    return t.transpose(dim, dim + 1).reshape(shape)


def test_deltanet_runs_in_ggufs_tiled_value_head_order():
    mod = make_deltanet(k_heads=2, v_heads=6, seed=4)
    cfg, w = ours_deltanet(mod)
    x = torch.randn(80, D, generator=torch.Generator().manual_seed(8))
    expected, _ = ref_deltanet(mod, [x])
    Hk, R, dv = cfg.k_heads, cfg.v_heads // cfg.k_heads, cfg.v_head_dim
    qk = 2 * cfg.key_dim
    tiled = DeltaNetWeights(
        torch.cat((w.in_proj_qkv[:qk], tile_v_heads(w.in_proj_qkv[qk:], 0, Hk, R, dv))),
        tile_v_heads(w.in_proj_z, 0, Hk, R, dv), tile_v_heads(w.in_proj_b, 0, Hk, R, 1),
        tile_v_heads(w.in_proj_a, 0, Hk, R, 1), torch.cat((w.conv[:qk], tile_v_heads(w.conv[qk:], 0, Hk, R, dv))),
        tile_v_heads(w.dt_bias, 0, Hk, R, 1), tile_v_heads(w.A, 0, Hk, R, 1), w.norm,
        tile_v_heads(w.out_proj, 1, Hk, R, dv))
    tcfg = DeltaNetConfig.from_hf(mod._test_config.to_dict(), tiled_v_heads=True)
    got, _ = run_ours(tcfg, tiled, [x[:79], x[79:]])
    close(got, expected)
    wrong, _ = run_ours(cfg, tiled, [x])  # the same weights read in grouped order are another layer
    assert (wrong - expected).abs().max() > 1e-2


def test_deltanet_bf16_tracks_transformers():
    mod = make_deltanet(seed=5).to(torch.bfloat16)
    cfg, w = ours_deltanet(mod)
    x = torch.randn(72, D, generator=torch.Generator().manual_seed(9)).bfloat16()
    expected, _ = ref_deltanet(mod, [x[:70], x[70:71], x[71:]])
    state = DeltaNetState.zeros(cfg, "cpu", torch.bfloat16)
    got, state = run_ours(cfg, w, [x[:70], x[70:71], x[71:]], state)
    assert got.dtype == torch.bfloat16 and state.recurrent.dtype == torch.float32
    # (bitwise equal on this machine; bf16 rounding itself moves outputs by about 3% of their range)
    close(got.float(), expected.float(), 0.01 * expected.float().abs().max().item())


def make_attention(seed: int = 0, **cfg):
    c = hf_config(**cfg)
    mod = widen(ref.Qwen3_5MoeAttention(c, FULL), seed)
    return c, mod


def ref_attention(c, mod, pieces):
    cache = DynamicCache(config=c)
    rotary = ref.Qwen3_5MoeTextRotaryEmbedding(c)
    out, P = [], 0
    with torch.no_grad():
        for p in pieces:
            T = p.shape[0]
            cos, sin = rotary(p[None], torch.arange(P, P + T)[None])
            mask = torch.full((T, P + T), float("-inf")).triu(P + 1)[None, None]
            out.append(mod(p[None], (cos, sin), mask, cache=cache)[0][0])
            P += T
    return torch.cat(out)


def ours_attention(c, mod, pieces, kern=KERN, dtype=torch.float32):
    cfg = GatedAttentionConfig.from_hf(c.to_dict())
    p = {n: t.detach() for n, t in mod.named_parameters()}
    bias = p.get("q_proj.bias")
    w = GatedAttentionWeights(
        torch.cat((p["q_proj.weight"], p["k_proj.weight"], p["v_proj.weight"])), p["o_proj.weight"],
        unit_offset(p["q_norm.weight"]), unit_offset(p["k_norm.weight"]),
        None if bias is None else torch.cat((bias, p["k_proj.bias"], p["v_proj.bias"])), p.get("o_proj.bias"))
    kv = KVCache(SimpleNamespace(num_kv_heads=cfg.kv_heads, head_dim=cfg.head_dim, num_layers=4), 1024, "cpu",
                 dtype)
    rotary = Rotary(SimpleNamespace(rope=RopeConfig.from_hf(c.to_dict(), 1024), head_dim=cfg.rotary_dim), "cpu",
                    dtype)
    out = []
    with torch.no_grad():
        for x in pieces:
            cos, sin = rotary(kv.length, x.shape[0])
            out.append(gated_attention(kern, cfg, w, x, FULL, kv, cos, sin))
            kv.advance(x.shape[0])
    return torch.cat(out)


ATTN = [pytest.param(dict(kv_heads=2), id="gqa"), pytest.param(dict(kv_heads=4, bias=True), id="mha-bias")]


@pytest.mark.parametrize("opts", ATTN)
@pytest.mark.parametrize("T", [1, 7, 64, 300])
def test_gated_attention_matches_transformers(opts, T):
    c, mod = make_attention(**opts)
    assert GatedAttentionConfig.from_hf(c.to_dict()).rotary_dim == 8
    x = torch.randn(T, D, generator=torch.Generator().manual_seed(T))
    expected = ref_attention(c, mod, [x])
    assert expected.abs().max() > 0.1
    close(ours_attention(c, mod, [x]), expected)


@pytest.mark.parametrize("opts", ATTN)
def test_gated_attention_pieces_then_decode_equals_one_forward(opts):
    c, mod = make_attention(seed=1, **opts)
    x = torch.randn(310, D, generator=torch.Generator().manual_seed(3))
    expected = ref_attention(c, mod, [x])
    pieces = [x[:100], x[100:200], x[200:300]] + [x[i:i + 1] for i in range(300, 310)]
    close(ours_attention(c, mod, pieces), expected)


@pytest.mark.parametrize("opts", ATTN)
def test_native_gated_attention_step_matches_the_torch_step(opts):
    """A bf16 decode step in one native call (norms, partial rotary, cache append, attention and the
    gate) against the torch path it replaces, over 10 steps after a 70-token prefill (which both
    run in torch): within one bf16 step of the outputs' range."""
    from expertcache import kernels

    c, mod = make_attention(seed=2, **opts)
    mod = mod.to(torch.bfloat16)
    x = torch.randn(80, D, generator=torch.Generator().manual_seed(4)).bfloat16()
    pieces = [x[:70]] + [x[i:i + 1] for i in range(70, 80)]
    counting = CountingModule(kernels.load_native(), "attend_gated")
    want = ours_attention(c, mod, pieces, KERN, torch.bfloat16)
    got = ours_attention(c, mod, pieces, _StepOnly(counting), torch.bfloat16)
    assert counting.calls["attend_gated"] == 10
    assert torch.equal(got[:70], want[:70])
    torch.testing.assert_close(got[70:].float(), want[70:].float(), rtol=2 ** -7,
                               atol=2 ** -8 * want[70:].float().abs().max().item())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norms_of_the_whole_text_model(dtype):
    # Every norm of the text model is 1 + w in fp32, but the DeltaNet's gated norm, whose plain w
    # scales in the compute dtype. Bitwise, in fp32 and in bf16.
    model = widen(ref.Qwen3_5MoeTextModel(hf_config()), 0).to(dtype)
    found = set()
    for name, m in model.named_modules():
        if not isinstance(m, (ref.Qwen3_5MoeRMSNorm, ref.Qwen3_5MoeRMSNormGated)):
            continue
        h = torch.randn(5, m.weight.shape[0], generator=torch.Generator().manual_seed(len(found))).to(dtype)
        with torch.no_grad():
            if isinstance(m, ref.Qwen3_5MoeRMSNormGated):
                z = torch.randn_like(h)
                assert torch.equal(gated_rms_norm(h, z, m.weight, m.variance_epsilon), m(h, z)), name
            else:
                assert torch.equal(rms_norm_fp32(h, unit_offset(m.weight), m.eps), m(h)), name
        found.add((re.sub(r"\.\d+\.", ".*.", name), type(m).__name__))
    assert found == {("layers.*.input_layernorm", "Qwen3_5MoeRMSNorm"),
                     ("layers.*.post_attention_layernorm", "Qwen3_5MoeRMSNorm"),
                     ("layers.*.self_attn.q_norm", "Qwen3_5MoeRMSNorm"),
                     ("layers.*.self_attn.k_norm", "Qwen3_5MoeRMSNorm"),
                     ("norm", "Qwen3_5MoeRMSNorm"),
                     ("layers.*.linear_attn.norm", "Qwen3_5MoeRMSNormGated")}


def test_configs_from_hf_and_their_errors():
    d = hf_config(k_heads=2, v_heads=6).to_dict()
    cfg = DeltaNetConfig.from_hf(d)
    assert (cfg.k_heads, cfg.v_heads, cfg.k_head_dim, cfg.v_head_dim, cfg.conv_kernel) == (2, 6, 16, 8, 4)
    assert cfg.conv_dim == 2 * 2 * 16 + 6 * 8
    a = GatedAttentionConfig.from_hf(d)
    assert (a.heads, a.kv_heads, a.head_dim, a.rotary_dim) == (4, 2, 32, 8)
    legacy = {k: v for k, v in d.items() if k != "rope_parameters"} | {"partial_rotary_factor": 0.5}
    assert GatedAttentionConfig.from_hf(legacy).rotary_dim == 16
    with pytest.raises(ExpertCacheError, match="value heads \\(6\\) are not a multiple of its key heads \\(4\\)"):
        DeltaNetConfig(4, 6, 16, 8)
    with pytest.raises(ExpertCacheError, match="config has no linear_num_value_heads"):
        DeltaNetConfig.from_hf({k: v for k, v in d.items() if k != "linear_num_value_heads"})
    with pytest.raises(ExpertCacheError, match="rotary dims are 7"):
        GatedAttentionConfig(4, 2, 32, 7)


def test_whole_text_model_from_these_layers():
    # The decoder loop the lead wires, with transformers' own MoE blocks in place of ours: norms,
    # residuals, positions, DeltaNet states and the KV cache over prefill pieces then decode steps,
    # against transformers' text model in one forward.
    c = hf_config(k_heads=2, v_heads=4)
    model = widen(ref.Qwen3_5MoeTextModel(c), 6)
    ids = torch.randint(0, c.vocab_size, (150,), generator=torch.Generator().manual_seed(10))
    with torch.no_grad():
        expected = model(input_ids=ids[None], use_cache=False).last_hidden_state[0]  # [150, D]
    dcfg = DeltaNetConfig.from_hf(c.to_dict())
    acfg = GatedAttentionConfig.from_hf(c.to_dict())
    kv = KVCache(SimpleNamespace(num_kv_heads=acfg.kv_heads, head_dim=acfg.head_dim, num_layers=4), 1024, "cpu",
                 torch.float32)
    rotary = Rotary(SimpleNamespace(rope=RopeConfig.from_hf(c.to_dict(), 1024), head_dim=acfg.rotary_dim), "cpu",
                    torch.float32)
    layers = []
    for i, layer in enumerate(model.layers):
        p = {n: t.detach() for n, t in layer.named_parameters()}
        if c.layer_types[i] == "linear_attention":
            w = DeltaNetWeights.from_hf({n.removeprefix("linear_attn."): t for n, t in p.items()
                                         if n.startswith("linear_attn.")})
            layers.append((w, DeltaNetState.zeros(dcfg, "cpu", torch.float32)))
        else:
            w = GatedAttentionWeights(torch.cat([p[f"self_attn.{n}_proj.weight"] for n in "qkv"]),
                                      p["self_attn.o_proj.weight"], unit_offset(p["self_attn.q_norm.weight"]),
                                      unit_offset(p["self_attn.k_norm.weight"]))
            layers.append((w, None))
    paths = DeltaNetPaths()
    out = []
    with torch.no_grad():
        for piece in (ids[:70], ids[70:140], *ids[140:].split(1)):
            T = piece.shape[0]
            x = model.embed_tokens.weight[piece]                                     # [T, D]
            cos, sin = rotary(kv.length, T)
            for i, (layer, (w, state)) in enumerate(zip(model.layers, layers)):
                h = rms_norm_fp32(x, unit_offset(layer.input_layernorm.weight), c.rms_norm_eps)
                if state is not None:
                    x = x + deltanet(KERN, dcfg, w, h, state, paths)
                else:
                    x = x + gated_attention(KERN, acfg, w, h, i, kv, cos, sin)
                h = rms_norm_fp32(x, unit_offset(layer.post_attention_layernorm.weight), c.rms_norm_eps)
                x = x + layer.mlp(h[None])[0]
            kv.advance(T)
            out.append(rms_norm_fp32(x, unit_offset(model.norm.weight), c.rms_norm_eps))
    got = torch.cat(out)
    close(got, expected, 1e-4)
    assert (paths.chunked, paths.recurrent) == (2 * 3, 10 * 3)


class _StepOnly(TorchKernels):
    """torch's products with the native DeltaNet decode step: the step alone differs."""

    def __init__(self, native):
        self.native = native


@pytest.mark.parametrize("k_heads,v_heads,tiled", [(2, 4, False), (2, 4, True), (4, 4, False)],
                         ids=["hk2-hv4", "hk2-hv4-tiled", "hk4-hv4"])
@pytest.mark.parametrize("small_weights", ["float32", "bfloat16"])
def test_native_decode_step_matches_the_torch_step(k_heads, v_heads, tiled, small_weights):
    """The native step (conv, q/k norms, state update, gated norm in one call) against the torch
    path it replaces, over 12 decode steps after a 70-token prefill: states within fp32 rounding
    of another summation order, outputs within one bf16 step; the conv state exactly. The conv,
    dt bias and norm weights come as the GGUF loader gives them (fp32) or as a bf16 checkpoint
    does."""
    from expertcache import kernels

    mod = make_deltanet(k_heads=k_heads, v_heads=v_heads, seed=6).to(torch.bfloat16)
    cfg, w = ours_deltanet(mod)
    if tiled:
        cfg = DeltaNetConfig.from_hf(mod._test_config.to_dict(), tiled_v_heads=True)
    dt = getattr(torch, small_weights)
    w = DeltaNetWeights(w.in_proj_qkv, w.in_proj_z, w.in_proj_b, w.in_proj_a, w.conv.to(dt).contiguous(),
                        w.dt_bias.to(dt), w.A, w.norm.to(dt), w.out_proj)
    x = torch.randn(82, D, generator=torch.Generator().manual_seed(11)).bfloat16()
    native = _StepOnly(kernels.load_native())
    states = {}
    outs = {}
    for name, kern in (("torch", KERN), ("native", native)):
        state = DeltaNetState.zeros(cfg, "cpu", torch.bfloat16)
        paths = DeltaNetPaths()
        with torch.no_grad():
            deltanet(kern, cfg, w, x[:70], state, paths)
            outs[name] = torch.cat([deltanet(kern, cfg, w, x[t:t + 1], state, paths) for t in range(70, 82)])
        assert (paths.chunked, paths.recurrent) == (1, 12) and state.tokens == 82
        states[name] = state
    torch.testing.assert_close(states["native"].recurrent, states["torch"].recurrent, rtol=1e-5, atol=1e-6)
    assert torch.equal(states["native"].conv, states["torch"].conv)
    torch.testing.assert_close(outs["native"].float(), outs["torch"].float(), rtol=2 ** -7,
                               atol=2 ** -8 * outs["torch"].float().abs().max().item())
