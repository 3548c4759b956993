"""Our model code against the transformers implementation, on tiny random checkpoints."""

from __future__ import annotations

import json

import pytest
import torch

import expertcache
from conftest import VOCAB

CASES = [
    # (arch, options)
    ("qwen3_moe", {}),
    ("qwen3_moe", {"dense": True, "tie": True}),
    ("qwen3_moe", {"norm_topk": False}),
    ("qwen2_moe", {}),
    ("qwen2_moe", {"dense": True, "norm_topk": False}),
    ("olmoe", {"norm_topk": False}),
    ("olmoe", {"tie": True, "clip_qkv": 0.5}),
    ("mixtral", {}),
    ("mixtral", {"tie": True}),
]


def ids_of(n: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(4, VOCAB, (n,), generator=torch.Generator().manual_seed(seed))


def reference_logits(ref, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return ref(ids[None]).logits[0].float()


@pytest.mark.parametrize("fused", [False, True], ids=["per-expert", "fused"])
@pytest.mark.parametrize("arch,opts", CASES, ids=[f"{a}-{'-'.join(o) or 'base'}" for a, o in CASES])
def test_logits_match_reference(tiny_checkpoint, arch, opts, fused):
    ref, d = tiny_checkpoint(arch, fused=fused, **opts)
    model = expertcache.load(d)
    for n in (1, 7, 64):
        ids = ids_of(n)
        ours = model.logits(ids)
        assert ours.shape == (n, VOCAB)
        torch.testing.assert_close(ours, reference_logits(ref, ids), atol=1e-5, rtol=0)


@pytest.mark.parametrize("arch,opts", CASES[::2], ids=[f"{a}-{'-'.join(o) or 'base'}" for a, o in CASES[::2]])
def test_stepwise_decode_matches_full_forward(tiny_checkpoint, arch, opts):
    ref, d = tiny_checkpoint(arch, **opts)
    model = expertcache.load(d)
    ids = ids_of(40).tolist()
    full = model.logits(ids)
    session = model.new_session()
    steps = [model.prefill(session, ids[:9], all_logits=True)]
    for t in ids[9:]:
        steps.append(model.prefill(session, [t], all_logits=True))
    torch.testing.assert_close(torch.cat(steps), full, atol=1e-5, rtol=0)
    torch.testing.assert_close(full, reference_logits(ref, torch.tensor(ids)), atol=1e-5, rtol=0)


def check_greedy_against_reference(ref, model, prompt: list[int], n: int = 32) -> int:
    """Our greedy tokens must be the reference's argmax wherever its top-2 margin is clear.
    Returns how many tokens were compared."""
    res = model.generate(prompt, max_tokens=n, ignore_eos=True)
    assert len(res.token_ids) == n
    seq = torch.tensor(prompt + res.token_ids)
    logits = reference_logits(ref, seq)[len(prompt) - 1: -1]  # predictions for each generated token
    compared = 0
    for step, (row, tok) in enumerate(zip(logits, res.token_ids)):
        top2 = torch.topk(row, 2).values
        if top2[0] - top2[1] <= 1e-4:
            break  # a near-tie: after it the sequences may legitimately differ
        assert tok == int(row.argmax()), f"step {step}: ours {tok}, reference {int(row.argmax())}"
        compared += 1
    return compared


@pytest.mark.parametrize("arch,opts", CASES, ids=[f"{a}-{'-'.join(o) or 'base'}" for a, o in CASES])
def test_greedy_generation_matches_reference(tiny_checkpoint, arch, opts):
    ref, d = tiny_checkpoint(arch, **opts)
    model = expertcache.load(d)
    compared = check_greedy_against_reference(ref, model, ids_of(12, seed=5).tolist())
    assert compared >= 16, "too many near-ties to make the comparison meaningful"


@pytest.mark.parametrize("rope", [
    {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128, "rope_theta": 10000.0},
    {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 256, "rope_theta": 5e5,
     "beta_fast": 16, "beta_slow": 2},
], ids=["linear", "yarn", "yarn-betas"])
def test_rope_scalings_match_reference(tiny_checkpoint, rope):
    ref, d = tiny_checkpoint("qwen3_moe", rope=rope)
    model = expertcache.load(d)
    ids = ids_of(64)
    torch.testing.assert_close(model.logits(ids), reference_logits(ref, ids), atol=1e-5, rtol=0)


def test_transformers_4x_config_names(tiny_checkpoint):
    """rope_theta/rope_scaling and torch_dtype, as transformers 4.x writes them."""
    ref, d = tiny_checkpoint("qwen3_moe", rope={"rope_type": "linear", "factor": 2.0, "rope_theta": 20000.0})
    raw = json.loads((d / "config.json").read_text())
    raw.pop("rope_parameters")
    raw["rope_theta"] = 20000.0
    raw["rope_scaling"] = {"type": "linear", "factor": 2.0}
    raw["torch_dtype"] = raw.pop("dtype")
    raw["num_experts"] = raw.pop("num_local_experts")
    (d / "config.json").write_text(json.dumps(raw))
    ids = ids_of(32)
    torch.testing.assert_close(expertcache.load(d).logits(ids), reference_logits(ref, ids), atol=1e-5, rtol=0)


def test_sharded_checkpoint(tiny_checkpoint):
    ref, d = tiny_checkpoint("mixtral", shard="60KB")
    assert (d / "model.safetensors.index.json").exists()
    assert len(list(d.glob("*.safetensors"))) > 1
    ids = ids_of(16)
    torch.testing.assert_close(expertcache.load(d).logits(ids), reference_logits(ref, ids), atol=1e-5, rtol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_half_precision_checkpoints(tiny_checkpoint, dtype):
    # Every expert chosen for every token: in half precision a near-tie in the router would
    # otherwise route a token differently here and in the reference, which says nothing about
    # precision. The weights still differ per token.
    ref, d = tiny_checkpoint("qwen3_moe", dtype=dtype, experts=4, top_k=4)
    ids = ids_of(16)
    # Default compute dtype is the checkpoint's.
    model = expertcache.load(d)
    assert model.net.dtype == dtype and model.net.weights.embed.dtype == dtype
    ours = model.logits(ids)
    assert ours.dtype == dtype
    with torch.no_grad():
        ref_half = ref(ids[None]).logits[0]
    assert ref_half.dtype == dtype
    import transformers

    # A fresh fp32 reference from the saved files (casting `ref` would also round its rope buffers).
    ref32 = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    exact = reference_logits(ref32, ids)
    # Same weights, same dtype, different kernels: our half-precision error against the fp32 result
    # is of the size of the reference's own.
    ours_err = (ours.float() - exact).abs().mean()
    ref_err = (ref_half.float() - exact).abs().mean()
    assert ours_err <= 1.5 * ref_err + 1e-3, (ours_err, ref_err)
    # --dtype float32 upcasts the half weights: equal to the upcast reference.
    ours32 = expertcache.load(d, dtype="float32").logits(ids)
    torch.testing.assert_close(ours32, exact, atol=1e-5, rtol=0)
