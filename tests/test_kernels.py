"""The native decode kernels (`--kernels native`): products against a float64 reference, results
that depend neither on thread count nor on how many experts a call holds, decode steps identical
across cache modes, close to torch's kernels, and clear errors where they cannot be used."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import expertcache
from expertcache import CacheConfig, ExpertCacheError, kernels
from conftest import VOCAB, CountingModule, assert_one_line_error, run_cli, with_threads

PROMPT = torch.randint(4, VOCAB, (12,), generator=torch.Generator().manual_seed(5)).tolist()
STEPS = 12


@pytest.fixture(scope="module", params=["isa", "portable"])
def native(request):
    """The kernels this CPU gets, and the portable loop other CPUs get, built here too."""
    return kernels.load_native(portable=request.param == "portable")


@pytest.fixture(scope="module")
def isa():
    return kernels.load_native()


def test_each_build_uses_the_instructions_it_was_built_for(native, request):
    if request.node.callspec.params["native"] == "portable":
        assert native.isa == "portable"
    else:
        flags = kernels._cpu_flags().split()
        assert native.isa == ("avx512-bf16" if "avx512_bf16" in flags else
                              "avx2" if {"avx2", "fma"} <= set(flags) else "portable")


def bf16(*shape, seed: int, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(torch.bfloat16)


def assert_close_to_exact(y: torch.Tensor, w: torch.Tensor, x: torch.Tensor) -> None:
    """y is w x, summed in fp32 and rounded to bf16 once: within half a bf16 step of the exact
    value, plus the fp32 sum's own error."""
    exact = w.double() @ x.double()
    slack = 2.0 ** -8 * exact.abs() + 1e-5 * (w.double().abs() @ x.double().abs())
    assert ((y.double() - exact).abs() <= slack).all(), (y.double() - exact).abs().max()


@pytest.mark.parametrize("n,k", [(1536, 2048), (64, 32), (37, 100), (5, 33), (1, 7), (130, 64)])
def test_gemv_matches_exact_products(native, n, k):
    w, x = bf16(n, k, seed=n, scale=0.1), bf16(k, seed=k)
    y = native.gemv(w, x)
    assert y.dtype == torch.bfloat16 and y.shape == (n,)
    assert_close_to_exact(y, w, x)


