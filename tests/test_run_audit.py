"""`expertcache run --chat` as a person uses it: at a terminal (a pseudo-terminal, or stdin that
says it is one) and from a pipe. Answers are checked against a one-shot `generate` on the same
rendered conversation."""

from __future__ import annotations

import io
import os
import select
import signal
import subprocess
import sys
import time

import pytest

from conftest import assert_one_line_error, build_reference, run_cli, save_checkpoint, tiny_config
from expertcache.engine import Model, load


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return save_checkpoint(build_reference(tiny_config("qwen3_moe")), tmp_path_factory.mktemp("run") / "m")


class _TTYBytes(io.BytesIO):
    def isatty(self) -> bool:
        return True


def _stdin(monkeypatch, data: bytes, tty: bool, errors: str = "strict") -> None:
    raw = _TTYBytes(data) if tty else io.BytesIO(data)
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(raw, encoding="utf-8", errors=errors))


def _chat(capsys, *argv) -> tuple[int, str, str]:
    """The command in-process: (exit code, stdout, stderr)."""
    from expertcache.cli import main

    capsys.readouterr()
    code = main(list(argv))
    got = capsys.readouterr()
    return code, got.out, got.err


def _answers(model, turns: list[str], n: int, system: str | None = None) -> list[str]:
    """The reference: each turn answered by a fresh one-shot generate on the whole conversation."""
    messages = [{"role": "system", "content": system}] if system else []
    out = []
    for line in turns:
        messages.append({"role": "user", "content": line})
        text = model.generate(model.tokenizer.encode_chat(messages), max_tokens=n).text
        messages.append({"role": "assistant", "content": text})
        out.append(text)
    return out


def _spy_generate(monkeypatch) -> list:
    """Records each generate call's result (the chat's turns)."""
    results = []
    orig = Model.generate

    def spy(self, prompt, **kw):
        res = orig(self, prompt, **kw)
        results.append((list(prompt), res))
        return res

    monkeypatch.setattr(Model, "generate", spy)
    return results


def test_piped_chat_answers_as_one_shot_generate_and_reuses_the_kv(ckpt, monkeypatch, capsys):
    turns = ["w5 w6", "w7", "w8 w9 w10"]
    _stdin(monkeypatch, ("\n".join(turns) + "\n").encode(), tty=False)
    calls = _spy_generate(monkeypatch)
    code, out, err = _chat(capsys, "run", "-m", str(ckpt), "--chat", "-n", "6", "-t", "1", "--system", "w4")
    assert code == 0, err
    monkeypatch.undo()
    want = _answers(load(str(ckpt), threads=1), turns, 6, system="w4")
    assert out == "".join(a + "\n" for a in want)
    # Each turn after the first reuses the previous turns' KV state: all of the previous prompt at least.
    for (prev, _), (_, res) in zip(calls, calls[1:]):
        assert res.cached_tokens >= len(prev), (res.cached_tokens, len(prev))


