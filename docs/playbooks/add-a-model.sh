#!/usr/bin/env bash
# Add a new model (add-a-model.md): the check a new family must pass before anything
# else, run on every family there is: moetrain's loss on each fixture (a tiny random
# model written by transformers, tests/fixtures/make_hf_fixtures.py) equals the loss
# transformers computed for it (tests/fixtures/generation.log) within 1e-5.
source "$(dirname "$0")/lib.sh"
fx="$root/tests/fixtures"
checked=""
while read -r model _ _ _ want _; do
  [ -f "$fx/$model/tokens.npy" ] || continue
  got="$("$bin" eval --model "$fx/$model" --tokens "$fx/$model/tokens.npy" | python3 -c 'import json,sys; print(json.load(sys.stdin)["loss"])')"
  python3 -c "import sys; sys.exit(0 if abs($got - $want) <= 1e-5 * $want else 1)" ||
    fail "$model: moetrain's loss $got, transformers' $want"
  checked="$checked $model"
done < <(grep -E '^[a-z0-9_]+ keys [0-9]+ loss ' "$fx/generation.log")
[ -n "$checked" ] || fail "no fixture losses found in $fx/generation.log"
pass "losses equal transformers' for$checked"
