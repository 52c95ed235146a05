#!/usr/bin/env python3
"""Tokenizer throughput: `moetrain tokenize` against Hugging Face tokenizers.

Same tokenizer (data/tokenizer.json), same documents, on two corpora:
  kjv     the demo corpus: the King James Bible, one document per chapter (4.3 MB
          of English prose, Debian's bible-kjv)
  random  4 MB of words drawn from 200,000 random letter strings (with accents), so
          few words repeat: the worst case for both tokenizers' word caches

Each is timed single-threaded and with every core:
  moetrain  `moetrain tokenize --workers 1|N` over the corpus split into 16 JSONL
            files, wall clock end to end: reading and parsing JSON, tokenizing,
            writing the .bin files
  hf        Tokenizer.encode(text) per document (one thread), and
            Tokenizer.encode_batch(texts) (Rust threads over all cores), the texts
            already in memory: tokenizing only, so the comparison favours HF

The best of --runs runs is kept. The ids are checked to be identical first.
With --record, a row per corpus is appended to bench/RESULTS.md.

Run: python3 bench/tokenizer_bench.py BUILD_DIR [--runs 3] [--record "MACHINE"]
     (needs: pip install tokenizers numpy)
"""
import argparse
import datetime
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np
from tokenizers import Tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "data"))
from make_kjv_corpus import GROUPS, chapters  # noqa: E402

TOKENIZER = os.path.join(ROOT, "data", "tokenizer.json")
FILES = 16


def kjv_docs():
    return [h + "\n\n" + "\n".join(v) + "\n" for _, a, b in GROUPS for h, v in chapters(a, b)]


def random_docs(total_bytes=4_000_000):
    rng = random.Random(7)
    letters = "abcdefghijklmnopqrstuvwxyzéüñ"
    pool = ["".join(rng.choices(letters, k=rng.randint(2, 12))) for _ in range(200_000)]
    docs, size = [], 0
    while size < total_bytes:
        d = " ".join(rng.choices(pool, k=rng.randint(100, 600))) + ".\n"
        docs.append(d)
        size += len(d.encode())
    return docs


def best(runs, f):
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        f()
        times.append(time.perf_counter() - t0)
    return min(times)


def bench(name, docs, binary, runs, cores):
    tmp = tempfile.mkdtemp(prefix="moetrain-bench-")
    try:
        src = os.path.join(tmp, "src")
        os.makedirs(src)
        for i in range(FILES):
            with open(os.path.join(src, f"part-{i:02d}.jsonl"), "w", encoding="utf-8") as f:
                for d in docs[i::FILES]:
                    f.write(json.dumps({"text": d}) + "\n")
        mbytes = sum(len(d.encode()) for d in docs) / 1e6
        hf = Tokenizer.from_file(TOKENIZER)
        eos = hf.token_to_id("<|endoftext|>")

        out = os.path.join(tmp, "out")

        def moetrain(workers):
            shutil.rmtree(out, ignore_errors=True)
            subprocess.run([binary, "tokenize", "--tokenizer", TOKENIZER, "--input", src, "--output", out,
                            "--workers", str(workers)], check=True, capture_output=True)

        # Same ids as Hugging Face, document by document, before any timing.
        moetrain(cores)
        for i in range(FILES):
            with open(os.path.join(out, f"part-{i:02d}.bin"), "rb") as f:
                got = np.load(f)
            want = [t for e in hf.encode_batch(docs[i::FILES]) for t in e.ids + [eos]]
            if got.tolist() != want:
                sys.exit(f"{name}: moetrain's ids differ from Hugging Face's in part-{i:02d}")
        tokens = sum(len(e.ids) for e in hf.encode_batch(docs))

        rows = []
        for threads in (1, cores):
            t_m = best(runs, lambda: moetrain(threads))
            if threads == 1:
                t_h = best(runs, lambda: [hf.encode(d) for d in docs])
            else:
                t_h = best(runs, lambda: hf.encode_batch(docs))
            rows.append((threads, t_m, t_h))
        return mbytes, tokens, rows
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("build")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--record", metavar="MACHINE", help="append the figures to bench/RESULTS.md")
    a = ap.parse_args()
    binary = os.path.join(os.path.abspath(a.build), "moetrain")
    cores = os.cpu_count()
    load = os.getloadavg()[0]  # other work on the machine slows both sides alike; say how much there was
    lines = []
    for name, docs in (("kjv", kjv_docs()), ("random", random_docs())):
        mbytes, tokens, rows = bench(name, docs, binary, a.runs, cores)
        parts = []
        for threads, t_m, t_h in rows:
            label = "1 thread" if threads == 1 else f"{threads} cores"
            print(f"{name:7s} {mbytes:5.2f} MB {tokens:>9,d} tokens  {label:8s}  "
                  f"moetrain {mbytes / t_m:6.2f} MB/s {tokens / t_m / 1e6:5.2f} Mtok/s   "
                  f"hf {mbytes / t_h:6.2f} MB/s {tokens / t_h / 1e6:5.2f} Mtok/s   ratio {t_h / t_m:4.2f}", flush=True)
            parts.append(f"{label}: moetrain {tokens / t_m / 1e6:.2f} Mtok/s ({mbytes / t_m:.1f} MB/s), "
                         f"HF {tokens / t_h / 1e6:.2f} Mtok/s ({mbytes / t_h:.1f} MB/s), x{t_h / t_m:.2f}")
        lines.append((f"tokenizer_bench {name} ({mbytes:.1f} MB, {tokens / 1e6:.2f}M tokens, vocab 4096)", "; ".join(parts) + f"; load average {load:.1f} at start"))
    if a.record:
        results = os.path.join(ROOT, "bench", "RESULTS.md")
        if not os.path.exists(results):
            with open(results, "w") as f:
                f.write("# Benchmark results\n\nRows are appended, never removed. Figures are those the benchmark "
                        "printed; the machine column says where it ran.\n\n"
                        "| date | commit | machine | benchmark | figures |\n| --- | --- | --- | --- | --- |\n")
        # -dirty: measured on a working tree with changes on top of that commit.
        commit = subprocess.run(["git", "-C", ROOT, "describe", "--always", "--dirty"], capture_output=True,
                                text=True).stdout.strip() or "unknown"
        with open(results, "a") as f:
            for bench_name, figures in lines:
                f.write(f"| {datetime.date.today()} | {commit} | {a.record} | {bench_name} | {figures} |\n")


if __name__ == "__main__":
    main()
