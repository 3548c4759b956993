"""Config edges of Qwen3.5-MoE, Gemma 4 and Qwen2-MoE against their references: transformers for
Hugging Face checkpoints (a key a config.json leaves out takes the class default; a zero-width
shared expert adds nothing; a soft-cap of 0 divides by zero and is refused), llama.cpp for GGUF
files (a missing Gemma 4 soft-cap is its default 30, a Qwen2-MoE shared width of 0 is the
feed-forward length)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers as tf
from gguf import GGUFValueType as VT

import expertcache
from conftest import VOCAB, assert_one_line_error, build_reference, run_cli, save_checkpoint, tiny_config
from expertcache.errors import ExpertCacheError
from gguf_blocks import rewrite_gguf
from test_gemma4 import build as build_gemma4
from test_qwen35 import VISION, text_config as qwen35_text_config

FIXTURES = Path(__file__).parent / "fixtures" / "gguf"


def ids_of(n: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(4, VOCAB, (n,), generator=torch.Generator().manual_seed(seed))


def logits_of(ref, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return ref(input_ids=ids[None], use_cache=False).logits[0].float()


def edit_config(d: Path, edit) -> Path:
    raw = json.loads((d / "config.json").read_text())
    edit(raw.get("text_config", raw))
    (d / "config.json").write_text(json.dumps(raw))
    return d


def drop(*keys):
    def edit(c):
        for k in keys:
            c.pop(k)
    return edit


def widen(model):
    """Weights wide enough that every term shows in the logits (init leaves most of them tiny)."""
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.linspace(-4.0, 2.5, p.numel()))
            elif name.endswith(("conv1d.weight", "dt_bias")):
                p.normal_(0.0, 0.5)
            elif name.endswith("linear_attn.norm.weight"):
                p.normal_(1.0, 0.1)
            elif "norm" in name:
                p.normal_(0.0, 0.1)
            elif p.ndim >= 2:
                # ~unit outputs whatever a matrix's width (the defaults below make some 512 wide)
                p.normal_(0.0, 0.7 * max(p.shape[1], 1) ** -0.5)
            else:
                p.normal_(0.0, 0.05)
    return model.float().eval()


@pytest.mark.parametrize("wrapped", [False, True], ids=["text", "multimodal"])
def test_qwen35_config_without_head_dim_takes_transformers_defaults(tmp_path, wrapped):
    # transformers' Qwen3_5MoeTextConfig defaults head_dim to 256, the shared expert's width to
    # 512 and the context to 32768; hidden_size // heads (16 here), 0 and 4096 were taken here, so
    # such a checkpoint was refused ("q_proj has shape [2048, 64], expected [128, 64]").
    tf.utils.logging.disable_progress_bar()
    tc = qwen35_text_config()
    tc.update(head_dim=256, shared_expert_intermediate_size=512, max_position_embeddings=32768)
    if wrapped:
        model = tf.Qwen3_5MoeForConditionalGeneration(tf.Qwen3_5MoeConfig(text_config=tc, vision_config=VISION))
    else:
        model = tf.Qwen3_5MoeForCausalLM(tf.Qwen3_5MoeTextConfig(**tc))
    d = edit_config(save_checkpoint(widen(model), tmp_path / "m"),
                    drop("head_dim", "shared_expert_intermediate_size", "max_position_embeddings"))
    ref = tf.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    text = ref.config.get_text_config()
    assert (text.head_dim, text.shared_expert_intermediate_size, text.max_position_embeddings) == (256, 512, 32768)
    m = expertcache.load(d)
    assert (m.cfg.head_dim, m.cfg.attention.head_dim, m.cfg.shared_expert_intermediate_size, m.cfg.max_position) == (
        256, 256, 512, 32768)
    ids = ids_of(40)
    want = logits_of(ref, ids)
    assert want.abs().max() > 1.0
    torch.testing.assert_close(m.logits(ids), want, atol=1e-4, rtol=0)


def test_qwen2_moe_config_without_widths_takes_transformers_defaults(tmp_path):
    # Qwen2MoeConfig defaults both the dense MLP's and the shared expert's width to 5632; 0 was
    # taken here (the checkpoint refused: "unexpected tensor ... shared_expert.down_proj").
    config = tiny_config("qwen2_moe", layers=2, dense=True)  # layer 0 dense, layer 1 MoE
    config.intermediate_size = config.shared_expert_intermediate_size = 5632
    ref = build_reference(config)
    with torch.no_grad():  # the 5632-wide down projections, scaled back to ~unit outputs
        for name, p in ref.named_parameters():
            if name.endswith("down_proj.weight") and p.shape[1] == 5632:
                p.mul_(0.1)
    d = edit_config(save_checkpoint(ref, tmp_path / "m"), drop("intermediate_size", "shared_expert_intermediate_size"))
    ref = tf.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    assert (ref.config.intermediate_size, ref.config.shared_expert_intermediate_size) == (5632, 5632)
    m = expertcache.load(d)
    assert (m.cfg.intermediate_size, m.cfg.shared_expert_intermediate_size) == (5632, 5632)
    ids = ids_of(40)
    want = logits_of(ref, ids)
    assert want.abs().max() > 1.0
    torch.testing.assert_close(m.logits(ids), want, atol=1e-4, rtol=0)


def test_qwen2_moe_window_without_a_size_is_transformers_default(tmp_path):
    # `use_sliding_window` without `sliding_window`: Qwen2MoeConfig's window is 4096; no window
    # was applied here, so past 4096 tokens the sliding layer (layer 0) saw the whole context.
    config = tiny_config("qwen2_moe", layers=2, use_sliding_window=True, sliding_window=4096)
    config.max_position_embeddings = 8192
    ref = build_reference(config)
    d = edit_config(save_checkpoint(ref, tmp_path / "m"), drop("sliding_window"))
    ref = tf.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    assert (ref.config.sliding_window, ref.config.layer_types[0]) == (4096, "sliding_attention")
    m = expertcache.load(d)
    assert (m.cfg.sliding_window, m.cfg.sliding_layers) == (4096, (True, False))
    ids = ids_of(4096 + 200)
    want = logits_of(ref, ids)[-200:]
    torch.testing.assert_close(m.logits(ids)[-200:], want, atol=1e-4, rtol=0)


def _zero_width_qwen2():
    config = tiny_config("qwen2_moe")
    config.shared_expert_intermediate_size = 0
    return build_reference(config)


def _zero_width_qwen35():
    tc = qwen35_text_config()
    tc["shared_expert_intermediate_size"] = 0
    return widen(tf.Qwen3_5MoeForCausalLM(tf.Qwen3_5MoeTextConfig(**tc)))


@pytest.mark.parametrize("make", [_zero_width_qwen2, _zero_width_qwen35], ids=["qwen2_moe", "qwen3_5_moe"])
def test_a_zero_width_shared_expert_adds_nothing_as_in_transformers(tmp_path, make):
    # transformers builds the shared expert 0 wide, and its gate, and saves their (empty)
    # tensors; the expert's output is 0, so the logits are the routed experts' alone. Those
    # tensors were refused here as unexpected.
    ref = make()
    d = save_checkpoint(ref, tmp_path / "m")
    m = expertcache.load(d)
    assert m.cfg.shared_expert_intermediate_size == 0
    ids = ids_of(40)
    want = logits_of(ref, ids)
    assert want.abs().max() > 1.0
    torch.testing.assert_close(m.logits(ids), want, atol=1e-4, rtol=0)
    # a copy packed by `expertcache pack` keeps them, and computes the same
    from expertcache.models.pack import pack
    packed = pack(d, tmp_path / "packed", progress=False)
    assert torch.equal(expertcache.load(packed).logits(ids), m.logits(ids))


def test_gemma4_soft_cap_of_zero_is_refused_and_null_is_no_cap(tmp_path, capsys):
    # transformers soft-caps whenever the value is not null: by 0 every logit is divided by zero
    # (all 0, NaN where a logit is 0). It was read here as "no cap": another model, without a word.
    with torch.no_grad():
        zeroed = logits_of(build_gemma4(final_logit_softcapping=0.0), ids_of(20))
    assert torch.all((zeroed == 0) | zeroed.isnan())
    ref = build_gemma4()
    for i, cap in enumerate((0, 0.0, -0.0)):
        d = edit_config(save_checkpoint(ref, tmp_path / f"m{i}", fused=True),
                        lambda c: c.update(final_logit_softcapping=cap))
        code, err = run_cli(capsys, "info", "-m", str(d))
        assert_one_line_error(code, err, "config.json", f"final_logit_softcapping {cap!r}", "null")
        with pytest.raises(ExpertCacheError, match="final_logit_softcapping"):
            expertcache.load(d)
    # null is transformers' way to turn it off
    ref = build_gemma4(final_logit_softcapping=None)
    d = save_checkpoint(ref, tmp_path / "null", fused=True)
    assert json.loads((d / "config.json").read_text())["final_logit_softcapping"] is None
    m = expertcache.load(d)
    assert m.cfg.final_logit_softcapping is None
    ids = ids_of(40)
    want = logits_of(ref, ids)
    assert want.abs().max() > 1.0
    torch.testing.assert_close(m.logits(ids), want, atol=1e-4, rtol=0)


GEMMA4 = FIXTURES / "gemma4" / "gemma4-F32.gguf"


def test_gguf_gemma4_soft_cap_is_read_as_llama_cpp_reads_it(tmp_path):
    # llama.cpp's gemma4 loader reads final_logit_softcapping as optional over its default of 30,
    # and caps only where the value is nonzero. A file without the key was run uncapped here.
    assert expertcache.load(GEMMA4).cfg.final_logit_softcapping == 30.0  # the fixture's own value
    ids = list(range(4, 40))
    capped = expertcache.load(GEMMA4, dtype="float32").logits(ids)
    absent = rewrite_gguf(GEMMA4, tmp_path / "absent.gguf", {"gemma4.final_logit_softcapping": None})
    m = expertcache.load(absent, dtype="float32")
    assert m.cfg.final_logit_softcapping == 30.0
    assert torch.equal(m.logits(ids), capped)
    zero = rewrite_gguf(GEMMA4, tmp_path / "zero.gguf", {"gemma4.final_logit_softcapping": (0.0, VT.FLOAT32, None)})
    m = expertcache.load(zero, dtype="float32")
    assert m.cfg.final_logit_softcapping is None
    uncapped = m.logits(ids)
    assert uncapped.abs().max() > 1.0
    torch.testing.assert_close(torch.tanh(uncapped / 30.0) * 30.0, capped, atol=1e-4, rtol=0)


QWEN2 = FIXTURES / "qwen2_moe-Q4_K_M.gguf"


def test_gguf_qwen2_moe_shared_width_of_zero_is_the_feed_forward_length(tmp_path):
    # llama.cpp: n_ff_shexp = expert_shared_feed_forward_length or, where that is 0 (or absent),
    # feed_forward_length (128 here, the width of the file's shexp tensors). A 0 was read as "no
    # shared expert" here, and the file refused for its shexp tensors.
    zero = {"qwen2moe.expert_shared_feed_forward_length": (0, VT.UINT32, None)}
    path = rewrite_gguf(QWEN2, tmp_path / "m.gguf", zero)
    m = expertcache.load(path, dtype="float32")
    assert m.cfg.shared_expert_intermediate_size == 128
    ids = list(range(4, 24))
    assert torch.equal(m.logits(ids), expertcache.load(QWEN2, dtype="float32").logits(ids))
