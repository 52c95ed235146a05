#!/usr/bin/env python3
"""`moetrain encode` against the Hugging Face fixtures (tests/fixtures/tokenizers).

Every case is encoded from standard input (byte for byte); cases whose text can be
an argument (no NUL byte) are also encoded with --text. Both must print exactly the
ids Hugging Face tokenizers gave. Also: errors name the problem.

Run: test_encode.py MOETRAIN_BINARY
"""
import glob
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
FIXTURES = os.path.join(HERE, "fixtures", "tokenizers")


def encode(binary, tokenizer, text=None, stdin=None):
    args = [binary, "encode", "--tokenizer", tokenizer] + ([] if text is None else ["--text", text])
    r = subprocess.run(args, input=stdin, capture_output=True)
    if r.returncode != 0:
        raise RuntimeError(f"exit {r.returncode}: {r.stderr.decode(errors='replace')}")
    return json.loads(r.stdout)


def main():
    binary = sys.argv[1]
    failures, checked = [], 0
    for path in sorted(glob.glob(os.path.join(FIXTURES, "*.cases.json"))):
        with open(path, encoding="utf-8") as f:
            fixture = json.load(f)
        name = os.path.basename(path).removesuffix(".cases.json")
        tokenizer = os.path.normpath(os.path.join(os.path.dirname(FIXTURES), fixture["tokenizer"]))
        for case in fixture["cases"]:
            ways = [("stdin", dict(stdin=case["text"].encode("utf-8")))]
            if "\0" not in case["text"]:
                ways.append(("--text", dict(text=case["text"], stdin=b"")))
            for way, kw in ways:
                checked += 1
                try:
                    got = encode(binary, tokenizer, **kw)
                except RuntimeError as e:
                    failures.append(f"{name}/{case['name']} ({way}): {e}")
                    continue
                if got != case["ids"]:
                    first = next((i for i, (a, b) in enumerate(zip(got, case["ids"])) if a != b),
                                 min(len(got), len(case["ids"])))
                    failures.append(f"{name}/{case['name']} ({way}): ids differ from Hugging Face at {first}: "
                                    f"got {got[first:first + 8]}, expected {case['ids'][first:first + 8]} "
                                    f"({len(got)} vs {len(case['ids'])} ids)")

    # Invalid UTF-8 on standard input is an error that gives the byte offset.
    qwen = os.path.join(HERE, "..", "data", "tokenizer.json")
    r = subprocess.run([binary, "encode", "--tokenizer", qwen], input=b"ok \xff\xfe", capture_output=True)
    checked += 1
    if r.returncode == 0 or b"not valid UTF-8 at byte 3" not in r.stderr:
        failures.append(f"invalid UTF-8: exit {r.returncode}, stderr {r.stderr!r}")

    for f in failures:
        print("FAIL:", f)
    print(f"encode: {checked - len(failures)} passed, {len(failures)} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
