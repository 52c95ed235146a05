#!/usr/bin/env bash
# The demo: build, then train a tiny Qwen3-style MoE on a bundled corpus, export it
# to Hugging Face format and plot the run.
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
# Train from scratch on the corpus (resuming if a previous demo run was interrupted),
# export the result as a Hugging Face folder (the corpus's tokenizer travels with it),
# continue a prompt with it, and plot the run.
run="$demo/run"
"$bin" train --config "$root/configs/demo.toml" --data.corpus="$demo/corpus" --job.dump_folder="$run" \
  --metrics.tensorboard=true
"$bin" export-hf --checkpoint "$run" --output "$demo/hf" --dtype bf16 --force
"$bin" generate --model "$demo/hf" --prompt "In the beginning" --max-new-tokens 24
# matplotlib is Debian's (setup.sh), for the system python3 unless the first one has it.
py=python3
python3 -c 'import matplotlib' 2>/dev/null || py=/usr/bin/python3
"$py" "$root/tools/plot_run.py" "$run" --output "$demo/plots"
echo "demo: done. Hugging Face model: $demo/hf (with tokenizer.json); metrics: $run/metrics.jsonl;" \
  "plots: $demo/plots; TensorBoard: tensorboard --logdir $run/tb"
