"""GGUF files that llama.cpp loads and that were refused or crashed here: names that look like a
gguf-split part but number no part of a set, and special token ids past the vocabulary (llama.cpp
warns "bad special token" and loads the file). The references are llama.cpp's rules (it goes by
split.count, not by the name; it drops such an id) and the unchanged fixture's logits."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from gguf import GGUFValueType as VT

import expertcache
from conftest import assert_one_line_error, run_cli
from expertcache.checkpoint.gguf_io import GGUFCheckpoint
from gguf_blocks import rewrite_gguf
from test_gguf_model import PROMPT

FIXTURES = Path(__file__).parent / "fixtures" / "gguf"
MIX = FIXTURES / "qwen3_moe-mix.gguf"


@pytest.mark.parametrize("name", ["m-00001-of-00000.gguf", "m-00000-of-00001.gguf", "m-00003-of-00002.gguf"])
def test_a_name_that_numbers_no_part_of_a_set_is_one_file(tmp_path, capsys, name):
    # -00001-of-00000 ended in an IndexError traceback; the others were refused as a set missing
    # its parts. llama.cpp reads each as the one file it is (its split.count is absent).
    path = tmp_path / name
    shutil.copy(MIX, path)
    gg, want = GGUFCheckpoint(path), GGUFCheckpoint(MIX)
    assert gg.files == [path]
    assert {n: (i.qtype, i.shape, i.offset, i.nbytes) for n, i in gg.tensors.items()} == \
        {n: (i.qtype, i.shape, i.offset, i.nbytes) for n, i in want.tensors.items()}
    assert gg.metadata == want.metadata
    assert torch.equal(expertcache.load(path, dtype="float32").logits(PROMPT),
                       expertcache.load(MIX, dtype="float32").logits(PROMPT))
    # in a directory too
    assert GGUFCheckpoint(tmp_path).files == [path]
    # A part of a real set under such a name is still named for what it is.
    part = rewrite_gguf(MIX, tmp_path / "part.gguf", {"split.no": (0, VT.UINT16, None),
                                                      "split.count": (2, VT.UINT16, None)})
    bad = tmp_path / "sub" / name
    bad.parent.mkdir()
    part.rename(bad)
    code, err = run_cli(capsys, "info", "-m", str(bad))
    assert_one_line_error(code, err, str(bad), "part 1 of a 2-part model (split.count)")


@pytest.mark.parametrize("role", ["eos", "bos"])
def test_a_special_token_id_past_the_vocabulary_is_dropped_as_llama_cpp_does(tmp_path, capsys, role):
    # The whole file was refused ("eos_token_id 4096 is not a token id of the vocabulary of 4096");
    # llama.cpp warns and keeps its default.
    key = f"tokenizer.ggml.{role}_token_id"
    path = rewrite_gguf(MIX, tmp_path / "m.gguf", {key: (4096, VT.UINT32, None)})
    model = expertcache.load(path, dtype="float32")
    assert getattr(model.cfg, f"{role}_token_id") in (None, ())
    assert 4096 not in model.eos_ids
    assert torch.equal(model.logits(PROMPT), expertcache.load(MIX, dtype="float32").logits(PROMPT))
    code, err = run_cli(capsys, "info", "-m", str(path))
    assert code == 0, err
    assert f"ignoring {key}=4096, which is not a token id of the vocabulary of 4096" in err
    assert "Traceback" not in err
    # An id of the wrong kind is still refused in one line.
    path = rewrite_gguf(MIX, tmp_path / "s.gguf", {key: ("2", VT.STRING, None)})
    code, err = run_cli(capsys, "info", "-m", str(path))
    assert_one_line_error(code, err, "'2'")
