#!/usr/bin/env python3
"""`moetrain tokenize` from outside: the .bin files read back with numpy, a run
killed part-way and resumed, malformed lines reported.

- numpy: documents are the Hugging Face fixture texts (tests/fixtures/tokenizers/
  qwen_kjv.cases.json), so the expected tokens are Hugging Face's ids plus the
  end-of-document token; `np.load` twice on one open file must give the tokens
  (uint16 for a 4,096-id vocabulary) and the uint64 cumulative document ends.
- kill: a run over many files with one worker is SIGKILLed once its first file is
  complete and the second under way; the rerun must redo only the unfinished files
  and give files byte-identical to an uninterrupted run (with two workers).
- malformed lines: reported with file and line, counted, skipped; fatal with --strict.
- bad files (a corrupt and a truncated .jsonl.zst): reported, left without .bin, .tmp
  or .lock, named in the summary, exit status 1 after the good file is done (the same
  .bin as when it is tokenized alone); fatal with --strict.
- the output folder keeps a copy of the tokenizer.json; another tokenizer is refused there.

Run: test_tokenize.py MOETRAIN_BINARY
"""
import glob
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time

try:
    import numpy as np
except ImportError:  # the test set-up: numpy from PyPI when no Debian one is found
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "numpy"], check=True)
    import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
TOKENIZER = os.path.join(HERE, "..", "data", "tokenizer.json")
EOS = 0  # <|endoftext|> in data/tokenizer.json

failures = []
passed = 0


def check(ok, what):
    global passed
    if ok:
        passed += 1
    else:
        failures.append(what)
        print("FAIL:", what, flush=True)


def tokenize(binary, inputs, out, *extra):
    return subprocess.run([binary, "tokenize", "--tokenizer", TOKENIZER, "--input", *inputs, "--output", out, *extra],
                          capture_output=True, text=True)


def read_bin(path):
    with open(path, "rb") as f:
        tokens = np.load(f)
        ends = np.load(f)
        rest = f.read()
    return tokens, ends, rest


def test_numpy(binary, tmp):
    with open(os.path.join(HERE, "fixtures", "tokenizers", "qwen_kjv.cases.json"), encoding="utf-8") as f:
        cases = json.load(f)["cases"]
    src = os.path.join(tmp, "src")
    os.makedirs(os.path.join(src, "more"))
    files = {"one.jsonl": cases, "more/two.jsonl": cases[::-1] + cases[:3]}
    for name, docs in files.items():
        with open(os.path.join(src, name), "w", encoding="utf-8") as f:
            for d in docs:
                f.write(json.dumps({"text": d["text"], "meta": d["name"]}) + "\n")
    out = os.path.join(tmp, "out")
    r = tokenize(binary, [src], out)
    check(r.returncode == 0, f"tokenize exit {r.returncode}: {r.stderr}")
    summary = json.loads(r.stdout)
    check(summary["documents"] == sum(len(d) for d in files.values()) and summary["malformed"] == 0,
          f"summary {summary}")
    for name, docs in files.items():
        tokens, ends, rest = read_bin(os.path.join(out, name.replace(".jsonl", ".bin")))
        want = [i for d in docs for i in d["ids"] + [EOS]]
        check(tokens.dtype == np.uint16 and tokens.ndim == 1, f"{name}: tokens dtype {tokens.dtype}")
        check(ends.dtype == np.uint64 and ends.ndim == 1, f"{name}: ends dtype {ends.dtype}")
        check(tokens.tolist() == want, f"{name}: tokens differ from Hugging Face's ids")
        check(ends.tolist() == np.cumsum([len(d["ids"]) + 1 for d in docs]).tolist(), f"{name}: document ends")
        check(all(tokens[int(e) - 1] == EOS for e in ends), f"{name}: a document does not end with EOS")
        check(rest == b"", f"{name}: {len(rest)} bytes after the second array")


def make_many_files(src, count):
    """Files of different sizes, words drawn at random so that the tokenizer's word
    cache does not make the run too quick to interrupt."""
    rng = random.Random(5)
    letters = "abcdefghijklmnopqrstuvwxyzéü"
    pool = ["".join(rng.choices(letters, k=rng.randint(2, 12))) for _ in range(50000)]
    for i in range(count):
        docs = []
        for _ in range(20 + 2 * i):
            docs.append(json.dumps({"text": " ".join(rng.choices(pool, k=rng.randint(50, 200)))}))
        with open(os.path.join(src, f"part-{i:03d}.jsonl"), "w", encoding="utf-8") as f:
            f.write("\n".join(docs) + "\n")


