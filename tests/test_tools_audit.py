"""The scripts under tools/ that users and the docs run (review of the tools): what they write
against a reference (the gguf package's reader and the checkpoint they convert, transformers on a
trained model), outputs they must not overwrite or delete, and bad arguments as one-line errors
with exit 2."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

import expertcache
from conftest import assert_one_line_error
from expertcache.models.synth import synth

ROOT = Path(__file__).resolve().parents[1]
TOOLS = ROOT / "tools"
sys.path.insert(0, str(TOOLS))


def _exit_code(fn, *args) -> int:
    try:
        return fn(*args)
    except SystemExit as e:  # argparse's own errors
        return e.code


@pytest.fixture(scope="module")
def byte_model(tmp_path_factory):
    """synth's checkpoint: a byte-level BPE tokenizer without merges, vocabulary larger than it."""
    return synth(tmp_path_factory.mktemp("tools") / "syn", like="tiny", layers=1, experts=4, top_k=2, vocab=300,
                 progress=False)


def test_to_gguf_keeps_the_ids_of_a_tokenizer_without_merges(byte_model, tmp_path):
    """llama.cpp needs at least one merge, and to_gguf gave a tokenizer without any the merge
    "Ġ t" on a spare id: the GGUF then tokenized " t" as one token (259) where the checkpoint
    has two (220, 83), so the converted model read another prompt than its source. Its
    placeholder merge now can never apply: ids, and so logits, equal the checkpoint's."""
    import gguf
    from to_gguf import convert

    assert not json.loads((byte_model / "tokenizer.json").read_text())["model"].get("merges")
    out = tmp_path / "syn.gguf"
    convert(byte_model, out)
    fields = gguf.GGUFReader(out).fields
    tokens = fields["tokenizer.ggml.tokens"].contents()
    vocab = json.loads((byte_model / "tokenizer.json").read_text())["model"]["vocab"]
    assert all(tokens[i] == t for t, i in vocab.items())
    for merge in fields["tokenizer.ggml.merges"].contents():
        a, b = merge.split(" ", 1)
        assert len(a) > 1 and len(b) > 1 and a + b not in tokens  # a piece is one character until merged

    ref, conv = expertcache.load(byte_model), expertcache.load(out)
    text = "def test(t):\n    return t.total + 3 * that  # the text"
    ids = ref.tokenizer.encode(text)
    assert len(ids) == len(text.encode())  # no merges: one token per byte
    assert conv.tokenizer.encode(text) == ids
    assert torch.equal(conv.logits(ids), ref.logits(ids))


def test_to_gguf_never_replaces_a_file_it_did_not_write(byte_model, tmp_path, capsys):
    """-o naming an existing GGUF (llama.cpp's conversion of the model, a quantized file) was
    overwritten without a word; it is now refused, --force or not, and an earlier output of the
    tool is replaced only with --force."""
    from to_gguf import main

    theirs = tmp_path / "theirs.gguf"
    shutil.copyfile(ROOT / "tests" / "fixtures" / "gguf" / "tokenizers" / "bpe-tiny.gguf", theirs)
    before = theirs.read_bytes()
    for force in ([], ["--force"]):
        capsys.readouterr()
        code = _exit_code(main, ["-m", str(byte_model), "-o", str(theirs), *force])
        assert_one_line_error(code, capsys.readouterr().err, str(theirs), "expected a new path")
        assert theirs.read_bytes() == before
    ours = tmp_path / "ours.gguf"
    assert main(["-m", str(byte_model), "-o", str(ours)]) == 0
    capsys.readouterr()
    assert _exit_code(main, ["-m", str(byte_model), "-o", str(ours)]) == 2
    assert "--force" in capsys.readouterr().err
    inode = ours.stat().st_ino
    assert main(["-m", str(byte_model), "-o", str(ours), "--force"]) == 0
    assert ours.stat().st_ino != inode  # written beside it and renamed over it
    assert expertcache.load(ours).logits([5, 6]).shape == (2, 300)
    assert not [p for p in tmp_path.iterdir() if p.name not in ("theirs.gguf", "ours.gguf")]  # no leftovers


