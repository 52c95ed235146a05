#!/usr/bin/env python3
"""Writes the demo corpus: the King James Bible as JSONL, one document per chapter.

The text comes from Debian's bible-kjv-text package (read through its `bible`
program, package bible-kjv); the translation dates from 1611 and is in the public
domain (see /usr/share/doc/bible-kjv-text/copyright). Nothing is downloaded.

The 1,189 chapters are grouped into seven files of different sizes, so a
`moetrain tokenize` run has several files to spread over its workers. Five are
zstd-compressed (.jsonl.zst, through the zstd program) and two are left as plain
.jsonl, so both input kinds are exercised. About 4.3 MB of text, 1.4 MB on disk.

Run: python3 data/make_kjv_corpus.py OUTDIR
"""
import json
import os
import re
import subprocess
import sys

# (file name, first book, last book) as `bible` spells them in verse specs.
GROUPS = [
    ("law.jsonl.zst", "Gen", "Deu"),
    ("history.jsonl.zst", "Jos", "Est"),
    ("wisdom.jsonl", "Job", "Sol"),
    ("prophets.jsonl.zst", "Isa", "Mal"),
    ("gospels.jsonl.zst", "Mat", "Act"),
    ("letters.jsonl.zst", "Rom", "Jude"),
    ("revelation.jsonl", "Rev", "Rev"),
]

HEADING = re.compile(r"^(?:[1-3] )?[A-Z][A-Za-z ]+ \d+$")


def chapters(first, last):
    """Yields (heading, text) per chapter of the books first..last."""
    # -l100000: one verse per line (no wrapping); -m: enough buffer for a whole testament.
    out = subprocess.run(["bible", "-m", "8192", "-l100000", f"{first}1:1-{last}999:999"],
                         check=True, capture_output=True, text=True).stdout
    heading, verses = None, []
    for line in out.splitlines():
        line = line.strip()
        if not line:
            continue
        if HEADING.match(line):
            if heading:
                yield heading, verses
            heading, verses = line, []
        else:
            verses.append(line)
    if heading:
        yield heading, verses


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    outdir = sys.argv[1]
    os.makedirs(outdir, exist_ok=True)
    total = 0
    for name, first, last in GROUPS:
        plain = os.path.join(outdir, name.removesuffix(".zst"))
        with open(plain, "w", encoding="utf-8") as f:
            for heading, verses in chapters(first, last):
                f.write(json.dumps({"text": heading + "\n\n" + "\n".join(verses) + "\n"}) + "\n")
                total += 1
        if name.endswith(".zst"):
            subprocess.run(["zstd", "-q", "-f", "-19", "--rm", plain, "-o", os.path.join(outdir, name)], check=True)
    if total != 1189:
        sys.exit(f"make_kjv_corpus: expected 1189 chapters, found {total}; is bible-kjv installed?")
    print(f"make_kjv_corpus: {total} chapters in {len(GROUPS)} files under {outdir}")


if __name__ == "__main__":
    main()
