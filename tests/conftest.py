"""Tiny random MoE checkpoints built with transformers (the reference) and saved as real
Hugging Face checkpoints, plus a minimal tokenizer for them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

# Bitwise results may differ between thread counts: pin it for every test.
torch.set_num_threads(1)

VOCAB = 128


def tiny_config(arch: str, *, tie: bool = False, dense: bool = False, rope: dict | None = None,
                experts: int = 8, top_k: int = 2, layers: int = 3, norm_topk: bool = True, **over):
    import transformers as tf

    common = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=layers, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6,
                  tie_word_embeddings=tie, num_experts_per_tok=top_k, eos_token_id=1, bos_token_id=None,
                  pad_token_id=None)
    if rope:
        common["rope_parameters"] = rope
    if arch == "qwen3_moe":
        c = tf.Qwen3MoeConfig(**common, head_dim=16, num_experts=experts, moe_intermediate_size=32,
                              intermediate_size=96, norm_topk_prob=norm_topk,
                              mlp_only_layers=[1] if dense else [], **over)
    elif arch == "qwen2_moe":
        c = tf.Qwen2MoeConfig(**common, num_experts=experts, moe_intermediate_size=32, intermediate_size=96,
                              shared_expert_intermediate_size=48, norm_topk_prob=norm_topk,
                              decoder_sparse_step=2 if dense else 1, **over)
    elif arch == "olmoe":
        c = tf.OlmoeConfig(**common, num_experts=experts, intermediate_size=32, norm_topk_prob=norm_topk,
                           clip_qkv=over.pop("clip_qkv", None), **over)
    elif arch == "mixtral":
        c = tf.MixtralConfig(**common, num_local_experts=experts, intermediate_size=32, sliding_window=None, **over)
    else:
        raise ValueError(arch)
    return c


def build_reference(config, seed: int = 0):
    import transformers as tf

    tf.utils.logging.disable_progress_bar()
    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # Random init gives tiny weights; widen them so routing and logits are not all near ties.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif p.ndim >= 2:
                p.normal_(0.0, 0.12)
            else:
                p.normal_(0.0, 0.05)
    return model.eval()


def write_tokenizer(directory: Path, vocab: int = VOCAB) -> None:
    """A word-level tokenizer over `vocab` ids, with a ChatML chat template and EOS id 1."""
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders

    words = ["<unk>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    words += [f"w{i}" for i in range(vocab - len(words))]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins with spaces
    tok.add_special_tokens(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    tok.save(str(directory / "tokenizer.json"))
    template = ("{% for m in messages %}<|im_start|> {{ m['role'] }} {{ m['content'] }} <|im_end|> "
                "{% endfor %}{% if add_generation_prompt %}<|im_start|> assistant {% endif %}")
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "<|endoftext|>", "bos_token": None, "chat_template": template}))


def save_checkpoint(model, directory: Path, fused: bool = False, dtype: torch.dtype | None = None,
                    shard: str | None = None) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    if dtype is not None:
        model = model.to(dtype)
    kwargs = {"save_original_format": False} if fused else {}
    if shard:
        kwargs["max_shard_size"] = shard
    model.save_pretrained(directory, **kwargs)
    write_tokenizer(directory)
    return directory


@pytest.fixture
def tiny_checkpoint(tmp_path):
    """Factory: (arch, **config options) -> (reference model, checkpoint dir)."""

    def make(arch: str, fused: bool = False, seed: int = 0, dtype=None, shard=None, **opts):
        ref = build_reference(tiny_config(arch, **opts), seed)
        d = save_checkpoint(ref, tmp_path / f"{arch}-{'fused' if fused else 'per'}-{seed}", fused, dtype, shard)
        return ref, d

    return make


def with_threads(count: int, fn):
    """fn() with torch on `count` threads, then the previous count again."""
    was = torch.get_num_threads()
    try:
        torch.set_num_threads(count)
        return fn()
    finally:
        torch.set_num_threads(was)


def run_cli(capsys, *argv) -> tuple[int, str]:
    """Run the `expertcache` command in-process: (exit code, stderr)."""
    from expertcache.cli import main

    capsys.readouterr()  # drop what fixtures printed
    try:
        code = main(list(argv))
    except SystemExit as e:  # argparse's own errors exit from parse_args
        code = e.code
    return code, capsys.readouterr().err


def assert_one_line_error(code: int, err: str, *needles: str) -> None:
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert "Traceback" not in err
    for n in needles:
        assert n in lines[0], lines[0]


class CountingModule:
    """A native module whose calls of `names` are counted (`calls`); every call passes through."""

    def __init__(self, module, *names):
        self.module, self.calls = module, dict.fromkeys(names, 0)

    def __getattr__(self, name):
        fn = getattr(self.module, name)
        if name not in self.calls:
            return fn

        def call(*args):
            self.calls[name] += 1
            return fn(*args)
        return call


def slots_hold_what_they_claim(cache) -> int:
    """Every resident key's slot holds that expert's bytes as the slow tier gives them and is
    described as holding it (after the copies in flight are done); returns the keys checked."""
    cache.quiesce()
    n = 0
    for key in cache.residency.resident_keys():
        slot = cache.residency.slot_of(key)
        want = torch.zeros_like(cache.pool[slot: slot + 1])
        cache.store.copy_run(key.layer, key.expert, want)
        # The expert's own bytes: a slot's tail past a smaller expert (layers of a quantized file
        # differ in size) may hold an earlier occupant's, which no view reads.
        size = cache.expert_bytes[key.layer]
        assert torch.equal(cache.pool[slot, :size], want[0, :size]), (key, slot)
        assert cache.content[slot] is not None and cache.content[slot].key == key, (key, slot)
        n += 1
    return n


def attention_calls(monkeypatch) -> list[tuple[int, int, int]]:
    """Records (query heads, key heads, query tokens) of every scaled_dot_product_attention call
    from here on. Grouped-query attention hands the kernel each group's keys once (`enable_gqa`),
    never repeated per query head: that copy cost 2 x heads x context x head size per call."""
    import torch.nn.functional as F

    calls = []
    orig = F.scaled_dot_product_attention

    def spy(q, k, v, *args, **kwargs):
        calls.append((q.shape[-3], k.shape[-3], q.shape[-2]))
        return orig(q, k, v, *args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    return calls


def assert_prompt_keys_not_repeated(model, ids: torch.Tensor, monkeypatch) -> None:
    """A prompt in two parts (a fresh one, then one after cached tokens), in micro-batches: every
    attention over several query tokens gets fewer key heads than query heads, and the logits
    are those of the whole prompt at once."""
    want = model.logits(ids)
    calls = attention_calls(monkeypatch)
    session = model.new_session()
    cut = len(ids) // 2
    got = torch.cat([model.prefill(session, ids[:cut].tolist(), ubatch=7, all_logits=True),
                     model.prefill(session, ids[cut:].tolist(), ubatch=5, all_logits=True)])
    prompt_calls = [c for c in calls if c[2] > 1]
    assert prompt_calls and all(k < q for q, k, _ in prompt_calls), prompt_calls
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)


def wait_until(condition, what: str, timeout: float = 30.0) -> None:
    """Poll a condition another thread makes true where it offers no event to wait on (a server
    started, the worker's counters), failing with `what` after `timeout` seconds."""
    import time

    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


class LiveServer:
    """uvicorn serving `app` in a background thread on an ephemeral loopback port (`url`);
    `stop()` ends it. `timeout`: how long starting and stopping may take."""

    def __init__(self, app, timeout: float = 30.0):
        import socket
        import threading

        import uvicorn

        self.app, self.timeout = app, timeout
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind(("127.0.0.1", 0))
        sock.listen(64)
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        wait_until(lambda: self.server.started, "the server did not start", timeout)  # uvicorn sets a flag only

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(self.timeout)
