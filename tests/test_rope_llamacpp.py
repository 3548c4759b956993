"""`--rope-scaling`, `--rope-scale` and `--yarn-orig-ctx` against llama.cpp itself, past the
original context: llama.cpp's logits with the same flags are recorded in
tests/fixtures/llamacpp/rope_scaling.json by tools/llamacpp_rope_ref.py (llama-cpp-python,
llama_cpp.Llama(rope_scaling_type=..., rope_freq_scale=1/F, yarn_orig_ctx=N), one thread, F32
K/V cache, flash attention off), on qwen3_moe-mix.gguf's weights in F32 with a context length
of 64 and a prompt of 320 tokens. The files are rebuilt here by the tool's `build`.

Measured here (8 Dec 2026, llama-cpp-python 0.3.36) over whole rows of logits (|logit| <= 15):
the unscaled file agrees to 9.5e-5, linear scaling to 4e-5, YaRN to 1.1e-4 .. 2.0e-4 (cos and
sin scaled by 0.1 ln(factor) + 1 magnify fp32's rounding a little: the mean difference is
7e-6 against 5e-6 unscaled); the settings differ from the unscaled model's by 17 .. 20 past
the original context, and YaRN without its magnitude or its ramp's rounding by 14 .. 20.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

import expertcache
from expertcache.cli import build_parser
from expertcache.commands.common import load_model
from conftest import assert_one_line_error, run_cli

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

from llamacpp_rope_ref import CASES, CONTEXT, RECORDING, build  # noqa: E402

TOL = 5e-4  # 2.5x the largest difference seen (YaRN at factor 3), 25x below a wrong table's


@pytest.fixture(scope="module")
def rec() -> dict:
    return json.loads(RECORDING.read_text())


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("rope_llamacpp")
    made = {}

    def get(name: str) -> Path:
        if name not in made:
            made[name] = build(name, d / f"{name}.gguf")
        return made[name]

    return get


def _argv(flags: dict) -> list[str]:
    return [str(a) for flag, value in flags.items() for a in (flag, value)]


def _logits(path: Path, ids: list[int], flags: dict) -> torch.Tensor:
    """Our logits at every position, the model loaded as `expertcache run` loads it with these flags
    (in fp32 on the F32 weights: llama.cpp's function up to the order of fp32 sums)."""
    args = build_parser().parse_args(["run", "-m", str(path), "--dtype", "float32", "-c", str(len(ids)),
                                      *_argv(flags)])
    model = load_model(args)
    return model.prefill(model.new_session(), ids, 512, all_logits=True)


REFUSED = {"file none, scale 2"}  # llama.cpp runs it unscaled: the flag would be dropped


@pytest.mark.parametrize("case", [c for c in CASES if c not in REFUSED])
def test_rope_flags_give_llama_cpps_logits_past_the_original_context(rec, files, case):
    r = rec["cases"][case]
    assert r["file"] == CASES[case][0] and r["flags"] == CASES[case][1]
    got = _logits(files(r["file"]), rec["tokens"], r["flags"])[::rec["every"]].float()
    want = torch.tensor(r["logits"])                                 # [N, 4]
    ours = got.gather(1, torch.tensor(r["ids"]))                     # [N, 4]
    diff = (ours - want).abs()
    worst = int(diff.amax(-1).argmax())
    assert float(diff.max()) < TOL, f"{case}: position {worst * rec['every']} differs by {float(diff.max()):.3g}"
    clear = (want[:, 0] - want[:, 1]) > 2 * TOL
    agree = got.argmax(-1) == torch.tensor([row[0] for row in r["ids"]])
    assert bool(agree[clear].all()), f"{case}: argmax differs at rows {(~agree & clear).nonzero().flatten().tolist()}"


def test_the_recorded_cases_are_apart_past_the_original_context(rec):
    # Past the context each scaled case is far from the unscaled one (a flag dropped, or one
    # computed wrong, cannot pass the test above), and the ones llama.cpp runs unscaled are it.
    plain = torch.tensor(rec["cases"]["plain"]["logits"])
    past = slice(CONTEXT // rec["every"], None)
    unscaled = {"plain", "file yarn, none", "file none, scale 2", "file yarn1"}
    for case, r in rec["cases"].items():
        apart = float((torch.tensor(r["logits"]) - plain)[past].abs().max())
        same_ids = r["ids"] == rec["cases"]["plain"]["ids"]
        if case in unscaled:
            assert same_ids and apart == 0, (case, apart)
        else:
            assert not same_ids or apart > 100 * TOL, (case, apart)


def test_rope_scale_alone_on_a_file_whose_type_is_none_is_one_line(files, capsys):
    # llama.cpp takes the file's type none as the model's and forces freq_scale 1: the recording
    # of `--rope-scale 2` there is the unscaled model's (above), a flag dropped without a word.
    code, err = run_cli(capsys, "run", "-m", str(files("none")), "-p", "hi", "-n", "1", "--rope-scale", "2")
    assert_one_line_error(code, err, "--rope-scale 2: the model's RoPE scaling type is none, which never scales",
                          "add --rope-scaling linear or yarn")
    code, err = run_cli(capsys, "run", "-m", str(files("none")), "-p", "hi", "-n", "1", "--yarn-orig-ctx", "32")
    assert_one_line_error(code, err, "--yarn-orig-ctx 32: the model's RoPE scaling type is none",
                          "add --rope-scaling yarn")


def test_load_reads_the_files_original_context_whatever_its_type(files):
    # llama.cpp's n_ctx_orig_yarn: rope.scaling.original_context_length wherever the file has it.
    yarn = {"rope_type": "yarn", "factor": 4.0}
    for name in ("orig", "yarn1"):
        rope = expertcache.load(files(name), dtype="float32", rope_scaling=yarn).cfg.rope
        assert (rope.type, rope.factor, rope.original_max_position) == ("yarn", 4.0, CONTEXT // 2), name
    rope = expertcache.load(files("yarn1"), dtype="float32", rope_scaling={"factor": 4.0}).cfg.rope
    assert (rope.type, rope.original_max_position) == ("yarn", CONTEXT // 2)
