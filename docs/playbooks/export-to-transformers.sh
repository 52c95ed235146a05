#!/usr/bin/env bash
# Export and load in transformers (export-to-transformers.md): the export's loss under
# moetrain eval equals the checkpoint's; with transformers installed (set PYTHON to a
# python3 that has it), transformers' loss on the same tokens too.
source "$(dirname "$0")/lib.sh"
fx="$root/tests/fixtures/qwen3_moe_a"
"$bin" train --model.init="hf:$fx" --data.tokens="$fx/tokens.npy" --training.steps=3 --job.dump_folder="$work/run" > /dev/null
"$bin" export-hf --checkpoint "$work/run" --output "$work/hf" --dtype fp32 > /dev/null
ours="$("$bin" eval --model "$work/hf" --tokens "$fx/tokens.npy")"
py="${PYTHON:-python3}"
if "$py" -c 'import transformers, torch' 2>/dev/null; then
  theirs="$("$py" "$root/tools/check_hf_export.py" --model "$work/hf" --tokens "$fx/tokens.npy" | tail -n 1)"
  python3 -c "import json,sys; a=json.loads('$ours')['loss']; b=json.loads('$theirs')['loss']; sys.exit(0 if abs(a-b) <= 2e-6*abs(b) else 1)" ||
    fail "moetrain $ours against transformers $theirs"
  pass "moetrain $ours, transformers $theirs"
fi
[ -f "$work/hf/config.json" ] && [ -f "$work/hf/model.safetensors" ] || fail "the export lacks config.json or model.safetensors"
pass "moetrain eval of the export: $ours (transformers not installed for $py: not compared)"