def test_copy_bytes_copies_every_byte_at_any_alignment(native):
    """The RAM store's slot fills (streaming stores from the first 32-byte boundary of each chunk
    of 64 KiB, plain copies around them): every byte arrives, whatever the offsets and sizes,
    at 1 and 2 threads, and nothing outside the destination changes."""
    src = torch.randint(0, 256, (300_000,), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
    for threads in (1, 2):
        for lo, n in ((0, 0), (0, 1), (1, 31), (3, 4096 + 97), (17, 65536 * 2 + 5), (32, 200_000)):
            dst = torch.zeros(300_000 + 64, dtype=torch.uint8)
            with_threads(threads, lambda: native.copy_bytes(dst[lo: lo + n], src[7: 7 + n]))
            assert torch.equal(dst[lo: lo + n], src[7: 7 + n]), (threads, lo, n)
            assert not dst[:lo].any() and not dst[lo + n:].any(), (threads, lo, n)
    with pytest.raises(RuntimeError, match="copy_bytes: expected two contiguous uint8 host tensors of one size"):
        native.copy_bytes(torch.zeros(8, dtype=torch.uint8), torch.zeros(9, dtype=torch.uint8))


def test_gemv_does_not_depend_on_thread_count(native):
    w, x = bf16(3000, 768, seed=1, scale=0.1), bf16(768, seed=2)
    was = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = native.gemv(w, x)
        torch.set_num_threads(max(2, was))
        many = native.gemv(w, x)
    finally:
        torch.set_num_threads(was)
    assert torch.equal(one, many)


@pytest.mark.parametrize("t,n,k", [(16, 96, 2048), (7, 130, 64), (5, 37, 100), (2, 5, 33), (3, 1, 7), (130, 8, 48)])
def test_linear_rows_match_exact_products_and_each_row_its_own(native, t, n, k):
    w, x = bf16(n, k, seed=n, scale=0.1), bf16(t, k, seed=k)
    y = native.linear_rows(x, w)
    assert y.dtype == torch.bfloat16 and y.shape == (t, n)
    for r in range(t):
        assert_close_to_exact(y[r], w, x[r])
    # A row's sums do not depend on the rows beside it (the tile it fell in) or on threads.
    assert torch.equal(native.linear_rows(x[t - 1:], w)[0], y[t - 1])
    assert torch.equal(native.linear_rows(x[1:], w), y[1:])
    was = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(native.linear_rows(x, w), y)
    finally:
        torch.set_num_threads(was)
    assert native.linear_rows(x[:0], w).shape == (0, n)


def bf16_experts(D: int, I: int, n: int, seed: int):
    """A token x [D] and n random bf16 experts: gate_up [2I, D] and down [D, I] matrices."""
    x = bf16(D, seed=seed)
    gate_ups = [bf16(2 * I, D, seed=10 * seed + 10 + e, scale=0.1) for e in range(n)]
    downs = [bf16(D, I, seed=10 * seed + 20 + e, scale=0.1) for e in range(n)]
    return x, gate_ups, downs


def test_experts_match_exact_swiglu_and_do_not_depend_on_the_wave(native):
    D, I, n = 96, 48, 5
    x, gate_ups, downs = bf16_experts(D, I, n, seed=0)
    wave = native.experts(x, gate_ups, downs)
    assert wave.shape == (n, D) and wave.dtype == torch.bfloat16
    for e in range(n):
        # Alone, or in another company, an expert's output is the same to the bit.
        assert torch.equal(native.experts(x, gate_ups[e:e + 1], downs[e:e + 1])[0], wave[e])
        # Each step rounded to bf16 as torch rounds it: products, the activation, the gating product.
        gu = native.gemv(gate_ups[e], x)
        h = (F.silu(gu[:I].double()).to(torch.bfloat16).double() * gu[I:].double()).to(torch.bfloat16)
        assert_close_to_exact(wave[e], downs[e], h)
    assert torch.equal(native.experts(x, gate_ups[3:], downs[3:]), wave[3:])
    assert native.experts(x, [], []).shape == (0, D)


def test_experts_write_unrounded_rank_rows(native):
    D, I, n = 64, 32, 4
    x, gate_ups, downs = bf16_experts(D, I, n, seed=1)
    rounded = native.experts(x, gate_ups, downs)
    out = torch.full((n, D), float("nan"))
    ranks = [2, 3, 0, 1]
    for part in ([1, 3], [0, 2]):  # two waves
        native.experts(x, [gate_ups[e] for e in part], [downs[e] for e in part], "silu", out, [ranks[e] for e in part])
    for e in range(n):
        # the same sums, left in fp32: rounding them gives the bf16 outputs
        assert torch.equal(out[ranks[e]].to(torch.bfloat16), rounded[e])


def test_combine_adds_rounded_products_in_rank_order(native):
    A, D = 8, 200
    rows = torch.randn(A, D, generator=torch.Generator().manual_seed(3))
    reference = kernels.TorchKernels().combine  # each product rounded to fp32, then added in rank order
    for weights in (torch.rand(1, A, generator=torch.Generator().manual_seed(4)),
                    bf16(1, A, seed=5).abs()):
        for like in (torch.float32, torch.bfloat16):
            x = torch.empty(1, dtype=like)
            y = native.combine(weights, rows, x)
            assert y.shape == (1, D) and y.dtype == like
            assert torch.equal(y, reference(weights, rows, x))
        # and the reference is what it says: not a fused multiply-add, not another order
        w = weights[0].float()
        assert torch.equal(reference(weights, rows, rows)[0], ((w[0] * rows[0] + w[1] * rows[1]) + w[2] * rows[2]
                                                                + w[3] * rows[3] + w[4] * rows[4] + w[5] * rows[5]
                                                                + w[6] * rows[6] + w[7] * rows[7]))
    with pytest.raises(RuntimeError, match="weights: expected 8"):
        native.combine(torch.ones(1, 7), rows, rows)


@pytest.mark.parametrize("normalize,fp32", [(True, False), (False, False), (True, True)])
def test_route_matches_torchs_routing(native, normalize, fp32):
    D, E, k = 128, 64, 6
    checked = 0
    for seed in range(20):
        x, router = bf16(1, D, seed=seed), bf16(E, D, seed=100 + seed, scale=0.2)
        w, ids = native.route(x[0], router, k, normalize, fp32)
        # the logits are the native product's, as `NativeKernels.linear` gives them
        logits = native.gemv(router, x[0])[None]
        probs = torch.softmax(logits, dim=-1, dtype=torch.float)
        ref_w, ref_ids = torch.topk(probs, k, dim=-1)
        if normalize:
            ref_w = ref_w / ref_w.sum(dim=-1, keepdim=True)
        assert ids.dtype == torch.int64 and ids.shape == (1, k)
        assert w.dtype == (torch.float32 if fp32 else torch.bfloat16) and w.shape == (1, k)
        top = torch.topk(probs[0], k + 1).values
        if (top[:-1] - top[1:]).min() > 1e-6:  # no (near-)tie, whose order is the tie rule's or rounding's
            assert torch.equal(ids, ref_ids)
            checked += 1
        assert torch.allclose(w.float(), ref_w.to(w.dtype).float(), rtol=2 ** -7 if not fp32 else 1e-6, atol=0)
    assert checked >= 10
    # exact ties go to the lower id
    w, ids = native.route(torch.zeros(D, dtype=torch.bfloat16), bf16(E, D, seed=0), 3, True)
    assert ids.tolist() == [[0, 1, 2]] and torch.equal(w.float(), torch.full((1, 3), 1 / 3).to(w.dtype).float())
    with pytest.raises(RuntimeError, match="top_k: expected 1 to 64, got 65"):
        native.route(x[0], router, 65, True)


@pytest.mark.parametrize("rows,cols,per_row", [(1, 64, False), (1, 100, False), (6, 16, True)])
def test_rms_norm_matches_torch(native, rows, cols, per_row):
    rms_norm = kernels.TorchKernels().rms_norm

    x = bf16(rows, cols, seed=rows + cols)
    w = bf16(*((rows, cols) if per_row else (cols,)), seed=7, scale=0.5)
    # torch's path (no native kernels active): fp32 normalisation, rounded, then times the weight
    torch.testing.assert_close(native.rms_norm(x, w, 1e-6), rms_norm(x, w, 1e-6), rtol=2 ** -7, atol=1e-3)


# Heads per key/value head 2, 8, 6 (a block of 4 and one of 2) and 1; a head width with a tail past
# the last 8 lanes; contexts past a block of 64 values and not a multiple of 8.
@pytest.mark.parametrize("H,G,Dh,cap,pos", [(4, 2, 16, 10, 6), (16, 2, 32, 200, 149), (12, 2, 20, 80, 70),
                                            (3, 3, 16, 12, 9)])
def test_attend_matches_reference_attention(native, H, G, Dh, cap, pos):
    eps = 1e-6
    qkv, norm = bf16((H + 2 * G) * Dh, seed=1), bf16(H + G, Dh, seed=2, scale=0.5)
    angle = torch.rand(Dh // 2, generator=torch.Generator().manual_seed(3)) * 6
    cos = torch.cat((angle.cos(), angle.cos())).to(torch.bfloat16)
    sin = torch.cat((-angle.sin(), angle.sin())).to(torch.bfloat16)  # rotate-half's sign folded in
    kc, vc = bf16(G, cap, Dh, seed=4), bf16(G, cap, Dh, seed=5)
    before_k, before_v = kc.clone(), vc.clone()
    out = native.attend(qkv, norm, eps, cos, sin, kc, vc, pos, Dh ** -0.5, H, G)
    # Only this position's keys and values are written; v as it came, k normalised and rotated.
    untouched = torch.ones(cap, dtype=torch.bool)
    untouched[pos] = False
    assert torch.equal(kc[:, untouched], before_k[:, untouched]) and torch.equal(vc[:, untouched], before_v[:, untouched])
    assert torch.equal(vc[:, pos], qkv[(H + G) * Dh:].view(G, Dh))
    qk = native.rms_norm(qkv[:(H + G) * Dh].view(H + G, Dh).contiguous(), norm, eps).double()
    rotated = qk * cos.double() + torch.cat((qk[:, Dh // 2:], qk[:, :Dh // 2]), dim=1) * sin.double()
    torch.testing.assert_close(kc[:, pos].double(), rotated[H:], rtol=2 ** -7, atol=1e-3)
    q = rotated[:H].view(G, H // G, Dh)                                     # heads grouped by kv head
    scores = torch.einsum("grd,gtd->grt", q, kc[:, :pos + 1].double()) * Dh ** -0.5
    expected = torch.einsum("grt,gtd->grd", scores.softmax(-1), vc[:, :pos + 1].double()).reshape(H * Dh)
    torch.testing.assert_close(out.double(), expected, rtol=2 ** -6, atol=2e-2)
    # Without a q/k norm the projections are rotated as they came.
    kc2, vc2 = before_k.clone(), before_v.clone()
    native.attend(qkv, torch.empty(0, dtype=torch.bfloat16), eps, cos, sin, kc2, vc2, pos, Dh ** -0.5, H, G)
    raw = qkv[H * Dh:(H + G) * Dh].view(G, Dh).double()
    raw_rot = raw * cos.double() + torch.cat((raw[:, Dh // 2:], raw[:, :Dh // 2]), dim=1) * sin.double()
    torch.testing.assert_close(kc2[:, pos].double(), raw_rot, rtol=2 ** -7, atol=1e-3)


# Gemma 4's form: a sliding layer's ring (the token's row mid-ring, some rows empty or out of the
# window), and a full layer with k-eq-v; weights fp32 (a GGUF's) or bf16.
@pytest.mark.parametrize("H,G,Dh,k_eq_v,wdtype,ring", [(4, 2, 16, False, torch.float32, True),
                                                       (8, 1, 24, True, torch.bfloat16, False),
                                                       (16, 2, 40, False, torch.bfloat16, True)])
def test_attend_scaled_matches_reference_attention(native, H, G, Dh, k_eq_v, wdtype, ring):
    from expertcache.models.sliding_attention import gemma_rms_norm

    eps, cap, P, window = 1e-6, 12, 30, 10
    qkv = bf16((H + (1 if k_eq_v else 2) * G) * Dh, seed=1)
    q_norm, k_norm = bf16(Dh, seed=2, scale=0.5).to(wdtype), bf16(Dh, seed=3, scale=0.5).to(wdtype)
    angle = torch.rand(Dh // 2, generator=torch.Generator().manual_seed(3)) * 6
    cos = torch.cat((angle.cos(), angle.cos())).to(torch.bfloat16)
    sin = torch.cat((-angle.sin(), angle.sin())).to(torch.bfloat16)
    kc, vc = bf16(G, cap, Dh, seed=4), bf16(G, cap, Dh, seed=5)
    if ring:  # position p in row p % cap: 19..30 in the ring, 25 emptied, 19 and 20 out of the window
        slot, n = P % cap, cap
        kpos = torch.tensor([P - (slot - r) % cap for r in range(cap)])
        kpos[25 % cap] = -1
        lo, live = P - window, (kpos >= 0) & (kpos > P - window)
    else:
        slot, n, kpos, lo = 7, 8, None, -1
        live = torch.ones(n, dtype=torch.bool)
    before_k, before_v = kc.clone(), vc.clone()
    out = native.attend_scaled(qkv, q_norm, k_norm, eps, cos, sin, kc, vc, slot, n, kpos, lo, 1.0, H, G, k_eq_v)
    others = torch.ones(cap, dtype=torch.bool)
    others[slot] = False
    assert torch.equal(kc[:, others], before_k[:, others]) and torch.equal(vc[:, others], before_v[:, others])
    # q and k normalised and scaled once (each family's torch formula), then rotated; v normalised
    # without a weight, from k's projection with k-eq-v.
    q = gemma_rms_norm(qkv[:H * Dh].view(H, Dh), q_norm, eps).double()
    k = gemma_rms_norm(qkv[H * Dh:(H + G) * Dh].view(G, Dh), k_norm, eps).double()
    v_in = qkv[H * Dh:(H + G) * Dh] if k_eq_v else qkv[(H + G) * Dh:]
    assert torch.equal(vc[:, slot], gemma_rms_norm(v_in.view(G, Dh), None, eps))
    rot = lambda x: x * cos.double() + torch.cat((x[:, Dh // 2:], x[:, :Dh // 2]), dim=1) * sin.double()
    torch.testing.assert_close(kc[:, slot].double(), rot(k), rtol=2 ** -7, atol=1e-3)
    qr = rot(q).view(G, H // G, Dh)
    scores = torch.einsum("grd,gtd->grt", qr, kc[:, :n].double()).masked_fill(~live, float("-inf"))
    expected = torch.einsum("grt,gtd->grd", scores.softmax(-1), vc[:, :n].double()).reshape(H * Dh)
    torch.testing.assert_close(out.double(), expected, rtol=2 ** -6, atol=2e-2)
    if ring:  # a masked row's key and value play no part, whatever they hold
        kc[:, ~live], vc[:, ~live] = 50.0, -50.0
        again = native.attend_scaled(qkv, q_norm, k_norm, eps, cos, sin, kc, vc, slot, n, kpos, lo, 1.0, H, G, k_eq_v)
        assert torch.equal(again, out)


# Qwen3.5's form: per head [query | gate] rows, q/k norms of 1 + w, a rotary over the first R dims.
@pytest.mark.parametrize("H,G,Dh,R,wdtype", [(4, 2, 16, 4, torch.float32), (16, 2, 40, 10, torch.bfloat16),
                                             (3, 1, 8, 8, torch.float32)])
def test_attend_gated_matches_reference_attention(native, H, G, Dh, R, wdtype):
    from expertcache.models.gated_attention import rms_norm_fp32

    eps, cap, slot = 1e-6, 12, 9
    qkv = bf16(2 * (H + G) * Dh, seed=1)
    q_norm, k_norm = (1 + bf16(Dh, seed=2, scale=0.5).float()).to(wdtype), (1 + bf16(Dh, seed=3).float()).to(wdtype)
    angle = torch.rand(R // 2, generator=torch.Generator().manual_seed(3)) * 6
    cos = torch.cat((angle.cos(), angle.cos())).to(torch.bfloat16)
    sin = torch.cat((-angle.sin(), angle.sin())).to(torch.bfloat16)
    kc, vc = bf16(G, cap, Dh, seed=4), bf16(G, cap, Dh, seed=5)
    before_k, before_v = kc.clone(), vc.clone()
    out = native.attend_gated(qkv, q_norm, k_norm, eps, cos, sin, kc, vc, slot, slot + 1, Dh ** -0.5, H, G)
    others = torch.ones(cap, dtype=torch.bool)
    others[slot] = False
    assert torch.equal(kc[:, others], before_k[:, others]) and torch.equal(vc[:, others], before_v[:, others])
    qg = qkv[:2 * H * Dh].view(H, 2, Dh)
    k_in, v_in = qkv[2 * H * Dh:].view(2, G, Dh)
    assert torch.equal(vc[:, slot], v_in)

    def rot(x):  # the first R dims rotated, the rest as they are
        r = x[:, :R]
        return torch.cat((r * cos.double() + torch.cat((r[:, R // 2:], r[:, :R // 2]), dim=1) * sin.double(),
                          x[:, R:]), dim=1)

    k = rms_norm_fp32(k_in, k_norm.float(), eps)
    assert torch.equal(kc[:, slot, R:], k[:, R:])
    torch.testing.assert_close(kc[:, slot].double(), rot(k.double()), rtol=2 ** -7, atol=1e-3)
    q = rot(rms_norm_fp32(qg[:, 0], q_norm.float(), eps).double()).view(G, H // G, Dh)
    scores = torch.einsum("grd,gtd->grt", q, kc[:, :slot + 1].double()) * Dh ** -0.5
    attn = torch.einsum("grt,gtd->grd", scores.softmax(-1), vc[:, :slot + 1].double()).reshape(H, Dh)
    expected = (attn * torch.sigmoid(qg[:, 1].double())).reshape(H * Dh)
    torch.testing.assert_close(out.double(), expected, rtol=2 ** -6, atol=2e-2)


@pytest.mark.parametrize("shape,weight", [((1, 2816), torch.bfloat16), ((1, 16, 256), torch.float32),
                                          ((1, 8, 100), None), ((1, 4, 96), torch.bfloat16)])
def test_scaled_rms_norm_matches_each_familys_torch_formula(native, shape, weight):
    """Gemma 4's norm (weight w, pow(-0.5)) and Qwen3.5's (1 + w in fp32, rsqrt), both scaled in fp32
    and rounded once: the native call equals them within one bf16 step (another order of the sum of
    squares), on a decode step's [1, D] or per-head [1, H, Dh] input, with or without a weight."""
    from expertcache.models.gated_attention import rms_norm_fp32
    from expertcache.models.sliding_attention import gemma_rms_norm

    x = bf16(*shape, seed=shape[-1])
    w = None if weight is None else bf16(shape[-1], seed=3, scale=0.5).to(weight)
    nk = kernels.NativeKernels(native)
    for reference in (gemma_rms_norm, rms_norm_fp32) if w is not None else (gemma_rms_norm,):
        got = nk.rms_norm_scaled(x, w, 1e-6, reference)
        assert got.shape == x.shape and got.dtype == torch.bfloat16
        torch.testing.assert_close(got, reference(x, w, 1e-6), rtol=2 ** -7, atol=1e-6)
    # more than one token: the family's own formula, as prefill runs it
    x2 = bf16(3, shape[-1], seed=1)
    assert torch.equal(nk.rms_norm_scaled(x2, w, 1e-6, gemma_rms_norm), gemma_rms_norm(x2, w, 1e-6))
    with pytest.raises(RuntimeError, match="weight: expected"):
        native.rms_norm_scaled(bf16(1, 8, seed=0), torch.ones(7), 1e-6)


def test_bad_arguments_are_errors_not_crashes(native):
    with pytest.raises(RuntimeError, match="expected 8 columns"):
        native.gemv(bf16(4, 9, seed=0), bf16(8, seed=1))
    with pytest.raises(RuntimeError, match="contiguous"):
        native.gemv(bf16(8, 4, seed=0).t(), bf16(8, seed=1))
    with pytest.raises(RuntimeError, match="bf16"):
        native.gemv(torch.ones(4, 8), torch.ones(8))
    with pytest.raises(RuntimeError, match="expected 8 columns"):
        native.linear_rows(bf16(3, 8, seed=1), bf16(4, 9, seed=0))
    with pytest.raises(RuntimeError, match="x: expected a contiguous 2-D bf16"):
        native.linear_rows(bf16(8, 3, seed=1).t(), bf16(4, 8, seed=0))
    kc = bf16(2, 4, 16, seed=0)
    with pytest.raises(RuntimeError, match="row 4 is outside the cache of 4 rows"):
        native.attend(bf16(8 * 16, seed=1), torch.empty(0, dtype=torch.bfloat16), 1e-6, bf16(16, seed=2),
                      bf16(16, seed=3), kc, kc.clone(), 4, 0.25, 4, 2)
    norm, rot = bf16(16, seed=4), bf16(16, seed=5)
    with pytest.raises(RuntimeError, match="row 3 is not among the 3 rows attended over"):
        native.attend_scaled(bf16(8 * 16, seed=1), norm, norm, 1e-6, rot, rot, kc, kc.clone(), 3, 3, None, -1,
                             1.0, 4, 2, False)
    with pytest.raises(RuntimeError, match="kpos: expected a contiguous int64 CPU tensor of at least 4 positions"):
        native.attend_scaled(bf16(8 * 16, seed=1), norm, norm, 1e-6, rot, rot, kc, kc.clone(), 0, 4,
                             torch.arange(3), -1, 1.0, 4, 2, False)
    with pytest.raises(RuntimeError, match="shapes do not match"):  # k-eq-v takes no v rows
        native.attend_scaled(bf16(8 * 16, seed=1), norm, norm, 1e-6, rot, rot, kc, kc.clone(), 0, 1, None, -1,
                             1.0, 4, 2, True)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from conftest import build_reference, save_checkpoint, tiny_config

    ref = build_reference(tiny_config("qwen3_moe", experts=16, top_k=4, layers=3))
    return save_checkpoint(ref, tmp_path_factory.mktemp("kernels") / "ckpt", dtype=torch.bfloat16)


def decode_logits(model) -> torch.Tensor:
    """Logits of STEPS greedy decode steps after PROMPT, one token at a time: [STEPS, V]."""
    s = model.new_session()
    logits = model.prefill(s, PROMPT)
    rows = []
    for _ in range(STEPS):
        logits = model.prefill(s, [int(logits.argmax())])
        rows.append(logits.reshape(-1))
    return torch.stack(rows)


@pytest.fixture(scope="module")
def native_reference(checkpoint, isa):
    return decode_logits(expertcache.load(checkpoint, cache=CacheConfig(mode="resident"), kernels="native"))


@pytest.mark.parametrize("cache", [CacheConfig(mode="cache", experts=1), CacheConfig(mode="cache", experts=7),
                                   CacheConfig(mode="cache", fraction=0.5, policy="lfu", store="mmap"),
                                   CacheConfig(mode="staging", store="disk"), CacheConfig(mode="staging", experts=3)],
                         ids=["1-slot", "7-slots", "half-lfu-mmap", "staging-disk", "staging-3"])
def test_decode_bitwise_identical_across_cache_modes(checkpoint, native_reference, cache):
    model = expertcache.load(checkpoint, cache=cache, kernels="native")
    assert torch.equal(decode_logits(model), native_reference)


def test_ram_store_fills_slots_with_the_native_copy(checkpoint, native_reference, monkeypatch):
    """Cache mode over the RAM store fills its slots with the kernels' streaming copy
    (`copy_bytes`): the same logits as every expert resident, bit for bit."""
    model = expertcache.load(checkpoint, cache=CacheConfig(mode="cache", experts=3, store="ram"), kernels="native")
    counting = CountingModule(model.kernels.native, "copy_bytes")
    monkeypatch.setattr(model.kernels, "native", counting)
    assert torch.equal(decode_logits(model), native_reference)
    assert counting.calls["copy_bytes"] > 0


def test_decode_of_a_packed_checkpoint_is_the_same(checkpoint, native_reference, tmp_path):
    from expertcache.models.pack import pack

    packed = pack(checkpoint, tmp_path / "packed", progress=False)
    for cache in (CacheConfig(mode="resident"), CacheConfig(mode="cache", experts=5, store="disk")):
        assert torch.equal(decode_logits(expertcache.load(packed, cache=cache, kernels="native")), native_reference)


def test_native_decode_is_close_to_torch_and_takes_the_native_path(checkpoint, native_reference, monkeypatch):
    model = expertcache.load(checkpoint, kernels="native")
    calls = {"gemv": 0, "route": 0, "experts": 0, "combine": 0, "attend": 0, "rms_norm": 0}

    class Counting:
        def __getattr__(self, name):
            def call(*args):
                calls[name] += 1
                return getattr(kernels.load_native(), name)(*args)
            return call

    monkeypatch.setattr(model.kernels, "native", Counting())
    assert torch.equal(decode_logits(model), native_reference)
    session = model.new_session()
    model.prefill(session, PROMPT)
    for name in calls:
        calls[name] = 0
    model.prefill(session, [5])
    # One decode step, per layer: the q/k/v and o products, the routing, attention, the experts,
    # their combination and two norms; then the final norm and the lm head.
    assert calls == {"gemv": 3 * 2 + 1, "route": 3, "experts": 3, "combine": 3, "attend": 3, "rms_norm": 3 * 2 + 1}
    torch_model = expertcache.load(checkpoint, kernels="torch")
    assert torch_model.kernels.native is None
    torch_logits = decode_logits(torch_model)
    scale = torch_logits.float().abs().max()
    assert (torch_logits.float() - native_reference.float()).abs().max() <= 0.05 * scale


def test_another_models_kernels_do_not_leak(checkpoint, native_reference):
    torch_model = expertcache.load(checkpoint, kernels="torch")
    expected = decode_logits(torch_model)
    native_model = expertcache.load(checkpoint, kernels="native")
    assert torch.equal(decode_logits(native_model), native_reference)
    assert torch.equal(decode_logits(torch_model), expected)
    # Each model holds its own kernel set; no process-wide switch exists for one to leave behind.
    assert torch_model.kernels.name == "torch" and native_model.kernels.name == "native"
    assert not any(isinstance(v, kernels.Kernels) for v in vars(kernels).values())


def test_a_reload_keeps_the_native_kernels(checkpoint, tmp_path, monkeypatch):
    import shutil

    work = tmp_path / "model"
    shutil.copytree(checkpoint, work)
    model = expertcache.load(work, kernels="native", cache=CacheConfig(mode="cache", experts=5))
    decode_logits(model)
    # The checkpoint is replaced by other weights of the same shapes: the next call reloads.
    new = tmp_path / "new"
    shutil.copytree(checkpoint, new)
    _perturb(new / "model.safetensors")
    (work / "model.safetensors").unlink()
    shutil.copy(new / "model.safetensors", work / "model.safetensors")
    counting = CountingModule(model.kernels.native, "experts")
    monkeypatch.setattr(model.kernels, "native", counting)
    model.begin_call()
    got = decode_logits(model)
    assert model.kernels.name == "native" and counting.calls["experts"] > 0
    assert torch.equal(got, decode_logits(expertcache.load(new, kernels="native")))
    assert model.telemetry()["invalidations"]["source"] > 0


def _perturb(path) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(path))
    for name, t in tensors.items():
        if t.is_floating_point() and t.dim() >= 2:
            tensors[name] = (t.float() * 1.5).to(t.dtype)
    save_file(tensors, str(path), metadata={"format": "pt"})


def test_cli_runs_with_native_kernels(capsys):
    code, err = run_cli(capsys, "run", "--kernels", "native", "-p", "Hello", "-n", "4", "--temp", "0")
    assert code == 0, err


@pytest.mark.parametrize("argv,needles", [
    (["--kernels", "native", "--dtype", "float32"], ["--kernels native", "float32", "bfloat16"]),
    (["--kernels", "native", "--device", "meta"], ["meta", "cpu"]),
    (["--kernels", "fast"], ["--kernels", "fast"]),
])
def test_bad_kernel_choices(capsys, argv, needles):
    code, err = run_cli(capsys, "run", "-p", "Hi", "-n", "1", *argv)
    assert_one_line_error(code, err, *needles)


def test_missing_build_tools_are_one_line_errors(monkeypatch):
    from torch.utils import cpp_extension

    monkeypatch.setattr(kernels, "_loaded", {})

    def no_ninja():
        raise RuntimeError("Ninja is required to load C++ extensions")

    monkeypatch.setattr(cpp_extension, "verify_ninja_availability", no_ninja)
    with pytest.raises(ExpertCacheError, match="ninja was not found"):
        kernels.load_native()
    monkeypatch.setattr(cpp_extension, "verify_ninja_availability", lambda: None)

    def no_compiler(*a, **k):
        raise RuntimeError("Error building extension 'expertcache_decode': c++: not found\nmore")

    monkeypatch.setattr(cpp_extension, "load", no_compiler)
    with pytest.raises(ExpertCacheError, match=r"could not be built \(Error building extension") as e:
        kernels.load_native()
    assert "\n" not in str(e.value)


FAMILIES = [("qwen3_moe", {}), ("qwen2_moe", {}), ("olmoe", {"clip_qkv": 0.5}), ("mixtral", {"tie": True})]


NEAR_TIE = 1e-2  # reference router probabilities of the k-th and (k+1)-th expert closer than this


def follow_reference_at_near_ties(model, ref_ids: list[torch.Tensor], ref_gaps: list[torch.Tensor]) -> list:
    """Route `model` as the reference does where the two disagree: its own top-k everywhere else,
    the reference's experts (weighted by the model's own probabilities) at a position where the
    model picked others, which the test allows only at a near tie of the reference's router. A
    flip there (either kernel choice may break a tie either way) would put other experts' output
    in that position's keys and values and move every later position, so that the comparison
    would measure the tie, not the kernels. Returns the list of (layer, position) so taken."""
    k, moe = model.net.kernels, list(model.cfg.moe_layers)
    route, state, taken = k.route, {"calls": 0, "pos": 0}, []

    def routed(x, router, top_k, normalize, weights_fp32=False):
        w, ids = route(x, router, top_k, normalize, weights_fp32)
        m, p0 = state["calls"] % len(moe), state["pos"]
        state["calls"] += 1
        if m == len(moe) - 1:
            state["pos"] += x.shape[0]
        want = ref_ids[m][p0: p0 + x.shape[0]]                              # [T, k]
        differ = [t for t in range(x.shape[0]) if set(ids[t].tolist()) != set(want[t].tolist())]
        if not differ:
            return w, ids
        assert all(ref_gaps[m][p0 + t] < NEAR_TIE for t in differ), (moe[m], p0, differ)
        taken.extend((moe[m], p0 + t) for t in differ)
        probs = torch.softmax(k.linear(x, router), dim=-1, dtype=torch.float)  # [T, E]
        ids = ids.clone()
        ids[differ] = want[differ].to(ids.dtype)
        p = probs.gather(1, ids.long())
        p, order = p.sort(dim=-1, descending=True)                          # router-rank order
        ids = ids.gather(1, order)
        if normalize:
            p = p / p.sum(dim=-1, keepdim=True)
        return p.to(w.dtype), ids

    k.route = routed
    return taken


@pytest.mark.parametrize("arch,opts", FAMILIES, ids=[a for a, _ in FAMILIES])
def test_native_decode_tracks_the_reference_in_every_family(tiny_checkpoint, isa, arch, opts):
    """Step-by-step decode of a bf16 checkpoint against transformers in fp32 on the same (bf16)
    weights: the native kernels stay as close to it as torch's bf16 kernels do. OLMoE's attention
    (whole-projection q/k norm, clipping) takes torch's path, its products the native ones;
    Qwen2-MoE adds q/k/v biases and a shared expert. Compared by the median over positions of
    each position's largest error; at a near tie of the reference's router both kernel choices
    follow the reference's experts (`follow_reference_at_near_ties`)."""
    ref, d = tiny_checkpoint(arch, dtype=torch.bfloat16, **opts)
    ids = torch.randint(4, VOCAB, (24,), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        out = ref.float()(ids[None], output_router_logits=True)
    exact = out.logits[0, 8:]                                            # [16, V]
    K = ref.config.num_experts_per_tok
    probs = [torch.softmax(r.float().reshape(len(ids), -1), dim=-1) for r in out.router_logits]
    ref_ids = [torch.topk(p, K, dim=-1).indices for p in probs]          # per MoE layer [24, K]
    ref_gaps = [(lambda v: v[:, K - 1] - v[:, K])(torch.topk(p, K + 1, dim=-1).values) for p in probs]
    errors = {}
    for choice in ("torch", "native"):
        model = expertcache.load(d, kernels=choice)
        follow_reference_at_near_ties(model, ref_ids, ref_gaps)
        session = model.new_session()
        model.prefill(session, ids[:8].tolist())
        steps = torch.cat([model.prefill(session, [t], all_logits=True) for t in ids[8:].tolist()])
        errors[choice] = (steps.float() - exact).abs().amax(-1).median().item()
    assert errors["native"] <= 1.5 * errors["torch"] + 1e-2, errors


@pytest.mark.parametrize("arch,opts", FAMILIES[:2], ids=[a for a, _ in FAMILIES[:2]])
def test_native_prefill_tracks_the_reference(tiny_checkpoint, isa, arch, opts, monkeypatch):
    """A prompt's logits with the native kernels, whose products of a few rows (each expert's
    tokens) take `linear_rows` on AVX2, against transformers in fp32 on the same bf16 weights:
    as close as torch's kernels. Qwen2-MoE's projections have biases and stay on torch's."""
    ref, d = tiny_checkpoint(arch, dtype=torch.bfloat16, **opts)
    ids = torch.randint(4, VOCAB, (40,), generator=torch.Generator().manual_seed(11))
    with torch.no_grad():
        exact = ref.float()(ids[None]).logits[0]                       # [40, V]
    errors = {}
    for choice in ("torch", "native"):
        model = expertcache.load(d, kernels=choice)
        if choice == "native":
            counting = CountingModule(model.kernels.native, "linear_rows")
            monkeypatch.setattr(model.kernels, "native", counting)
        logits = model.prefill(model.new_session(), ids.tolist(), all_logits=True)
        errors[choice] = (logits.float() - exact).abs().amax(-1).median().item()
    assert errors["native"] <= 1.5 * errors["torch"] + 1e-2, errors
    # Taken where the build widens bf16 in registers; oneDNN's own product is fast elsewhere.
    assert (counting.calls["linear_rows"] > 0) == (isa.isa == "avx2")


def test_auto_is_native_for_bf16_on_the_cpu_and_torch_otherwise(checkpoint, native_reference, tmp_path):
    auto = expertcache.load(checkpoint)
    assert auto.kernels.name == "native"
    assert torch.equal(decode_logits(auto), native_reference)
    assert expertcache.load(checkpoint, dtype="float32").kernels.name == "torch"  # the reference path


def test_auto_falls_back_to_torch_with_one_notice_when_the_kernels_cannot_build(checkpoint, monkeypatch, capsys):
    def fail(*a, **k):
        raise ExpertCacheError("--kernels native: ninja was not found; expected it on PATH")

    monkeypatch.setattr(kernels, "load_native", fail)
    model = expertcache.load(checkpoint)
    assert model.kernels.name == "torch"
    notice = [l for l in capsys.readouterr().err.splitlines() if "using torch's kernels" in l]
    assert len(notice) == 1 and "ninja" in notice[0]
    with pytest.raises(ExpertCacheError, match="ninja"):
        expertcache.load(checkpoint, kernels="native")


def test_checkouts_of_one_source_share_one_native_build(tmp_path, monkeypatch):
    """Two copies of the same native source (a CI clone, a worktree) compile from one staged copy
    under one name: the build file names the sources' paths, and compiling each from its own
    path rebuilt the module on every start from the other (30-70 s each). A different source gets
    a name of its own."""
    import shutil

    from torch.utils import cpp_extension

    from expertcache import kernels as kmod

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    built = []
    monkeypatch.setattr(cpp_extension, "load", lambda name, sources, **kw: built.append((name, sources)) or name)
    native = Path(kmod.__file__).resolve().parents[1] / "native"
    copies = [shutil.copytree(native, tmp_path / side) for side in ("a", "b")]
    names = [kmod.build_native("decode", Path(c) / "decode.cpp", "test") for c in copies]
    assert names[0] == names[1] and built[0] == built[1]
    staged = Path(built[0][1][0])
    assert not staged.is_relative_to(tmp_path / "a") and not staged.is_relative_to(tmp_path / "b")
    assert staged.read_bytes() == (native / "decode.cpp").read_bytes()
    assert (staged.parent / "rank_rows.h").read_bytes() == (native / "rank_rows.h").read_bytes()
    (Path(copies[1]) / "decode.cpp").write_text((native / "decode.cpp").read_text() + "\n// changed\n")
    assert kmod.build_native("decode", Path(copies[1]) / "decode.cpp", "test") != names[0]
