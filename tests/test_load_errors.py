"""Malformed checkpoints fail when opened, with one line naming the file, the value at fault and
what was expected: safetensors headers and indexes that lie, config values of the wrong kind,
GGUF metadata of the wrong kind, storage types and tensors this engine would not run. Each bad
file is a small edit of a good one (`expertcache synth`'s tiny model, the qwen3_moe GGUF fixture)."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q, GGUFReader, GGUFValueType as VT
from gguf.constants import GGML_QUANT_SIZES

import expertcache
from conftest import assert_one_line_error, run_cli
from gguf_blocks import rewrite_gguf
from expertcache.errors import ExpertCacheError

GGUF_FIXTURE = Path(__file__).parent / "fixtures" / "gguf" / "qwen3_moe-mix.gguf"
NORM = "model.layers.0.input_layernorm.weight"
POST_NORM = "model.layers.0.post_attention_layernorm.weight"


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    from expertcache.models.synth import synth

    return synth(tmp_path_factory.mktemp("synth") / "tiny", "tiny", layers=2, progress=False)


@pytest.fixture
def model(tiny_dir, tmp_path) -> Path:
    """A copy of the tiny checkpoint to break."""
    return Path(shutil.copytree(tiny_dir, tmp_path / "m"))


def _header(path: Path) -> tuple[dict, bytes]:
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8: 8 + n]), data[8 + n:]


def _write_header(path: Path, header: dict, body: bytes) -> None:
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + body)


def _edit_header(model: Path, edit) -> Path:
    path = model / "model.safetensors"
    header, body = _header(path)
    body = edit(header, body)
    _write_header(path, header, body)
    return path


def _info_fails(capsys, model: Path, *needles: str) -> str:
    """`info` on `model` is a one-line error holding `needles`, and `load` raises the same line."""
    code, err = run_cli(capsys, "info", "-m", str(model))
    assert_one_line_error(code, err, *needles)
    with pytest.raises(ExpertCacheError) as e:
        expertcache.load(model)
    assert "\n" not in str(e.value) and all(n in str(e.value) for n in needles), str(e.value)
    return str(e.value)


def _overlap(header: dict, body: bytes) -> bytes:
    header[POST_NORM]["data_offsets"] = header[NORM]["data_offsets"]
    return body


def _hole(header: dict, body: bytes) -> bytes:
    begin, end = header[NORM]["data_offsets"]  # moved to the end: its old bytes are a hole
    header[NORM]["data_offsets"] = [len(body), len(body) + end - begin]
    return body + body[begin:end]


@pytest.mark.parametrize("edit,needle", [(_overlap, "must not overlap or leave gaps"),
                                         (_hole, "must not overlap or leave gaps"),
                                         (lambda h, b: b + b"\0" * 8, "8 bytes after the last tensor's data")])
def test_safetensors_ranges_that_overlap_leave_holes_or_stop_short_are_refused_when_opened(
        model, capsys, edit, needle):
    # `info` passed these and only `run` failed, on the safetensors library's own message.
    _edit_header(model, edit)
    _info_fails(capsys, model, "model.safetensors", needle)


def test_safetensors_metadata_of_other_than_strings_is_refused_when_opened(model, capsys):
    def edit(header, body):
        header["__metadata__"] = {"format": 5}
        return body

    _edit_header(model, edit)
    _info_fails(capsys, model, "model.safetensors", "__metadata__", "expected a JSON object of strings")


@pytest.mark.parametrize("code", ["F8_E4M3", "bf16", "F99"])
def test_an_unknown_safetensors_dtype_is_named_with_the_known_ones(model, capsys, code):
    def edit(header, body):
        header[NORM]["dtype"] = code
        return body

    _edit_header(model, edit)
    _info_fails(capsys, model, NORM, f"dtype {code!r}", "expected one of F32, F16, BF16")


@pytest.mark.parametrize("weight_map,needle", [(["model.safetensors"], "'weight_map' is a list"),
                                               ({NORM: 5}, "'weight_map' names 5 for tensor")])
def test_a_weight_map_of_other_than_file_names_is_one_line(model, capsys, weight_map, needle):
    # Was a raw AttributeError / TypeError from sorting the file names.
    (model / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    _info_fails(capsys, model, "model.safetensors.index.json", needle)


@pytest.mark.parametrize("name", [NORM, "model.layers.0.self_attn.q_proj.weight"])
def test_integer_weights_are_refused(model, capsys, name):
    # An I16 tensor of the right size loaded and ran, its integers taken as weights.
    def edit(header, body):
        header[name]["dtype"] = "I16"
        return body

    _edit_header(model, edit)
    _info_fails(capsys, model, name, "dtype I16", "expected a float dtype")


@pytest.mark.parametrize("expert", ["model.layers.0.mlp.experts.3.", "model.layers.1.mlp.experts.0."])
def test_expert_tensors_in_another_dtype_are_refused(model, capsys, expert):
    # The slots are sized from the first expert's dtype and an expert's bytes copied as they are:
    # an F32 expert among BF16 ones was read as BF16 numbers, half of it dropped.
    from safetensors.torch import load_file, save_file

    tensors = load_file(model / "model.safetensors")
    tensors = {k: v.float() if k.startswith(expert) else v for k, v in tensors.items()}
    save_file(tensors, model / "model.safetensors")
    _info_fails(capsys, model, expert + "gate_proj.weight", "dtype F32", "expected BF16",
                "every expert tensor in one dtype")


@pytest.mark.parametrize("key,value,needle", [
    ("mlp_only_layers", 5, "mlp_only_layers 5: expected a list of layer indices"),
    ("mlp_only_layers", "0", "mlp_only_layers '0': expected a list of layer indices"),
    ("decoder_sparse_step", "1", "decoder_sparse_step '1' must be an integer >= 1"),
    ("decoder_sparse_step", 0, "decoder_sparse_step 0 must be an integer >= 1"),
])
def test_dense_layer_keys_of_the_wrong_kind_are_named(model, capsys, key, value, needle):
    # Were "'int' object is not iterable", "0 layer kinds for 2 layers", or a string read as a set
    # of characters and a step of 0 as 1.
    raw = json.loads((model / "config.json").read_text())
    raw[key] = value
    (model / "config.json").write_text(json.dumps(raw))
    _info_fails(capsys, model, "config.json", needle)


def test_a_missing_model_path_is_called_a_path(tmp_path, capsys):
    # -m takes a directory or a GGUF file: "model directory 'nope.gguf' does not exist" misled.
    code, err = run_cli(capsys, "run", "-m", str(tmp_path / "nope.gguf"), "-p", "w1")
    assert_one_line_error(code, err, f"model path {str(tmp_path / 'nope.gguf')!r} does not exist",
                          "a .gguf file")
    assert "model directory '" not in err


def test_a_config_that_cannot_be_read_is_not_called_invalid_json(model, capsys, monkeypatch):
    # Was "config.json: not valid JSON: [Errno 13] Permission denied" (chmod does not stop root).
    real = Path.read_bytes

    def read_bytes(self):
        if self.name == "config.json":
            raise PermissionError(13, "Permission denied", str(self))
        return real(self)

    monkeypatch.setattr(Path, "read_bytes", read_bytes)
    _info_fails(capsys, model, "config.json: cannot read: Permission denied")
    assert "JSON" not in run_cli(capsys, "info", "-m", str(model))[1]


@pytest.mark.parametrize("edit,needle", [
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 0}},
     "rope_scaling.original_max_position_embeddings 0: expected an integer >= 1"),
    ({"rope_theta": 0}, "rope_theta 0: expected a positive number"),
    ({"rope_theta": -1e6}, "rope_theta -1000000.0: expected a positive number"),
    ({"rope_theta": "big"}, "rope_theta 'big': expected a positive number"),
    ({"rope_scaling": {"type": "linear", "factor": 0}}, "rope_scaling.factor 0: expected a positive number"),
    ({"rope_scaling": {"type": "linear", "factor": "two"}}, "rope_scaling.factor 'two': expected a positive number"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": -2.0}},
     "rope_parameters.factor -2.0: expected a positive number"),
    ({"rope_parameters": [1]}, "rope_parameters [1]: expected a JSON object"),
    ({"rope_scaling": "yarn"}, "rope_scaling 'yarn': expected a JSON object"),
])
def test_rope_values_of_the_wrong_kind_are_named_when_opened(model, capsys, edit, needle):
    # original_max_position_embeddings 0 passed `info`, then `run` raised "math domain error";
    # a zero or negative theta or factor was taken; the others named no key.
    raw = json.loads((model / "config.json").read_text())
    raw.update(edit)
    (model / "config.json").write_text(json.dumps(raw))
    _info_fails(capsys, model, "config.json", needle)


def test_a_rope_config_built_directly_is_checked_too():
    from expertcache.config import RopeConfig

    for bad in ({"theta": 0.0}, {"factor": -1.0}, {"type": "yarn", "original_max_position": 0}):
        with pytest.raises(ExpertCacheError):
            RopeConfig(**bad)
    assert RopeConfig(type="yarn", factor=4.0, original_max_position=1024).inv_freq(16)[0].shape == (8,)


# --- GGUF -------------------------------------------------------------------------------------

_KEEP = object()


def _rewrite(dst: Path, kv: dict | None = None, tensors: dict | None = None) -> Path:
    return rewrite_gguf(GGUF_FIXTURE, dst, kv, tensors)


def _random_blocks(name: str, qtype: Q) -> tuple[np.ndarray, Q]:
    """Random bytes of fixture tensor `name`'s shape stored as `qtype`."""
    ne = [int(d) for d in next(t for t in GGUFReader(GGUF_FIXTURE).tensors if t.name == name).shape]
    block, size = GGML_QUANT_SIZES[qtype]
    return np.random.default_rng(0).integers(0, 256, (*reversed(ne[1:]), ne[0] // block * size), np.uint8), qtype


_gguf_fails = _info_fails


def _s(v):
    return v, VT.STRING, None


def _u32(v):
    return v, VT.UINT32, None


@pytest.mark.parametrize("kv,needle", [
    ({"qwen3moe.block_count": _s("2")}, "qwen3moe.block_count '2' must be an integer >= 1"),
    ({"qwen3moe.attention.head_count": _u32(0), "qwen3moe.attention.key_length": None},
     "qwen3moe.attention.head_count 0 must be an integer >= 1"),
    ({"qwen3moe.rope.freq_base": _s("big")}, "qwen3moe.rope.freq_base 'big' must be a number"),
    ({"qwen3moe.rope.freq_base": (0.0, VT.FLOAT32, None)}, "qwen3moe.rope.freq_base 0.0 must be a positive number"),
    ({"qwen3moe.attention.layer_norm_rms_epsilon": _s("x")},
     "qwen3moe.attention.layer_norm_rms_epsilon 'x' must be a number"),
    ({"qwen3moe.expert_weights_norm": _s("no")}, "qwen3moe.expert_weights_norm 'no': expected a bool"),
    ({"qwen3moe.nextn_predict_layers": _u32(2)},
     "qwen3moe.nextn_predict_layers 2: expected an integer from 0 to qwen3moe.block_count - 1 (1)"),
])
def test_gguf_metadata_of_the_wrong_kind_is_one_line_naming_the_key(tmp_path, capsys, kv, needle):
    # Were a raw TypeError (range of a string), ZeroDivisionError or ValueError (float of a
    # string), or a silent default (a string taken as true, a zero RoPE base).
    _gguf_fails(capsys, _rewrite(tmp_path / "m.gguf", kv), "m.gguf", needle)


def test_a_huge_gguf_block_count_is_refused_at_once(tmp_path, capsys):
    # 4e9 layers were counted one by one before anything was checked: `info` never returned.
    path = _rewrite(tmp_path / "m.gguf", {"qwen3moe.block_count": _u32(4_000_000_000)})
    _gguf_fails(capsys, path, "qwen3moe.block_count 4000000000 is more layers than")


@pytest.mark.parametrize("key", ["qwen3moe.context_length", "qwen3moe.expert_used_count"])
def test_a_missing_gguf_key_is_named_once(tmp_path, capsys, key):
    # The context length defaulted to 4096 (llama.cpp requires it); other keys were named with the
    # file's path twice.
    msg = _gguf_fails(capsys, _rewrite(tmp_path / "m.gguf", {key: None}), f"missing metadata key {key!r}")
    assert msg.count("m.gguf") == 1, msg


@pytest.mark.parametrize("name,qtype", [("blk.0.attn_q.weight", Q.IQ2_XXS), ("blk.0.ffn_up_exps.weight", Q.Q8_1),
                                        ("blk.0.attn_q.weight", Q.I32)])
def test_an_unsupported_storage_type_is_refused_when_opened(tmp_path, capsys, name, qtype):
    # `info` and `load` passed; `run` died in the kernels ("ggml type 16 has no native kernel"), or
    # named neither the tensor nor the file.
    path = _rewrite(tmp_path / "m.gguf", tensors={name: _random_blocks(name, qtype)})
    _gguf_fails(capsys, path, "m.gguf", name, f"storage type {qtype.name}", "expected one of F32")


@pytest.mark.parametrize("name", ["blk.0.ffn_gate_inp_shexp.weight", "blk.5.attn_norm.weight"])
def test_an_unexpected_gguf_tensor_is_refused(tmp_path, capsys, name):
    # A shared expert's gate in a qwen3moe file was ignored without a word (llama.cpp refuses it).
    path = _rewrite(tmp_path / "m.gguf", tensors={name: (np.ones(256, np.float32), Q.F32)})
    _gguf_fails(capsys, path, "m.gguf", f"unexpected tensor {name!r} for qwen3moe")


def test_a_gguf_without_its_architecture_names_the_key(tmp_path, capsys):
    data = GGUF_FIXTURE.read_bytes().replace(b"general.architecture", b"general.architecturX", 1)
    (tmp_path / "m.gguf").write_bytes(data)
    _gguf_fails(capsys, tmp_path / "m.gguf", "metadata key 'general.architecture' is missing")


def test_a_gguf_under_another_name_loads_and_other_files_are_named(tmp_path, capsys):
    shutil.copy(GGUF_FIXTURE, tmp_path / "model.bin")
    code, err = run_cli(capsys, "info", "-m", str(tmp_path / "model.bin"))
    assert code == 0, err
    (tmp_path / "noise").write_bytes(np.random.default_rng(0).integers(0, 256, 4096, np.uint8).tobytes())
    code, err = run_cli(capsys, "info", "-m", str(tmp_path / "noise"))
    assert_one_line_error(code, err, "noise", "neither a directory nor a GGUF file")