def test_to_gguf_bad_models_are_one_line_errors(byte_model, tmp_path, capsys):
    """A model without tokenizer.json (or a .gguf file as -m) was a traceback, another family
    exit code 1; both are now one line, exit 2, before anything is written."""
    from to_gguf import main

    notok = tmp_path / "notok"
    shutil.copytree(byte_model, notok)
    (notok / "tokenizer.json").unlink()
    code = _exit_code(main, ["-m", str(notok), "-o", str(tmp_path / "a.gguf")])
    assert_one_line_error(code, capsys.readouterr().err, "tokenizer.json", str(notok))

    g4 = synth(tmp_path / "g4", like="gemma-4-26b-a4b", layers=1, experts=4, top_k=2, vocab=300, progress=False)
    code = _exit_code(main, ["-m", str(g4), "-o", str(tmp_path / "b.gguf")])
    assert_one_line_error(code, capsys.readouterr().err, "gemma4", "expected a Qwen3-MoE checkpoint")
    assert not list(tmp_path.glob("*.gguf"))


@pytest.fixture
def make_gguf_fixtures(monkeypatch):
    """The tool without llama.cpp: a stand-in llama_cpp module and no build (only main's handling
    of --work runs)."""
    stub = types.ModuleType("llama_cpp")
    stub.__getattr__ = lambda name: 0
    monkeypatch.setitem(sys.modules, "llama_cpp", stub)
    import make_gguf_fixtures as tool

    built = []
    monkeypatch.setattr(tool, "rebuild", lambda llama, work, out, families: built.append(sorted(os.listdir(work))))
    monkeypatch.setattr(tool, "check", lambda out: 0)
    yield tool, built
    for name in ("make_gguf_fixtures", "llamacpp_ref"):  # bound to the stand-in: not for later imports
        sys.modules.pop(name, None)


def test_make_gguf_fixtures_never_empties_a_folder_it_did_not_make(make_gguf_fixtures, tmp_path, capsys):
    """--rebuild began with shutil.rmtree(--work): `--work ~/models` (or `.`) deleted the folder
    and everything in it. Only a folder an earlier --rebuild made is emptied now."""
    tool, built = make_gguf_fixtures
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep")
    args = ["--rebuild", "--llama-cpp", str(tmp_path), "--out", str(tmp_path / "out")]
    code = _exit_code(tool.main, args + ["--work", str(mine)])
    assert code == 2 and "--work" in capsys.readouterr().err
    assert (mine / "notes.txt").read_text() == "keep" and not built

    work = tmp_path / "work"
    assert tool.main(args + ["--work", str(work)]) == 0
    (work / "old.gguf").write_text("an earlier build")
    assert tool.main(args + ["--work", str(work)]) == 0
    assert built == [[tool.WORK_MARKER], [tool.WORK_MARKER]]  # the earlier build's files gone


def test_prefetch_timeline_measures_a_gguf_model_and_a_small_one(tmp_path):
    """After all its runs, the tool timed a read of the model's largest .safetensors: a GGUF model
    ended in NotADirectoryError, one under 18 MiB in ZeroDivisionError, and the runs' table was
    lost. The GGUF file itself is read now; a small file is reported as such."""
    import prefetch_timeline as pt

    gg = tmp_path / "m.gguf"
    gg.write_bytes(b"GGUF" + bytes(4096))
    assert pt.weights_file(str(gg)) == str(gg)
    d = tmp_path / "dir"
    d.mkdir()
    for name, size in (("a.safetensors", 10), ("b.safetensors", 30), ("tokenizer.json", 99)):
        (d / name).write_bytes(bytes(size))
    assert pt.weights_file(str(d)) == str(d / "b.safetensors")
    assert pt.read_cost(str(gg)) is None


def test_prefetch_timeline_errors_are_one_line():
    """A model that does not exist, or one the trace does not fit, was ExpertCacheError's
    traceback; --decode 0 a ZeroDivisionError after the runs."""
    tool = [sys.executable, str(TOOLS / "prefetch_timeline.py")]
    trace = str(ROOT / "docs" / "traces" / "used" / "chat.npz")
    for args, needle in (([str(ROOT / "no-such-model"), trace], "no-such-model"),
                         ([expertcache.engine.default_model_path(), trace, "--decode", "0"], "--decode")):
        res = subprocess.run(tool + [str(a) for a in args], capture_output=True, text=True, timeout=120)
        assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
        assert needle in res.stderr.strip().splitlines()[-1]


