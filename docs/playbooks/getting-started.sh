#!/usr/bin/env bash
# Getting started (getting-started.md): tokenize, train, export, generate.
source "$(dirname "$0")/lib.sh"
tiny_model "$work/model"
tiny_text "$work/text"
"$bin" tokenize --tokenizer "$root/data/tokenizer.json" --input "$work/text" --output "$work/corpus"
train_tiny "$work/run" "$work/corpus" 30
read -r first last < <(first_last_loss "$work/run/metrics.jsonl")
python3 -c "import sys; sys.exit(0 if $last < $first - 1.0 else 1)" || fail "loss fell only from $first to $last"
"$bin" export-hf --checkpoint "$work/run" --output "$work/hf"
[ -f "$work/hf/tokenizer.json" ] || fail "the export has no tokenizer.json"
out="$("$bin" generate --model "$work/hf" --prompt "The river" --max-new-tokens 8)"
ids="$(tail -n 1 <<< "$out")"
[[ "$ids" =~ ^\[[0-9]+(,\ ?[0-9]+){7}\]$ ]] || fail "generate's last line is not 8 ids: $ids"
pass "loss $first -> $last; generated $ids"
