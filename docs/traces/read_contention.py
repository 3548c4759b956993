"""Do the disk's reads slow down while a product runs beside them? Reads 64 expert-sized ranges of
a model's checkpoint at random page-aligned offsets with O_DIRECT into one buffer, alone, beside
a thread running a memory-bound bf16 matrix-vector product (256 MiB of weights, like a decode
step's) and beside one running a small matrix product that stays in the cores' caches; and the
memory-bound product's rate alone and beside the reads. At one and two threads of compute. An
experiment, not a feature (docs/benchmarks.md, "The probe's destination"). From the repository
root, after `expertcache synth --like qwen3-30b-a3b --experts 32 --top-k 4 --layers 4 -o /tmp/q30a`:

    python docs/traces/read_contention.py /tmp/q30a/model.safetensors --rounds 3
"""

import argparse
import json
import os
import random
import threading
import time

import torch

from expertcache.memory import host_zeros

EXPERT = 9 << 20  # Qwen3-30B-A3B's expert, 9 MiB


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("file")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    size = os.path.getsize(args.file)
    if size < 2 * EXPERT:
        ap.error(f"{args.file}: {size} bytes; expected a checkpoint of at least {2 * EXPERT} bytes")
    fd = os.open(args.file, os.O_RDONLY | os.O_DIRECT)
    buf = host_zeros((EXPERT,), torch.uint8)
    buf.fill_(1)
    view = memoryview(buf.numpy())
    w = torch.full((16384, 8192), 1.0, dtype=torch.bfloat16)
    x = torch.ones(8192, dtype=torch.bfloat16)
    a = torch.randn(256, 256)

    def reads(n: int = 64) -> float:
        t = time.perf_counter()
        for _ in range(n):
            os.preadv(fd, [view], random.randrange(0, (size - EXPERT) // 4096) * 4096)
        return n * EXPERT / (time.perf_counter() - t) / 1e9

    def gemv_rate(seconds: float = 0.5) -> float:
        n, t = 0, time.perf_counter()
        while time.perf_counter() - t < seconds:
            torch.mv(w, x)
            n += 1
        return n * w.nbytes / (time.perf_counter() - t) / 1e9

    def beside(kind: str, threads: int) -> tuple[float, float]:
        running, stop, out = threading.Event(), threading.Event(), {}

        def spin() -> None:
            torch.set_num_threads(threads)  # a new thread starts with OpenMP's default, every core
            n, t = 0, time.perf_counter()
            while not stop.is_set():
                torch.mv(w, x) if kind == "gemv" else torch.mm(a, a)
                n += 1
                running.set()  # the reads start once a product has run: none of them is timed alone
            out["gb_s"] = n * w.nbytes / (time.perf_counter() - t) / 1e9

        th = threading.Thread(target=spin)
        th.start()
        running.wait()
        got = reads()
        stop.set()
        th.join()
        return got, out["gb_s"]

    rows = []
    print("threads  reads alone  beside gemv  beside small mm  (GB/s)   gemv alone  gemv beside reads")
    for threads in (1, 2):
        torch.set_num_threads(threads)
        for _ in range(args.rounds):
            alone, g_alone = reads(), gemv_rate()
            (with_gemv, g_beside), (with_mm, _) = beside("gemv", threads), beside("mm", threads)
            rows.append({"threads": threads, "reads_alone": round(alone, 3), "reads_beside_gemv": round(with_gemv, 3),
                         "reads_beside_mm": round(with_mm, 3), "gemv_alone": round(g_alone, 2),
                         "gemv_beside_reads": round(g_beside, 2)})
            print(f"{threads:<9}{alone:>11.2f}{with_gemv:>9.2f} ({with_gemv / alone:.2f}x){with_mm:>9.2f} "
                  f"({with_mm / alone:.2f}x){g_alone:>16.1f}{g_beside:>12.1f} ({g_beside / g_alone:.2f}x)", flush=True)
    print(json.dumps({"experiment": "read_contention", "file": args.file, "rows": rows}))


if __name__ == "__main__":
    main()
