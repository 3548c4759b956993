"""The GGUF reader against files written by gguf-py's GGUFWriter (golden bytes) and against
gguf-py's own GGUFReader (offsets, shapes, types), plus every error at the boundary."""

from __future__ import annotations

import json
import random
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q, GGUFReader, GGUFWriter
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import dequantize, quantize

from expertcache.checkpoint.gguf_io import GGUFCheckpoint
from expertcache.errors import ExpertCacheError


def random_blocks(rng: np.random.Generator, qtype: Q, shape: tuple[int, ...]) -> np.ndarray:
    """Random bytes of a `qtype` tensor of `shape` (torch order) whose fp16 scales are sane."""
    block, size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (*shape[:-1], shape[-1] // block, size), dtype=np.uint8)
    scales = rng.uniform(0.001, 0.01, raw.shape[:-1] + (2,)).astype(np.float16).view(np.uint8)
    if qtype in (Q.Q4_K, Q.Q5_K, Q.Q2_K):  # d and dmin lead the block
        raw[..., :4] = scales
    elif qtype == Q.Q6_K:  # d trails the block
        raw[..., -2:] = scales[..., :2]
    return raw.reshape(*shape[:-1], shape[-1] // block * size)


def write_gguf(path, tensors: dict, kv: dict | None = None, **writer_kw):
    """Write `tensors` (name -> float array, or (uint8 bytes, qtype)) and `kv` (key -> value)."""
    w = GGUFWriter(str(path), "test", **writer_kw)
    for key, value in (kv or {}).items():
        if isinstance(value, bool):
            w.add_bool(key, value)
        elif isinstance(value, str):
            w.add_string(key, value)
        elif isinstance(value, int):
            w.add_uint32(key, value)
        elif isinstance(value, float):
            w.add_float32(key, value)
        else:
            w.add_array(key, value)
    for name, t in tensors.items():
        if isinstance(t, tuple):
            w.add_tensor(name, t[0], raw_dtype=t[1])
        else:
            w.add_tensor(name, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture
def model(tmp_path):
    rng = np.random.default_rng(0)
    floats = rng.standard_normal((4, 3, 64)).astype(np.float32)
    tensors = {
        "token_embd.weight": rng.standard_normal((10, 32)).astype(np.float32),
        "norm.weight": rng.standard_normal(32).astype(np.float16),
        "blk.0.ffn_up_exps.weight": (quantize(floats, Q.Q8_0), Q.Q8_0),
        "blk.0.ffn_down_exps.weight": (random_blocks(rng, Q.Q4_K, (4, 2, 512)), Q.Q4_K),
        "blk.0.ffn_gate_exps.weight": (random_blocks(rng, Q.Q6_K, (4, 2, 256)), Q.Q6_K),
    }
    kv = {"general.name": "tiny", "test.count": 7, "test.eps": 0.5, "test.flag": True,
          "tokenizer.ggml.tokens": ["a", "é", "<|x|>", ""], "tokenizer.ggml.scores": [0.0, -1.5, 2.0, 3.0],
          "test.ints": [1, -2, 3]}
    path = tmp_path / "m.gguf"
    write_gguf(path, tensors, kv)
    return path, tensors, kv, floats


def raw_bytes(t) -> np.ndarray:
    return (t[0] if isinstance(t, tuple) else t).view(np.uint8)


def test_infos_and_bytes_match_the_writer_and_gguf_reader(model):
    path, tensors, kv, floats = model
    ref = {t.name: t for t in GGUFReader(path).tensors}
    with GGUFCheckpoint(path) as ck:
        assert set(ck.tensors) == set(tensors) == set(ref)
        for name, t in tensors.items():
            info, r = ck.info(name), ref[name]
            assert info.file == path and name in ck
            assert info.qtype == r.tensor_type
            assert info.shape == tuple(reversed(r.shape.tolist()))
            assert (info.offset, info.nbytes) == (r.data_offset, r.n_bytes)
            want = raw_bytes(t)
            got = ck.read(name)
            assert got.dtype == torch.uint8 and got.shape == info.byte_shape == want.reshape(info.byte_shape).shape
            assert info.row_bytes * int(np.prod(info.shape[:-1])) == info.nbytes
            assert np.array_equal(got.numpy(), want.reshape(info.byte_shape))
        assert ck.info("token_embd.weight").shape == (10, 32)
        assert ck.info("token_embd.weight").torch_dtype == torch.float32
        assert ck.info("token_embd.weight").storage == torch.float32
        assert ck.info("norm.weight").storage == torch.float16
        assert ck.info("blk.0.ffn_down_exps.weight").storage == Q.Q4_K
        assert ck.info("blk.0.ffn_down_exps.weight").shape == (4, 2, 512)
        assert ck.info("blk.0.ffn_down_exps.weight").torch_dtype is None
        # The bytes are the quantized blocks: gguf-py dequantizes them back to the original floats.
        up = dequantize(ck.read("blk.0.ffn_up_exps.weight").numpy(), Q.Q8_0)
        assert np.allclose(up, floats, atol=np.abs(floats).max() / 100)


def test_custom_alignment(tmp_path):
    tensors = split_tensors()
    w = GGUFWriter(str(tmp_path / "a.gguf"), "test")
    w.add_custom_alignment(256)
    for name, t in tensors.items():
        w.add_tensor(name, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    ref = {t.name: t for t in GGUFReader(tmp_path / "a.gguf").tensors}
    with GGUFCheckpoint(tmp_path / "a.gguf") as ck:
        for name, t in tensors.items():
            assert ck.info(name).offset % 256 == 0 and ck.info(name).offset == ref[name].data_offset
            assert np.array_equal(ck.read(name).numpy(), t.view(np.uint8))
    data = bytearray((tmp_path / "a.gguf").read_bytes())
    key = b"general.alignment"
    at = data.index(key) + len(key) + 4  # after the key and its value type
    struct.pack_into("<I", data, at, 48)
    (tmp_path / "a.gguf").write_bytes(data)
    with pytest.raises(ExpertCacheError) as e:
        GGUFCheckpoint(tmp_path / "a.gguf")
    one_line(e, "a.gguf", "'general.alignment' is 48", "power of two")


def test_metadata_values(model):
    path, _, kv, _ = model
    with GGUFCheckpoint(path) as ck:
        assert ck.require("general.name") == "tiny"
        assert ck.metadata["test.count"] == 7 and ck.metadata["test.flag"] is True
        assert ck.metadata["test.eps"] == 0.5
        assert ck.metadata["tokenizer.ggml.tokens"] == ["a", "é", "<|x|>", ""]
        assert ck.metadata["tokenizer.ggml.scores"] == [0.0, -1.5, 2.0, 3.0]
        assert ck.metadata["test.ints"] == [1, -2, 3]
        assert ck.metadata["general.architecture"] == "test"
        # Every field gguf-py's reader finds, with the same value.
        ref = GGUFReader(path)
        for key, field in ref.fields.items():
            if not key.startswith("GGUF."):
                assert ck.metadata[key] == field.contents(), key


def test_expert_rows_and_segments(model):
    path, tensors, _, _ = model
    with GGUFCheckpoint(path) as ck:
        for name in ("blk.0.ffn_up_exps.weight", "blk.0.ffn_down_exps.weight", "blk.0.ffn_gate_exps.weight"):
            info = ck.info(name)
            want = raw_bytes(tensors[name]).reshape(info.byte_shape)
            each = info.nbytes // info.shape[0]
            for e in range(info.shape[0]):
                seg = ck.segment(name, e)
                assert (seg.file, seg.offset, seg.nbytes) == (path, info.offset + e * each, each)
                assert np.array_equal(ck.read_rows(name, e).numpy(), want[e])
                with open(path, "rb") as f:
                    f.seek(seg.offset)
                    assert f.read(seg.nbytes) == want[e].tobytes()
            whole = ck.segment(name)
            assert (whole.offset, whole.nbytes) == (info.offset, info.nbytes)
        with pytest.raises(ExpertCacheError, match="token_embd.weight.*expected \\[experts, rows, cols\\]"):
            ck.segment("token_embd.weight", 0)


def split_tensors():
    rng = np.random.default_rng(1)
    return {f"blk.{i}.w": rng.standard_normal((3, 32)).astype(np.float32) for i in range(5)}


def test_split_files_written_by_gguf_py(tmp_path):
    tensors = split_tensors()
    write_gguf(tmp_path / "big.gguf", tensors, {"general.name": "big"}, split_max_tensors=2)
    parts = sorted(tmp_path.glob("*.gguf"))
    assert [p.name for p in parts] == [f"big-0000{i}-of-00003.gguf" for i in (1, 2, 3)]
    for start in (parts[0], parts[2], tmp_path):
        with GGUFCheckpoint(start) as ck:
            assert ck.files == parts
            assert ck.metadata["general.name"] == "big" and ck.metadata["split.count"] == 3
            assert set(ck.tensors) == set(tensors)
            for name, t in tensors.items():
                assert np.array_equal(ck.read(name).numpy(), t.view(np.uint8))
            for p in parts:
                for r in GGUFReader(p).tensors:
                    assert ck.info(r.name).file == p and ck.info(r.name).offset == r.data_offset


def write_split_by_hand(tmp_path, names_per_part, count=None):
    count = count or len(names_per_part)
    rng = np.random.default_rng(2)
    paths = []
    for i, names in enumerate(names_per_part):
        path = tmp_path / f"hand-{i + 1:05d}-of-{count:05d}.gguf"
        w = GGUFWriter(str(path), "test")
        if i:  # gguf-split keeps the metadata in the first part only
            w.kv_data[0].clear()
        w.add_uint16("split.no", i)
        w.add_uint16("split.count", count)
        w.add_int32("split.tensors.count", sum(map(len, names_per_part)))
        for n in names:
            w.add_tensor(n, rng.standard_normal((2, 32)).astype(np.float32))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        paths.append(path)
    return paths


def test_split_files_by_hand(tmp_path):
    paths = write_split_by_hand(tmp_path, [["a", "b"], ["c"]])
    with GGUFCheckpoint(paths[1]) as ck:
        assert ck.files == paths and set(ck.tensors) == {"a", "b", "c"}
        assert ck.info("c").file == paths[1]
        assert ck.metadata["general.architecture"] == "test"


def one_line(excinfo, *needles):
    msg = str(excinfo.value)
    assert "\n" not in msg, msg
    for n in needles:
        assert n in msg, msg


def test_error_duplicate_tensor_across_parts(tmp_path):
    write_split_by_hand(tmp_path, [["a", "b"], ["b"]])
    with pytest.raises(ExpertCacheError) as e:
        GGUFCheckpoint(tmp_path)
    one_line(e, "'b'", "hand-00001-of-00002.gguf", "hand-00002-of-00002.gguf", "twice")


def test_error_missing_split_part(tmp_path):
    paths = write_split_by_hand(tmp_path, [["a"], ["b"], ["c"]])
    paths[1].unlink()
    with pytest.raises(ExpertCacheError) as e:
        GGUFCheckpoint(paths[0])
    one_line(e, "hand-00002-of-00003.gguf", "missing")


def test_error_split_metadata_disagrees_with_the_name(tmp_path):
    paths = write_split_by_hand(tmp_path, [["a"], ["b"], ["c"]])
    other = tmp_path / "other"
    other.mkdir()
    stray = write_split_by_hand(other, [["a"], ["b"]])[1]  # split.no=1, split.count=2
    stray.replace(paths[1])
    with pytest.raises(ExpertCacheError) as e:
        GGUFCheckpoint(paths[0])
    one_line(e, "hand-00002-of-00003.gguf", "split.count=2", "expected split.no=1, split.count=3")


def test_error_split_part_renamed(tmp_path):
    paths = write_split_by_hand(tmp_path, [["a"], ["b"]])
    paths[0].rename(tmp_path / "model.gguf")
    with pytest.raises(ExpertCacheError) as e:
        GGUFCheckpoint(tmp_path / "model.gguf")
    one_line(e, "model.gguf", "part 1 of a 2-part model")


@pytest.mark.parametrize("key,value", [("split.count", "2"), ("split.tensors.count", "1"), ("split.count", True)])
def test_error_split_keys_of_the_wrong_kind(tmp_path, key, value):
    # A string split.count was a raw TypeError ('>' between str and int); a string
    # split.tensors.count was reported as "is 1 but the parts hold 1 tensors".
    write_gguf(tmp_path / "m.gguf", {"a": np.zeros((2, 32), np.float32)}, {key: value})
    with pytest.raises(ExpertCacheError) as e:
        GGUFCheckpoint(tmp_path / "m.gguf")
    one_line(e, "m.gguf", f"metadata key {key!r} is {value!r}, expected an integer")
    paths = write_split_by_hand(tmp_path, [["a"], ["b"]])
    with GGUFCheckpoint(paths[0]) as ck:  # gguf-split's own kinds (uint16, int32) are integers
        assert set(ck.tensors) == {"a", "b"}


def test_error_not_gguf(tmp_path):
    p = tmp_path / "x.gguf"
    p.write_bytes(b"GGML" + bytes(100))
    with pytest.raises(ExpertCacheError) as e:
        GGUFCheckpoint(p)
    one_line(e, str(p), "not a GGUF file", "b'GGML'")
    p.write_bytes(b"GG")
    with pytest.raises(ExpertCacheError) as e:
        GGUFCheckpoint(p)
    one_line(e, str(p), "not a GGUF file")


@pytest.mark.parametrize("version", [1, 4, 0x03000000])
def test_error_unsupported_version(model, version):
    path = model[0]
    data = bytearray(path.read_bytes())
    data[4:8] = struct.pack("<I", version)
    path.write_bytes(data)
    with pytest.raises(ExpertCacheError) as e:
        GGUFCheckpoint(path)
    one_line(e, str(path), f"GGUF version {version} is not supported")


def test_error_truncated_data(model):
    path, tensors, _, _ = model
    last = max(GGUFReader(path).tensors, key=lambda t: t.data_offset)
    path.write_bytes(path.read_bytes()[: last.data_offset + last.n_bytes - 1])
    with pytest.raises(ExpertCacheError) as e:
        GGUFCheckpoint(path)
    one_line(e, str(path), "truncated", repr(last.name))


def test_error_truncated_header(model):
    path = model[0]
    path.write_bytes(path.read_bytes()[:60])
    with pytest.raises(ExpertCacheError) as e:
        GGUFCheckpoint(path)
    one_line(e, str(path), "truncated: the header ends inside metadata key")


def patch_tensor_info(path, name: str, dim0: int | None = None, dim1: int | None = None, qtype: int | None = None):
    """Rewrite fields of tensor `name`'s info in place (ggml order: dim0 is the row length)."""
    data = bytearray(path.read_bytes())
    key = struct.pack("<Q", len(name)) + name.encode()
    at = data.index(key) + len(key)
    n_dims = struct.unpack_from("<I", data, at)[0]
    if dim0 is not None:
        struct.pack_into("<Q", data, at + 4, dim0)
    if dim1 is not None:
        struct.pack_into("<Q", data, at + 12, dim1)
    if qtype is not None:
        struct.pack_into("<I", data, at + 4 + 8 * n_dims, qtype)
    path.write_bytes(data)


def test_error_row_not_a_whole_number_of_blocks(model):
    path = model[0]
    patch_tensor_info(path, "blk.0.ffn_up_exps.weight", dim0=48)
    with pytest.raises(ExpertCacheError) as e:
        GGUFCheckpoint(path)
    one_line(e, str(path), "'blk.0.ffn_up_exps.weight'", "rows of 48 elements", "Q8_0 block size 32")


def test_error_shape_claims_more_bytes_than_stored(model):
    path = model[0]
    ref = sorted(GGUFReader(path).tensors, key=lambda t: t.data_offset)
    first = ref[0]
    patch_tensor_info(path, first.name, dim1=int(first.shape[1]) * 4)
    with pytest.raises(ExpertCacheError) as e:
        GGUFCheckpoint(path)
    one_line(e, str(path), repr(first.name), f"but tensor {ref[1].name!r} begins")


def test_error_unknown_storage_type(model):
    path = model[0]
    patch_tensor_info(path, "norm.weight", qtype=99)
    with pytest.raises(ExpertCacheError) as e:
        GGUFCheckpoint(path)
    one_line(e, str(path), "'norm.weight'", "unknown storage type 99")


def test_error_missing_key(model):
    with GGUFCheckpoint(model[0]) as ck, pytest.raises(ExpertCacheError) as e:
        ck.require("qwen3moe.block_count")
    one_line(e, str(model[0]), "'qwen3moe.block_count'", "missing")


def test_directories(tmp_path, model):
    with GGUFCheckpoint(model[0].parent) as ck:
        assert ck.files == [model[0]]
    write_gguf(tmp_path / "other.gguf", split_tensors())
    with pytest.raises(ExpertCacheError) as e:
        GGUFCheckpoint(tmp_path)
    one_line(e, str(tmp_path), "several GGUF models", "m.gguf", "other.gguf")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ExpertCacheError) as e:
        GGUFCheckpoint(empty)
    one_line(e, str(empty), "no .gguf file")
    with pytest.raises(ExpertCacheError) as e:
        GGUFCheckpoint(tmp_path / "nope.gguf")
    one_line(e, "nope.gguf", "no such file")


def test_file_shrinking_after_open_is_an_error_not_a_crash(model):
    path = model[0]
    with GGUFCheckpoint(path) as ck:
        last = max(ck.tensors.values(), key=lambda t: t.offset)
        with open(path, "r+b") as f:
            f.truncate(last.offset + 1)
        with pytest.raises(ExpertCacheError) as e:
            ck.read(last.name)
        one_line(e, str(path), "truncated")


def test_corrupt_headers_raise_only_expertcache_errors(model):
    """Random truncations and byte flips in the header: the file opens or fails with one line."""
    path = model[0]
    good = path.read_bytes()
    header_end = min(t.data_offset for t in GGUFReader(path).tensors)
    rnd = random.Random(0)
    for trial in range(300):
        data = bytearray(good)
        if trial % 3 == 0:
            data = data[: rnd.randrange(header_end)]
        else:
            for _ in range(rnd.randint(1, 4)):
                data[rnd.randrange(8, header_end)] = rnd.randrange(256)
        path.write_bytes(data)
        try:
            with GGUFCheckpoint(path) as ck:
                for name in ck.tensors:
                    ck.read(name)
        except ExpertCacheError as e:
            msg = str(e)
            assert "\n" not in msg and (str(path) in msg or "twice" in msg), msg


# Models converted and quantized by llama.cpp's own tools (tools/make_gguf_fixtures.py).
CONVERTED = sorted((Path(__file__).resolve().parent / "fixtures" / "gguf").glob("*.gguf"))


@pytest.mark.parametrize("path", CONVERTED, ids=lambda p: p.stem)
def test_llama_cpp_files_read_like_gguf_py(path):
    want_types = json.loads(path.with_suffix(".json").read_text(encoding="utf-8"))["tensor_types"]
    ref = GGUFReader(path)
    with GGUFCheckpoint(path) as ck:
        assert {n: i.qtype.name for n, i in ck.tensors.items()} == want_types
        for r in ref.tensors:
            info = ck.info(r.name)
            assert info.shape == tuple(reversed(r.shape.tolist()))
            assert (info.offset, info.nbytes) == (r.data_offset, r.n_bytes)
            got = ck.read(r.name).numpy()
            assert got.tobytes() == r.data.tobytes()
            if len(info.shape) == 3:
                for e in range(info.shape[0]):
                    assert np.array_equal(ck.read_rows(r.name, e).numpy(), got[e])
        for key, field in ref.fields.items():
            if not key.startswith("GGUF."):
                assert ck.metadata[key] == field.contents(), key


def test_llama_cpp_fixtures_are_present():
    assert len(CONVERTED) >= 4, "tests/fixtures/gguf holds the llama.cpp-made files the tests above read"