def test_train_tiny_moe_writes_held_out_text_beside_its_model():
    """--out elsewhere (an experiment, a second corpus) still wrote the held-out sample over the
    bundled src/expertcache/assets/heldout.txt, which the GGUF fixtures' recordings are cut from."""
    import train_tiny_moe as t

    assert t.parse_args([]).heldout_out == t.DEFAULT_HELDOUT  # the bundled model's, as before
    assert t.parse_args(["--out", "/tmp/x/model"]).heldout_out == Path("/tmp/x/heldout.txt")
    assert t.parse_args(["--out", "/tmp/x/model", "--heldout-out", "/tmp/h.txt"]).heldout_out == Path("/tmp/h.txt")


def _corpus(root: Path, held_text: str, train_text: str) -> str:
    import train_tiny_moe as t

    root.mkdir()
    held = next(n for n in (f"m{i}.py" for i in range(100)) if t.is_heldout(n))
    (root / held).write_text(held_text)
    (root / "a.py").write_text(train_text)
    return held


TINY = ["--threads", "1", "--steps", "2", "--warmup", "1", "--seq-len", "32", "--vocab", "300", "--hidden", "32",
        "--heads", "2", "--kv-heads", "1", "--head-dim", "16", "--layers", "2", "--experts", "4", "--top-k", "2",
        "--moe-intermediate", "16", "--autocast", "none", "--save-dtype", "float32"]


def test_train_tiny_moe_recipe_makes_a_model_that_loads_as_transformers_runs_it(tmp_path):
    """The bundled model's recipe at a tiny size: the checkpoint it exports loads, with the logits
    transformers gives it, and the held-out file is the one the manifest holds out."""
    import shlex
    import textwrap

    import train_tiny_moe as t
    from transformers import Qwen3MoeForCausalLM

    held = _corpus(tmp_path / "corpus", Path(shlex.__file__).read_text(), Path(textwrap.__file__).read_text())
    out = tmp_path / "run" / "model"
    assert t.main(["--corpus", str(tmp_path / "corpus"), "--batch", "2", "--out", str(out), "--heldout-out",
                   str(tmp_path / "run" / "heldout.txt"), "--work", str(tmp_path / "work"), *TINY]) == 0
    assert (tmp_path / "run" / "heldout.txt").read_text() == Path(shlex.__file__).read_text().rstrip("\n") + "\n\n"
    man = json.loads((out / "manifest.json").read_text())
    assert {e["path"]: e["split"] for e in man["files"]} == {held: "heldout", "a.py": "train"}

    model = expertcache.load(out, dtype="float32")
    ids = model.tokenizer.encode("def f(x):\n    return x + 1\n")
    with torch.no_grad():
        want = Qwen3MoeForCausalLM.from_pretrained(out, dtype=torch.float32).eval()(
            input_ids=torch.tensor([ids])).logits[0]
    torch.testing.assert_close(model.logits(ids), want, atol=1e-5, rtol=1e-4)


def test_train_tiny_moe_too_small_a_corpus_is_an_error(tmp_path, capsys):
    """Fewer sequences than --batch was a ZeroDivisionError in the batch order."""
    import train_tiny_moe as t

    _corpus(tmp_path / "corpus", "x = 1\n" * 50, "y = 2\n" * 200)
    with pytest.raises(SystemExit) as e:
        t.main(["--corpus", str(tmp_path / "corpus"), "--batch", "64", "--out", str(tmp_path / "model"),
                "--heldout-out", str(tmp_path / "h.txt"), "--work", str(tmp_path / "work"), *TINY])
    assert "--batch 64" in str(e.value.code) and not (tmp_path / "model").exists()


