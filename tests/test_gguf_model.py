"""GGUF models: the fixtures llama.cpp's converter and quantizer wrote (tests/fixtures/gguf) load
and run. The reference is transformers holding exactly the weights the file holds (dequantized by
gguf-py, the names mapped by hand below), so our quantized path is checked against an
implementation someone else wrote; results are bitwise identical across cache modes, sizes,
policies and stores, with experts kept as the file's blocks in the slots."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch

import expertcache
from conftest import CountingModule
from expertcache import CacheConfig, kernels
from gguf.constants import GGMLQuantizationType as Q
from gguf_recordings import SLOT_FILLS, check_slots_hold_the_files_bytes

FIXTURES = Path(__file__).parent / "fixtures" / "gguf"
MODELS = ["qwen3_moe-mix", "qwen2_moe-Q4_K_M", "olmoe-Q8_0", "mixtral-Q8_0"]
PROMPT = [5, 17, 300, 42, 9, 1200, 77, 3, 18, 2048, 6, 99, 512, 7, 31, 8]

# llama.cpp's tensor names -> transformers 5's, for the reference model.
_NAMES = [
    (r"token_embd\.weight", "model.embed_tokens.weight"), (r"output\.weight", "lm_head.weight"),
    (r"output_norm\.weight", "model.norm.weight"),
    (r"blk\.(\d+)\.attn_norm\.weight", r"model.layers.\1.input_layernorm.weight"),
    (r"blk\.(\d+)\.ffn_norm\.weight", r"model.layers.\1.post_attention_layernorm.weight"),
    (r"blk\.(\d+)\.attn_(q|k|v)\.(weight|bias)", r"model.layers.\1.self_attn.\2_proj.\3"),
    (r"blk\.(\d+)\.attn_output\.(weight|bias)", r"model.layers.\1.self_attn.o_proj.\2"),
    (r"blk\.(\d+)\.attn_(q|k)_norm\.weight", r"model.layers.\1.self_attn.\2_norm.weight"),
    (r"blk\.(\d+)\.ffn_gate_inp\.weight", r"model.layers.\1.mlp.gate.weight"),
    (r"blk\.(\d+)\.ffn_down_exps\.weight", r"model.layers.\1.mlp.experts.down_proj"),
    (r"blk\.(\d+)\.ffn_(gate|up|down)_shexp\.weight", r"model.layers.\1.mlp.shared_expert.\2_proj.weight"),
    (r"blk\.(\d+)\.ffn_gate_inp_shexp\.weight", r"model.layers.\1.mlp.shared_expert_gate.weight"),
]


def _record(name):
    return json.loads((FIXTURES / f"{name}.json").read_text())


def reference(name, config: dict | None = None):
    """transformers with the file's weights, exactly dequantized; `config` changes its config."""
    import gguf
    import transformers as tf

    rec = _record(name)
    cfg = tf.AutoConfig.for_model(**{**rec["hf_config"], **(config or {})})
    cfg.dtype = torch.float32
    model = tf.AutoModelForCausalLM.from_config(cfg).float().eval()
    want = model.state_dict()
    reader = gguf.GGUFReader(FIXTURES / f"{name}.gguf")
    weights, gate_up = {}, {}
    for t in reader.tensors:
        w = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).copy()).float()
        m = re.fullmatch(r"blk\.(\d+)\.ffn_(gate|up)_exps\.weight", t.name)
        if m:
            gate_up.setdefault(int(m[1]), {})[m[2]] = w
            continue
        for pat, repl in _NAMES:
            if re.fullmatch(pat, t.name):
                hf = re.sub(pat, repl, t.name)
                break
        else:
            raise AssertionError(f"no reference name for {t.name}")
        if cfg.model_type == "mixtral" and re.search(r"attn_(q|k)\.weight", t.name):
            # undo the converter's interleaving of each head's rotary halves
            heads = cfg.num_attention_heads if "attn_q" in t.name else cfg.num_key_value_heads
            w = w.reshape(heads, w.shape[0] // heads // 2, 2, -1).swapaxes(1, 2).reshape(w.shape)
        weights[hf] = w.reshape(want[hf].shape)
    for i, gu in gate_up.items():
        weights[f"model.layers.{i}.mlp.experts.gate_up_proj"] = torch.cat((gu["gate"], gu["up"]), dim=1)
    if cfg.tie_word_embeddings:
        weights.setdefault("lm_head.weight", weights["model.embed_tokens.weight"])
    missing = set(want) - set(weights)
    assert not missing, missing
    model.load_state_dict(weights, strict=True)
    return model


@pytest.mark.parametrize("name", MODELS)
def test_fp32_path_matches_transformers_on_the_same_weights(name):
    ref = reference(name)
    with torch.no_grad():
        want = ref(torch.tensor([PROMPT])).logits[0]
    model = expertcache.load(FIXTURES / f"{name}.gguf", dtype="float32")
    got = model.logits(PROMPT)
    rel = float((got - want).abs().max() / want.abs().max())
    assert rel < 1e-4, f"{name}: relative difference {rel:.2e}"
    assert model.telemetry()["expert_bytes"] < 3 * model.cfg.hidden_size * model.cfg.moe_intermediate_size * 2


@pytest.mark.parametrize("name", MODELS)
def test_quantized_logits_are_close_to_llama_cpp(name):
    # llama.cpp quantizes activations to 8 bits in its quantized products, so only a loose bound
    # holds against its logits of the quantized file; the exact comparison is the one above.
    rec = _record(name)
    want = torch.from_numpy(np.load(FIXTURES / f"{name}.npz")["logits"])
    got = expertcache.load(FIXTURES / f"{name}.gguf", dtype="float32").logits(rec["prompt"]["tokens"])
    rel = float((got - want).abs().max() / want.abs().max())
    assert rel < 0.1, f"{name}: relative difference {rel:.3f}"
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.8


CACHES = [CacheConfig(mode="staging"), CacheConfig(mode="cache", experts=1),
          CacheConfig(mode="cache", experts=3, store="disk", policy="lfu"),
          CacheConfig(mode="cache", fraction=0.5, store="mmap"), CacheConfig(mode="staging", experts=2, store="disk")]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", ["qwen3_moe-mix", "qwen2_moe-Q4_K_M"])
def test_quantized_results_never_depend_on_the_cache(name, dtype):
    path = FIXTURES / f"{name}.gguf"
    resident = expertcache.load(path, dtype=dtype)
    want = resident.logits(PROMPT)
    s = resident.new_session()
    steps = [resident.prefill(s, PROMPT)] + [resident.prefill(s, [t]) for t in (4, 8, 15)]
    for cache in CACHES:
        model = expertcache.load(path, dtype=dtype, cache=cache)
        assert torch.equal(model.logits(PROMPT), want), cache
        s = model.new_session()
        got = [model.prefill(s, PROMPT)] + [model.prefill(s, [t]) for t in (4, 8, 15)]
        assert all(torch.equal(a, b) for a, b in zip(got, steps)), cache
        t = model.telemetry()
        # slots hold the file's quantized bytes: the copies are counted in those bytes
        assert t["total"]["copied_bytes"] == sum(c["copied_experts"] * model.experts.expert_bytes[int(l)]
                                        for l, c in t["layers"].items())


@pytest.mark.parametrize("fill", SLOT_FILLS)
def test_expert_slots_hold_the_files_bytes(fill):
    matrices = check_slots_hold_the_files_bytes(FIXTURES / "qwen3_moe-mix.gguf", 0, fill)
    assert [(m.name, m.storage.name) for m in matrices] == [("gate", "Q4_K"), ("up", "Q4_K"), ("down", "Q6_K")]
    if fill != "disk" and kernels.select("auto", torch.device("cpu"), torch.bfloat16, True).holds_tiles(
            Q.Q4_K, matrices[0].shape):  # this machine's kernels hold Q4_K as tiles: the check sees them
        assert [m.tiled for m in matrices] == [True, True, False]


@pytest.mark.parametrize("name", MODELS)
def test_the_tokenizer_comes_from_the_file_and_equals_llama_cpps(name):
    rec = _record(name)
    model = expertcache.load(FIXTURES / f"{name}.gguf")
    assert model.tokenizer.encode(rec["prompt"]["text"]) == rec["prompt"]["tokens"]
    text = (Path(__file__).parents[1] / rec["heldout"]["file"]).read_text()[slice(*rec["heldout"]["chars"])]
    assert model.tokenizer.encode(text) == rec["heldout"]["tokens"]


def test_a_tokenizer_directory_replaces_the_files(tmp_path, capsys):
    from conftest import run_cli, write_tokenizer

    write_tokenizer(tmp_path)
    model = expertcache.load(FIXTURES / "olmoe-Q8_0.gguf", tokenizer=tmp_path)
    assert model.tokenizer.encode("w5 w6") != expertcache.load(FIXTURES / "olmoe-Q8_0.gguf").tokenizer.encode("w5 w6")
    code, err = run_cli(capsys, "run", "-m", str(FIXTURES / "olmoe-Q8_0.gguf"), "--tokenizer", str(tmp_path),
                        "-p", "w5 w6", "-n", "2")
    assert code == 0, err


def _decode(model, steps=6):
    s = model.new_session()
    logits, out = model.prefill(s, PROMPT), []
    for _ in range(steps):
        logits = model.prefill(s, [int(logits.argmax())])
        out.append(logits)
    return torch.stack(out)


def test_native_decode_multiplies_the_blocks_and_never_depends_on_the_cache(monkeypatch):
    path = FIXTURES / "qwen3_moe-mix.gguf"
    model = expertcache.load(path, kernels="native")
    counting = CountingModule(model.kernels.quant, "experts")
    monkeypatch.setattr(model.kernels, "_quant", counting)
    want = _decode(model)
    assert counting.calls["experts"] == 6 * len(model.cfg.moe_layers)  # one call per layer and step
    for cache in CACHES:
        assert torch.equal(_decode(expertcache.load(path, kernels="native", cache=cache)), want), cache
    torch_path = _decode(expertcache.load(path, kernels="torch"))
    assert float((torch_path.float() - want.float()).abs().max() / torch_path.float().abs().max()) < 0.05


def test_native_prefill_dequantizes_to_the_same_bits_as_torch():
    path = FIXTURES / "qwen3_moe-mix.gguf"
    # Many-row products with exact activations dequantize each expert (with 8-bit ones they take
    # the integer kernels): the native decoder and torch's agree bitwise.
    torch_model = expertcache.load(path, kernels="torch", activations="exact")
    native_model = expertcache.load(path, kernels="native", activations="exact")
    layer_views = native_model.experts.views[0]
    for slot in range(native_model.experts.capacity)[:4]:
        for part in ("gate", "up", "down"):
            w = getattr(layer_views[slot], part)
            assert torch.equal(native_model.kernels.dense(w, torch.bfloat16), torch_model.kernels.dense(w, torch.bfloat16))


# Float matrices among an expert's blocks, as llama.cpp's quantizer leaves a matrix whose rows are
# not whole blocks of the requested type: (MoE layer, its matrices stored as floats, their type).
FLOAT_AMONG_BLOCKS = [(0, ("up",), Q.F32), (1, ("down",), Q.F16), (0, ("gate", "up"), Q.BF16)]


def float_among_blocks(tmp_path: Path, layer: int, parts: tuple[str, ...], qtype: Q) -> Path:
    """qwen3_moe-mix with matrices `parts` of layer `layer` stored as `qtype`, holding the values of
    the file's blocks (rounded to `qtype`), its recordings beside it."""
    import shutil

    import gguf
    from gguf_blocks import rewrite_gguf

    src = FIXTURES / "qwen3_moe-mix.gguf"
    names = {f"blk.{layer}.ffn_{p}_exps.weight" for p in parts}
    tensors = {}
    for t in gguf.GGUFReader(src).tensors:
        if t.name in names:
            v = np.ascontiguousarray(gguf.quants.dequantize(t.data, t.tensor_type))
            tensors[t.name] = (v.astype(np.float16) if qtype == Q.F16 else gguf.quants.quantize(v, qtype), qtype)
    name = f"mix-{layer}-{'_'.join(parts)}-{qtype.name}"
    shutil.copy(FIXTURES / "qwen3_moe-mix.json", tmp_path / f"{name}.json")
    return rewrite_gguf(src, tmp_path / f"{name}.gguf", tensors=tensors)


@pytest.mark.parametrize("layer,parts,qtype", FLOAT_AMONG_BLOCKS,
                         ids=[f"{layer}-{'_'.join(parts)}-{q.name}" for layer, parts, q in FLOAT_AMONG_BLOCKS])
def test_float_matrices_among_an_experts_blocks(tmp_path, monkeypatch, layer, parts, qtype):
    from expertcache.checkpoint.storage import is_quantized
    from gguf_recordings import check_cache_independence

    path = float_among_blocks(tmp_path, layer, parts, qtype)
    model = expertcache.load(path, kernels="native")
    assert [m.name for m in model.experts.formats[layer].matrices if not is_quantized(m.storage)] == list(parts)
    # The native decode takes such a layer's wave in its one call too, the float matrices as ggml rows.
    counting = CountingModule(model.kernels.quant, "experts")
    monkeypatch.setattr(model.kernels, "_quant", counting)
    want = _decode(model)
    assert counting.calls["experts"] == 6 * len(model.cfg.moe_layers)
    # The same weights on torch's kernels: as close as the all-quantized file's two paths are.
    torch_model = expertcache.load(path, kernels="torch")
    for got, ref in ((want, _decode(torch_model)), (model.logits(PROMPT), torch_model.logits(PROMPT))):
        assert float((got.float() - ref.float()).abs().max() / ref.float().abs().max()) < 0.05
    # Prefill in micro-batches (experts of up to and over eight rows) and decode: bitwise the same
    # whatever the cache.
    check_cache_independence(tmp_path, path.stem, "bfloat16", tokens=40, prefill=32, ubatch=16)
    if qtype == Q.F32:  # the blocks' values exactly: the file's model, on the exact path bit for bit
        assert torch.equal(expertcache.load(path, dtype="float32").logits(PROMPT),
                           expertcache.load(FIXTURES / "qwen3_moe-mix.gguf", dtype="float32").logits(PROMPT))


def test_a_run_of_experts_is_one_read_per_tensor():
    path = FIXTURES / "qwen3_moe-mix.gguf"
    model = expertcache.load(path, cache=CacheConfig(mode="cache", experts=8, store="disk"))
    store = model.experts.store
    before = store.reads
    list(model.experts.acquire(0, [2, 3, 4, 5]))  # four missing experts, consecutive: one run
    assert store.reads - before == 3  # gate, up and down tensors, each one range for the run
    t = model.telemetry()["total"]
    assert (t["copied_experts"], t["copy_ranges"]) == (4, 3)
    assert torch.equal(model.logits(PROMPT), expertcache.load(path).logits(PROMPT))


# The recordings' models are random with widely spread logits (perplexities near 400k), on which
# llama.cpp's 8-bit activations move the result more than on a trained model; the tight check is
# the bundled model's (docs/gguf.md, README). The bound still catches a wrong chunking, BOS rule
# or weight: those move these figures by far more.
@pytest.mark.parametrize("name,bound", [("qwen2_moe-Q4_K_M", 0.01), ("olmoe-Q8_0", 0.01), ("mixtral-Q8_0", 0.01),
                                        ("qwen3_moe-mix", 0.05)])
def test_perplexity_agrees_with_llama_cpps_recording(name, bound):
    from expertcache.perplexity import perplexity

    rec = _record(name)
    model = expertcache.load(FIXTURES / f"{name}.gguf", dtype="bfloat16")
    got = perplexity(model, rec["heldout"]["tokens"], n_ctx=rec["perplexity"]["n_ctx"])
    # chunked and scored as llama-perplexity does: the same chunks, the same tokens scored in each
    assert len(got.chunks) == rec["perplexity"]["chunks"]
    assert all(c.count == rec["perplexity"]["scored_per_chunk"] for c in got.chunks)
    assert abs(got.ppl / rec["perplexity"]["ppl"] - 1) < bound, (got.ppl, rec["perplexity"]["ppl"])


def test_pack_writes_each_expert_as_one_range_with_the_same_results(tmp_path, capsys):
    from conftest import assert_one_line_error, run_cli

    src = FIXTURES / "qwen3_moe-mix.gguf"
    out = tmp_path / "packed.gguf"
    assert run_cli(capsys, "pack", "-m", str(src), "-o", str(out))[0] == 0
    want = expertcache.load(src).logits(PROMPT)
    packed = expertcache.load(out, cache=CacheConfig(mode="cache", experts=8, store="disk"))
    assert torch.equal(packed.logits(PROMPT), want)
    # the same formats, now one range per expert: a run of four missing experts is one read
    assert packed.experts.formats == expertcache.load(src, cache=CacheConfig(mode="cache", experts=8,
                                                                             store="disk")).experts.formats
    # every tensor on a 4 KiB page (the disk store reads whole pages of experts with O_DIRECT)
    from expertcache.checkpoint.gguf_io import GGUFCheckpoint

    assert all(info.offset % 4096 == 0 for info in GGUFCheckpoint(out).tensors.values())
    fresh = expertcache.load(out, cache=CacheConfig(mode="cache", experts=8, store="disk"))
    store, before = fresh.experts.store, fresh.experts.store.reads
    list(fresh.experts.acquire(1, [0, 1, 2, 3]))
    assert store.reads - before == 1
    assert packed.tokenizer.encode("def f(x):") == expertcache.load(src).tokenizer.encode("def f(x):")
    code, err = run_cli(capsys, "pack", "-m", str(src), "-o", str(out))
    assert_one_line_error(code, err, str(out), "already exists")
    code, err = run_cli(capsys, "pack", "-m", str(src), "-o", str(src), "--force")
    assert_one_line_error(code, err, str(src))


def test_a_gguf_directory_with_the_original_config_json_is_the_gguf_model(tmp_path):
    # GGUF repositories often carry the checkpoint's config.json; such a directory was read as a
    # Hugging Face checkpoint and refused for want of safetensors files.
    import shutil

    src = FIXTURES / "olmoe-Q8_0.gguf"
    shutil.copy(src, tmp_path / src.name)
    (tmp_path / "config.json").write_text(json.dumps(_record("olmoe-Q8_0")["hf_config"]))
    model = expertcache.load(tmp_path, dtype="float32")
    assert torch.equal(model.logits(PROMPT), expertcache.load(src, dtype="float32").logits(PROMPT))
    assert model.tokenizer.encode("def f(x):") == expertcache.load(src).tokenizer.encode("def f(x):")