def children_of(pid):
    kids = set()
    for task in glob.glob(f"/proc/{pid}/task/*/children"):
        try:
            with open(task) as f:
                kids.update(int(k) for k in f.read().split())
        except OSError:
            pass
    return kids


def state(pid):
    """The process's state letter (R, S, T, Z, ...), or None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return None


def alive(pid):
    return state(pid) not in (None, "Z")


def test_kill_and_resume(binary, tmp):
    src = os.path.join(tmp, "many")
    os.makedirs(src)
    n = 40
    make_many_files(src, n)
    ref = os.path.join(tmp, "ref")
    r = tokenize(binary, [src], ref, "--workers", "2")
    check(r.returncode == 0, f"reference run exit {r.returncode}: {r.stderr}")

    # The run is frozen (SIGSTOP, parent and workers) before its files are looked at, so
    # that what is seen is what the kill leaves: once one file is complete and the next
    # has its .lock, the frozen parent is killed; otherwise the run goes on (SIGCONT).
    # A run that finishes first is tried again in a fresh folder.
    for attempt in range(10):
        out = os.path.join(tmp, f"killed{attempt}")
        p = subprocess.Popen([binary, "tokenize", "--tokenizer", TOKENIZER, "--input", src, "--output", out,
                              "--workers", "1"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.time() + 60
        workers = set()
        while time.time() < deadline:
            p.send_signal(signal.SIGSTOP)  # the parent first: a stopped parent starts no worker
            workers |= children_of(p.pid)
            for pid in workers:
                try:
                    os.kill(pid, signal.SIGSTOP)
                except ProcessLookupError:
                    pass
            # kill() returns before the signal lands; wait until each one has stopped.
            while any(state(w) not in ("T", "Z", None) for w in [p.pid, *workers]):
                time.sleep(0.0005)
            if p.poll() is not None:
                break
            complete = [b for b in glob.glob(os.path.join(out, "*.bin")) if not os.path.exists(b + ".lock")]
            if complete and len(glob.glob(os.path.join(out, "*.lock"))) == 1:
                break
            for pid in [p.pid, *workers]:
                try:
                    os.kill(pid, signal.SIGCONT)
                except ProcessLookupError:
                    pass
            time.sleep(0.002)
        p.send_signal(signal.SIGKILL)
        p.wait()
        # The workers die with their parent (PR_SET_PDEATHSIG), stopped or not; wait until they have.
        while any(alive(w) for w in workers):
            time.sleep(0.01)
        complete = [b for b in glob.glob(os.path.join(out, "*.bin")) if not os.path.exists(b + ".lock")]
        locks = glob.glob(os.path.join(out, "*.lock"))
        if len(locks) == 1:
            break
    print(f"killed with {len(complete)} of {n} files complete, {len(locks)} in flight", flush=True)
    check(p.returncode == -signal.SIGKILL, f"the run ended before it was killed (exit {p.returncode})")
    check(1 <= len(complete) < n, f"killed part-way: {len(complete)} of {n} files complete")
    check(len(locks) == 1, f"the file in flight keeps its .lock, found {len(locks)} locks")

    r = tokenize(binary, [src], out, "--workers", "2")
    check(r.returncode == 0, f"rerun exit {r.returncode}: {r.stderr}")
    summary = json.loads(r.stdout or "{}")
    check(summary.get("files_skipped") == len(complete), f"rerun skipped {summary.get('files_skipped')} files, "
                                                         f"expected the {len(complete)} complete ones")
    names = sorted(os.listdir(ref))
    check(sorted(os.listdir(out)) == names and len(names) == n + 1, f"output files differ: {sorted(os.listdir(out))}")
    same = all(open(os.path.join(ref, x), "rb").read() == open(os.path.join(out, x), "rb").read() for x in names)
    check(same, "resumed files are not byte-identical to the uninterrupted run")


def test_malformed(binary, tmp):
    path = os.path.join(tmp, "bad.jsonl")
    with open(path, "w", encoding="utf-8") as f:
        f.write('{"text": "good"}\n{"text": broken}\n{"other": "x"}\n{"text": "fine", "n": 1}\n')
    r = tokenize(binary, [path], os.path.join(tmp, "bad"))
    check(r.returncode == 0, f"malformed lines must not stop the run: exit {r.returncode}: {r.stderr}")
    check(f"{path}:2: not valid JSON" in r.stderr, f"line 2 not reported: {r.stderr}")
    check(f'{path}:3: no string field "text"' in r.stderr, f"line 3 not reported: {r.stderr}")
    check(json.loads(r.stdout)["malformed"] == 2, f"malformed count: {r.stdout}")
    _, ends, _ = read_bin(os.path.join(tmp, "bad", "bad.bin"))
    check(len(ends) == 2, f"two good documents, found {len(ends)}")

    r = tokenize(binary, [path], os.path.join(tmp, "strict"), "--strict")
    check(r.returncode == 1 and f"{path}:2: not valid JSON" in r.stderr and "--strict" in r.stderr,
          f"--strict: exit {r.returncode}: {r.stderr}")
    # The corpus keeps its tokenizer; another tokenizer into the same folder is refused.
    same = open(os.path.join(tmp, "bad", "tokenizer.json"), "rb").read() == open(TOKENIZER, "rb").read()
    check(same, "the output folder holds a copy of the tokenizer.json")
    other = os.path.join(tmp, "other.json")
    with open(other, "w") as f:
        f.write(open(TOKENIZER).read().replace('"<|im_end|>"', '"<|im_stop|>"'))
    r = subprocess.run([binary, "tokenize", "--tokenizer", other, "--input", path,
                        "--output", os.path.join(tmp, "bad")], capture_output=True, text=True)
    check(r.returncode == 1 and "tokenized with another tokenizer" in r.stderr, f"another tokenizer: {r.stderr}")
    r = tokenize(binary, [path], os.path.join(tmp, "w"), "--workers", "two")
    check(r.returncode == 1 and "--workers should be an integer in [0, 4096], got 'two'" in r.stderr, f"--workers two: {r.stderr}")
    r = tokenize(binary, [path], os.path.join(tmp, "field"), "--field", "other")
    check(r.returncode == 0 and json.loads(r.stdout)["documents"] == 1, f"--field other: {r.stdout} {r.stderr}")


def test_bad_files(binary, tmp):
    src = os.path.join(tmp, "mixed")
    os.makedirs(src)
    good = os.path.join(src, "good.jsonl")
    with open(good, "w", encoding="utf-8") as f:
        for i in range(50):
            f.write(json.dumps({"text": f"{i}: In the beginning God created the heaven and the earth."}) + "\n")
    packed = subprocess.run(["zstd", "-q", "-c", good], capture_output=True, check=True).stdout
    rng = random.Random(3)
    bad = {"corrupt": packed[:4] + bytes(rng.randrange(256) for _ in range(2000)),  # zstd's magic, then noise
           "truncated": packed[:len(packed) // 2]}
    for name, data in bad.items():
        with open(os.path.join(src, name + ".jsonl.zst"), "wb") as f:
            f.write(data)
    out = os.path.join(tmp, "mixed-out")
    r = tokenize(binary, [src], out, "--workers", "2")
    check(r.returncode == 1, f"bad files: exit {r.returncode}, expected 1: {r.stderr}")
    alone = os.path.join(tmp, "alone")
    check(tokenize(binary, [good], alone).returncode == 0, "good.jsonl alone")
    same = open(os.path.join(out, "good.bin"), "rb").read() == open(os.path.join(alone, "good.bin"), "rb").read()
    check(same, "good.bin differs from tokenizing good.jsonl alone")
    left = [x for x in os.listdir(out) if x.startswith(tuple(bad))]
    check(left == [], f"bad files left {left} (no .bin, .tmp or .lock expected)")
    for name in bad:
        line = [x for x in r.stderr.splitlines() if f"skipped a bad file: {os.path.join(src, name)}.jsonl.zst" in x]
        check(len(line) == 1 and "zstd" in line[0], f"{name} not reported: {r.stderr}")
    summary = [x for x in r.stderr.splitlines() if "skipped 2 bad files" in x]
    check(len(summary) == 1 and all(os.path.join(src, n) + ".jsonl.zst" in summary[0] for n in bad),
          f"no summary naming the bad files: {r.stderr}")
    check(json.loads(r.stdout or "{}").get("bad_files") == 2, f"summary {r.stdout}")
    r = tokenize(binary, [src], os.path.join(tmp, "mixed-strict"), "--strict")
    check(r.returncode == 1 and "zstd" in r.stderr and r.stdout == "", f"--strict: exit {r.returncode}: {r.stderr}")


def main():
    binary = os.path.abspath(sys.argv[1])
    tmp = tempfile.mkdtemp(prefix="moetrain-test-tokenize-")
    try:
        for test in (test_numpy, test_kill_and_resume, test_malformed, test_bad_files):
            t0 = time.time()
            before = len(failures)
            test(binary, tmp)
            print(f"{test.__name__}: {'ok' if len(failures) == before else 'FAILED'} ({time.time() - t0:.1f} s)",
                  flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"tokenize: {passed} passed, {len(failures)} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
