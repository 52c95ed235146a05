#!/usr/bin/env bash
# The demo: build, then train a tiny Qwen3-style MoE on a bundled corpus, export it
# to Hugging Face format and plot the loss. The data and model pieces land in later
# milestones; until then the demo checks the build and says what is missing.
set -euo pipefail
build="${1:-build}"
bin="$build/moetrain"
"$bin" --version
# The corpus: the King James Bible from Debian's bible-kjv, one JSON document per
# chapter in seven .jsonl(.zst) files, tokenized with the bundled data/tokenizer.json
# (a rerun finds the .bin files done and skips them).
root="$(cd "$(dirname "$0")/.." && pwd)"
demo="$build/demo"
if [ ! -d "$demo/kjv" ]; then
  rm -rf "$demo/kjv.tmp"
  python3 "$root/data/make_kjv_corpus.py" "$demo/kjv.tmp"
  mv "$demo/kjv.tmp" "$demo/kjv"
fi
"$bin" tokenize --tokenizer "$root/data/tokenizer.json" --input "$demo/kjv" --output "$demo/corpus" >/dev/null
for cmd in train export-hf; do
  if ! "$bin" "$cmd" >/dev/null 2>"$build/demo-$cmd.err"; then
    if grep -q "not built yet" "$build/demo-$cmd.err"; then
      echo "demo: stopping before '$cmd': $(sed 's/^moetrain [a-z-]*: //' "$build/demo-$cmd.err")"
      echo "demo: the build works and the corpus is tokenized ($demo/corpus); the rest is still to come (see README.md)."
      exit 0
    fi
  fi
done