def test_chat_past_the_context_drops_the_oldest_exchanges_and_goes_on(ckpt, monkeypatch, capsys):
    # Was: the third message ended the chat, "38 tokens do not fit the context of 30 tokens", exit 2.
    ctx, n = 30, 8
    turns = ["w5 w6", "w7 w8", "w9", "w10"]
    _stdin(monkeypatch, ("\n".join(turns) + "\n").encode(), tty=False)
    code, out, err = _chat(capsys, "run", "-m", str(ckpt), "--chat", "-n", str(n), "-c", str(ctx), "-t", "1",
                        "--ignore-eos")
    assert code == 0, err
    assert "Traceback" not in err
    notices = [line for line in err.splitlines() if "outgrew the context" in line]
    assert notices and all("-c/--ctx-size" in line for line in notices), err
    # The reference: the documented rule, the oldest exchanges dropped until the conversation
    # leaves min(-n, context / 2) tokens for the answer.
    model = load(str(ckpt), threads=1, ctx_size=ctx)
    history, want = [], []
    for line in turns:
        user = {"role": "user", "content": line}
        while history and len(model.tokenizer.encode_chat(history + [user])) + min(n, ctx // 2) > ctx:
            del history[:2]
        text = model.generate(model.tokenizer.encode_chat(history + [user]), max_tokens=n, ignore_eos=True).text
        history += [user, {"role": "assistant", "content": text}]
        want.append(text)
    assert out == "".join(a + "\n" for a in want)


def test_a_message_longer_than_the_context(ckpt, monkeypatch, capsys):
    long = " ".join(["w5"] * 40)
    # From a pipe: an error naming the line, exit code 2.
    _stdin(monkeypatch, f"{long}\nw7\n".encode(), tty=False)
    assert_one_line_error(*run_cli(capsys, "run", "-m", str(ckpt), "--chat", "-n", "4", "-c", "30", "-t", "1"),
                          "line 1", "context of 30 tokens")
    # At a terminal: said and skipped; the next message is answered as if it came first.
    _stdin(monkeypatch, f"{long}\nw7\n".encode(), tty=True)
    code, out, err = _chat(capsys, "run", "-m", str(ckpt), "--chat", "-n", "4", "-c", "30", "-t", "1")
    assert code == 0, err
    assert "line 1" in err and "not sent" in err and "Traceback" not in err
    want = _answers(load(str(ckpt), threads=1, ctx_size=30), ["w7"], 4)
    assert out == "> > " + want[0] + "\n> \n"


@pytest.mark.parametrize("errors", ["strict", "surrogateescape"])
def test_chat_line_not_utf8_from_a_pipe(ckpt, monkeypatch, capsys, errors):
    # stdin decodes strictly under a UTF-8 locale (was: a UnicodeDecodeError traceback) and with
    # surrogate escapes under the C locale (was: "a lone surrogate U+DCFF at character 18", a
    # place in the rendered template, not in what the user typed).
    _stdin(monkeypatch, b"w5\nw6 \xff\xfe w7\n", tty=False, errors=errors)
    code, _, err = _chat(capsys, "run", "-m", str(ckpt), "--chat", "-n", "3", "-t", "1")
    assert_one_line_error(code, err, "line 2", "not valid UTF-8", "byte 3")


def test_chat_line_not_utf8_at_a_terminal_is_skipped(ckpt, monkeypatch, capsys):
    _stdin(monkeypatch, b"\xe9t\xe9\nw5\n", tty=True)
    code, out, err = _chat(capsys, "run", "-m", str(ckpt), "--chat", "-n", "3", "-t", "1")
    assert code == 0, err
    assert "line 1" in err and "not valid UTF-8" in err and "Traceback" not in err
    want = _answers(load(str(ckpt), threads=1), ["w5"], 3)
    assert out == "> > " + want[0] + "\n> \n"


def test_chat_refuses_json(ckpt, capsys):
    # Was: accepted and dropped without a word, the answers streamed as text.
    assert_one_line_error(*run_cli(capsys, "run", "-m", str(ckpt), "--chat", "--json"), "--json", "--chat")


def test_ctrl_c_stops_the_answer_and_the_conversation_goes_on(ckpt, monkeypatch, capsys):
    """Ctrl-C (SIGINT) during the first answer at a terminal: that answer stops where it is, and
    the second turn answers the conversation as it stands (the partial answer in it)."""
    calls = []
    orig = Model.generate
    pieces_before_ctrl_c = 4

    def generate(self, prompt, on_text=None, **kw):
        seen = []

        def text(piece):
            on_text(piece)
            seen.append(piece)
            if not calls and len(seen) == pieces_before_ctrl_c:
                signal.raise_signal(signal.SIGINT)

        res = orig(self, prompt, on_text=text, **kw)
        calls.append(res)
        return res

    monkeypatch.setattr(Model, "generate", generate)
    _stdin(monkeypatch, b"w5 w6\nw7\n", tty=True)
    code, out, err = _chat(capsys, "run", "-m", str(ckpt), "--chat", "-n", "200", "--ignore-eos", "-t", "1")
    assert code == 0, err
    assert len(calls) == 2
    first, second = calls
    assert first.finish_reason == "abort" and len(first.token_ids) == pieces_before_ctrl_c
    assert second.finish_reason == "length" and len(second.token_ids) == 200
    monkeypatch.undo()
    model = load(str(ckpt), threads=1)
    conversation = [{"role": "user", "content": "w5 w6"}, {"role": "assistant", "content": first.text},
                    {"role": "user", "content": "w7"}]
    want = model.generate(model.tokenizer.encode_chat(conversation), max_tokens=200, ignore_eos=True).text
    assert out == f"> {first.text}\n> {want}\n> \n"
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # put back after each answer


class _Terminal:
    """`expertcache` on a pseudo-terminal that is its controlling terminal, so that the keys
    Ctrl-C and Ctrl-D do what they do for a person."""

    def __init__(self, *argv):
        import pty

        self.master, slave = pty.openpty()

        def controlling_tty():
            import fcntl
            import termios

            os.setsid()
            fcntl.ioctl(0, termios.TIOCSCTTY, 0)

        self.proc = subprocess.Popen([sys.executable, "-m", "expertcache.cli", *argv], stdin=slave, stdout=slave,
                                     stderr=slave, preexec_fn=controlling_tty)
        os.close(slave)
        self.seen = b""

    def wait_for(self, condition, what: str, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while not condition(self.seen):
            left = deadline - time.monotonic()
            assert left > 0, f"{what}; the terminal shows {self.seen[-400:]!r}"
            if select.select([self.master], [], [], left)[0]:
                try:
                    data = os.read(self.master, 65536)
                except OSError:  # EIO: the program has gone
                    data = b""
                assert data, f"{what}: the program ended ({self.proc.wait()}); it showed {self.seen[-400:]!r}"
                self.seen += data

    def type(self, keys: bytes) -> None:
        os.write(self.master, keys)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        os.close(self.master)


def test_ctrl_c_and_ctrl_d_at_a_real_terminal(ckpt):
    # Was: Ctrl-C during an answer ended the chat (exit 130) with the conversation, and Ctrl-D at
    # the prompt left the shell's prompt on the line of ours ("> $").
    t = _Terminal("run", "-m", str(ckpt), "--chat", "-n", "1000000", "--ignore-eos", "-c", "100000", "-t", "1")
    try:
        t.wait_for(lambda s: s.endswith(b"> "), "the first prompt")
        for message in (b"w5 w6", b"w7"):
            start = len(t.seen)
            t.type(message + b"\n")
            # An answer that would go on for long: some of it, then Ctrl-C.
            t.wait_for(lambda s: s[start:].count(b" w") >= 10, "an answer streaming")
            t.type(b"\x03")
            t.wait_for(lambda s: s.endswith(b"\n> "), "the prompt after Ctrl-C")
        t.type(b"\x04")
        t.wait_for(lambda s: s.endswith(b"> \r\n"), "a new line after Ctrl-D")
        assert t.proc.wait(timeout=120) == 0
        assert b"Traceback" not in t.seen
    finally:
        t.close()


def test_ctrl_c_during_run_p_ends_the_line(ckpt):
    # Was: the process ended right after the last piece ("... w1^C"), leaving the shell's prompt
    # on the line of the text.
    t = _Terminal("run", "-m", str(ckpt), "-p", "w5 w6", "-n", "1000000", "--ignore-eos", "-c", "100000", "-t", "1")
    try:
        t.wait_for(lambda s: s.count(b" w") >= 10, "the text streaming")
        t.type(b"\x03")
        assert t.proc.wait(timeout=120) == 130
        t.wait_for(lambda s: s.endswith(b"\r\n"), "a new line after Ctrl-C")
        assert b"Traceback" not in t.seen
    finally:
        t.close()