def test_ab_speed_removes_its_copy_of_the_old_tree(tmp_path):
    """Each run copied the old src/ (with its bundled model, 30 MB) into a temporary folder
    that it never removed."""
    code = ("import sys; from pathlib import Path; sys.path.insert(0, sys.argv[1]); import ab_speed; "
            "print(Path(ab_speed.import_old(Path(sys.argv[2])).__file__).parents[1])")
    res = subprocess.run([sys.executable, "-c", code, str(TOOLS), str(ROOT / "src")], capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    copy = Path(res.stdout.strip().splitlines()[-1])
    assert copy.name.startswith("ab_speed_") and not copy.exists()


@pytest.mark.parametrize("tool,args,needle", [
    ("eval_tiny_moe", ["--window", "64", "--stride", "64"], "--stride 64"),   # was a RuntimeError in gather
    ("eval_tiny_moe", ["--stride", "0"], "--stride 0"),
    ("eval_tiny_moe", [], "manifest.json"),                                  # was FileNotFoundError
    ("fixture_perplexity", ["--fixtures", "olmoe-Q8_0,nope"], "'nope'"),     # was FileNotFoundError
    ("gemm_act8_probe", ["--rounds", "0"], "--rounds"),                      # was StatisticsError
    ("gemm_act8_probe", ["--rows", "4,x"], "--rows"),                        # was ValueError
    ("gemm_act8_probe", ["--rows", "0"], "--rows"),                          # was ZeroDivisionError
])
def test_bad_arguments_are_one_line_errors(tool, args, needle, tmp_path, capsys):
    import importlib

    if tool == "eval_tiny_moe":
        args = args + ["--model", str(tmp_path)]  # no manifest: nothing beyond the arguments is read
    mod = importlib.import_module(tool)
    code = _exit_code(mod.main, args)
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert needle in err.strip().splitlines()[-1]


@pytest.mark.parametrize("args,needle", [(["--threads", "0"], "--threads 0"),
                                         (["--kv-heads", "0"], "--kv-heads 0"), (["--calls", "0"], "--calls 0")])
def test_attend_probe_bad_arguments(args, needle, capsys, monkeypatch):
    """--threads 0 was torch's RuntimeError, --kv-heads 0 a ZeroDivisionError, --calls 0 one."""
    import attend_probe

    monkeypatch.setattr(sys, "argv", ["attend_probe.py", *args])
    code = _exit_code(attend_probe.main)
    err = capsys.readouterr().err
    assert code == 2 and needle in err.strip().splitlines()[-1]


def test_ab_decode_keeps_both_sides_of_an_a_a_run(monkeypatch, capsys):
    """The same tree as A and B (an A/A run, to see the host's noise) kept one time per round for
    both sides, keyed by the path: every ratio read exactly 1.000."""
    import ab_decode

    times = iter([1.0, 2.0, 3.0, 4.0])
    monkeypatch.setattr(ab_decode, "run_tree", lambda tree, *a: next(times))
    assert ab_decode.main([str(ROOT), str(ROOT), "-m", "m.gguf", "--rounds", "2"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert (out["a_ms"], out["b_ms"]) == ([1.0, 4.0], [2.0, 3.0])  # A first, then B first
    assert out["ratios"] == [2.0, 0.75]


def test_oracle_trace_writes_only_a_new_trace(tmp_path, capsys, monkeypatch):
    """docs/traces/oracle_trace.py wrote its output with open(out, "wb"): naming the trace it
    reads (or any other file) as the output destroyed it, and a missing trace was a traceback.
    The copy holds each op's own experts first with probability 1, then the recorded guesses."""
    import numpy as np

    sys.path.insert(0, str(ROOT / "docs" / "traces"))
    import oracle_trace
    from expertcache.bench.trace import load_trace

    src = tmp_path / "chat.npz"
    shutil.copyfile(ROOT / "docs" / "traces" / "used" / "chat.npz", src)
    model = tmp_path / "model.safetensors"
    model.write_bytes(b"weights")
    before = src.read_bytes()
    def run(*args):  # as the docs run it: the command line
        monkeypatch.setattr(sys, "argv", ["oracle_trace.py", *map(str, args)])
        return oracle_trace.main()

    for args, needle in (((src, src), "is the trace read"), ((src, model), "is not a trace"),
                         ((tmp_path / "no-such.npz", tmp_path / "a.npz"), "no-such")):
        assert_one_line_error(run(*args), capsys.readouterr().err, needle)
    assert src.read_bytes() == before and model.read_bytes() == b"weights"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["chat.npz", "model.safetensors"]

    assert run(src, tmp_path / "oracle.npz") == 0
    rec, got = load_trace(src), load_trace(tmp_path / "oracle.npz")
    k = rec.ids.shape[1]
    assert np.array_equal(got.pred[:, :k], rec.ids)
    assert (got.pred_prob[:, :k] == 1).all() and (got.pred_prob[:, k:] == 0).all()
    for row in range(0, len(rec.ids), 97):
        guesses = [e for e in rec.pred[row] if e not in rec.ids[row]]
        assert list(got.pred[row, k:k + len(guesses)]) == guesses[:got.pred.shape[1] - k]
