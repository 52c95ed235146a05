#!/usr/bin/env bash
# Train on your own data (own-data.md): jsonl and jsonl.zst files in a folder, one
# document a line in a "text" field (--field picks another), a config file of your own.
source "$(dirname "$0")/lib.sh"
tiny_model "$work/model"
tiny_text "$work/text"
echo '{"body": "a line with no text field"}' >> "$work/text/a.jsonl"
"$bin" tokenize --tokenizer "$root/data/tokenizer.json" --input "$work/text" --output "$work/corpus" \
  > "$work/tokenize.log" 2>&1
ls "$work/corpus"/*.bin > /dev/null || fail "tokenize wrote no .bin files"
# A config file: relative paths in it are taken against its own folder.
cat > "$work/my.toml" <<TOML
[model]
config = "model/config.json"
[data]
corpus = "corpus"
seq_len = 32
[training]
steps = 20
global_batch_size = 4
[optimizer]
lr = 3e-3
[job]
dump_folder = "run"
TOML
(cd / && "$bin" train --config "$work/my.toml" --print-config) | grep -q "corpus = '$work/corpus'" ||
  fail "--print-config does not show the corpus resolved against the config's folder"
(cd / && "$bin" train --config "$work/my.toml")
read -r first last < <(first_last_loss "$work/run/metrics.jsonl")
python3 -c "import sys; sys.exit(0 if $last < $first else 1)" || fail "loss did not fall: $first -> $last"
pass "$(ls "$work/corpus"/*.bin | wc -l) .bin files; loss $first -> $last"
