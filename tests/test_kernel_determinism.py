"""The kernels give the same bits run to run: whatever the thread count, the input's alignment,
the rows around the kernels' vector widths and tiles, and other threads running products."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.nn.functional as F

from expertcache.kernels import TorchKernels, load_native

from conftest import with_threads


@pytest.fixture(scope="module")
def native():
    return load_native()


def at_offset(t: torch.Tensor, off: int) -> torch.Tensor:
    """A contiguous copy of t whose data starts `off` elements into a fresh buffer."""
    buf = torch.empty(t.numel() + off + 64, dtype=t.dtype)
    v = buf[off:off + t.numel()].view(t.shape)
    v.copy_(t)
    return v


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t.view(torch.int32)


# Widths around the AVX-512 loop (64 per step, a masked tail of up to 32) and the portable
# build's 16 lanes; row counts around the 16-row grain of the parallel split.
@pytest.mark.parametrize("k", [1, 15, 31, 33, 63, 64, 65, 97, 130])
@pytest.mark.parametrize("n", [1, 15, 16, 17, 33])
def test_gemv_bits_do_not_depend_on_threads_alignment_or_other_rows(native, k, n):
    g = torch.Generator().manual_seed(k * 100 + n)
    w = torch.randn(n, k, generator=g).bfloat16()
    x = torch.randn(1, k, generator=g).bfloat16()
    ref = with_threads(1, lambda: native.gemv(w, x))
    for threads in (1, 2, 3):
        for off in (1, 3, 8, 31):
            y = with_threads(threads, lambda: native.gemv(at_offset(w, off), at_offset(x, off + 5)))
            assert torch.equal(bits(y), bits(ref)), (threads, off)
    for r in range(n):  # each row as it is alone
        assert torch.equal(bits(native.gemv(w[r:r + 1].contiguous(), x)), bits(ref[:, r:r + 1])), r
    exact = w.double() @ x[0].double()
    scale = w.double().abs() @ x[0].double().abs()
    assert torch.all((ref[0].double() - exact).abs() <= scale * 2 ** -7 + 1e-30)  # no garbage read


@pytest.mark.parametrize("D, I, n", [(33, 17, 2), (64, 32, 3), (48, 40, 5)])
def test_native_experts_bits_do_not_depend_on_threads_or_the_wave(native, D, I, n):
    g = torch.Generator().manual_seed(D + I + n)
    x = torch.randn(D, generator=g).bfloat16()
    gus = [(0.3 * torch.randn(2 * I, D, generator=g)).bfloat16() for _ in range(n)]
    dns = [(0.3 * torch.randn(D, I, generator=g)).bfloat16() for _ in range(n)]
    for act in ("silu", "gelu_pytorch_tanh"):
        ref = with_threads(1, lambda: native.experts(x, gus, dns, act))
        for threads in (2, 3):
            assert torch.equal(bits(with_threads(threads, lambda: native.experts(x, gus, dns, act))), bits(ref))
        for e in range(n):
            alone = native.experts(at_offset(x, 3), [at_offset(gus[e], 1)], [at_offset(dns[e], 7)], act)
            assert torch.equal(bits(alone[0]), bits(ref[e])), (act, e)


@pytest.mark.parametrize("H, G, Dh, n", [(4, 2, 16, 1), (12, 3, 20, 9), (16, 4, 24, 67)])
def test_native_attention_bits_do_not_depend_on_threads(native, H, G, Dh, n):
    g = torch.Generator().manual_seed(H * G * Dh + n)
    qkv = torch.randn((H + 2 * G) * Dh, generator=g).bfloat16()
    norm = (1 + 0.1 * torch.randn(H + G, Dh, generator=g)).bfloat16()
    cos, sin = torch.randn(Dh, generator=g).bfloat16(), torch.randn(Dh, generator=g).bfloat16()
    kc0, vc0 = torch.randn(G, n + 3, Dh, generator=g).bfloat16(), torch.randn(G, n + 3, Dh, generator=g).bfloat16()

    def run():
        kc, vc = kc0.clone(), vc0.clone()
        y = native.attend(qkv, norm, 1e-6, cos, sin, kc, vc, n - 1, Dh ** -0.5, H, G)
        return y, kc, vc

    ref = with_threads(1, run)
    for threads in (2, 3):
        got = with_threads(threads, run)
        assert all(torch.equal(bits(a), bits(b)) for a, b in zip(got, ref)), threads


def test_one_row_products_in_two_threads_leave_onednn_as_they_found_it():
    """torch's one-row bf16 product turns oneDNN off for its call, a process-wide switch. Two
    threads taking such products at once (two models side by side, a server's requests) must not
    leave it off for good: every later bf16 product of the process would take another kernel
    and give other bits."""
    g = torch.Generator().manual_seed(0)
    w = (0.02 * torch.randn(2048, 2048, generator=g)).bfloat16()
    x = torch.randn(1, 2048, generator=g).bfloat16()
    many = torch.randn(32, 2048, generator=g).bfloat16()
    k = TorchKernels()
    one = k.linear(x, w)
    prod = F.linear(many, w)
    was = torch._C._get_mkldnn_enabled()
    results: list[torch.Tensor] = []
    try:
        for _ in range(20):
            start = threading.Barrier(2)

            def go():
                start.wait()
                for _ in range(10):
                    results.append(k.linear(x, w))

            threads = [threading.Thread(target=go) for _ in range(2)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            later = F.linear(many, w)
            assert torch.equal(bits(later), bits(prod))  # later products keep their kernel
            assert torch._C._get_mkldnn_enabled() == was
        assert all(torch.equal(bits(r), bits(one)) for r in results)  # each the one-row product's bits
    finally:
        torch._C._set_mkldnn_enabled(was)  # a failure here leaves the other tests as they were
