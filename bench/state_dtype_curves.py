#!/usr/bin/env python3
"""fp32 against bf16 AdamW moments (or bf16 against FP8 products, --families fp8): the
same training run several times.

One perturbation the size of a rounding sends a run onto another trajectory, so a
single pair of runs says little. This trains a small Qwen3-MoE (bench/configs/
kjv_moe_mid.json: 8 layers, 32 experts, top-4) on a tokenized corpus with each state
dtype at the base learning rate and at +-1e-3 relative, and with beta2 = 0.999 (where
rounding to nearest would stall the second moment), and prints each run's mean loss
over its last quarter and each family's mean and spread.

  python3 bench/state_dtype_curves.py --moetrain build/moetrain --corpus build/demo/corpus [--device cuda]
  python3 bench/state_dtype_curves.py ... --families fp8 --steps 600 --beta2 0.95

With --families fp8 the families are training.fp8 = none and blockwise (fp32 moments),
three runs each at lr and lr x (1 +- 1e-3) for the first beta2.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))


def run(args, tmp, name, extra):
    dump = os.path.join(tmp, name)
    cmd = [args.moetrain, "train", f"--model.config={args.config}", f"--data.corpus={args.corpus}",
           f"--data.seq_len={args.seq}", f"--training.global_batch_size={args.batch}",
           f"--training.steps={args.steps}", f"--training.device={args.device}", "--training.load_balance_coef=0.01",
           "--lr_scheduler.warmup_steps=20", "--lr_scheduler.decay=cosine", "--lr_scheduler.min_lr_ratio=0.1",
           "--checkpoint.save_final=false", f"--job.dump_folder={dump}", *extra]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"{name} failed:\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}")
    losses = [json.loads(l)["loss"] for l in open(os.path.join(dump, "metrics.jsonl"))]
    return statistics.mean(losses[-len(losses) // 4:])


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--moetrain", required=True)
    p.add_argument("--corpus", required=True)
    p.add_argument("--config", default=os.path.join(HERE, "configs", "kjv_moe_mid.json"))
    p.add_argument("--device", default="cuda")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--beta2", type=float, nargs="*", default=[0.95, 0.999],
                   help="the beta2 values; the first gets three runs per dtype, the others one, "
                        "unless --perturb-all")
    p.add_argument("--perturb-all", action="store_true", help="three runs per dtype for every beta2")
    p.add_argument("--families", default="state", choices=("state", "fp8"),
                   help="state: fp32 against bf16 moments; fp8: training.fp8 none against blockwise")
    args = p.parse_args()
    if args.families == "fp8":
        kinds = [("bf16 products", "--training.fp8=none"), ("fp8 products", "--training.fp8=blockwise")]
    else:
        kinds = [(f"{s} moments", f"--optimizer.state_dtype={s}") for s in ("fp32", "bf16")]
    families = {}
    with tempfile.TemporaryDirectory() as tmp:
        for beta2 in args.beta2:
            for kind, flag in kinds:
                rels = (0.0, 1e-3, -1e-3) if beta2 == args.beta2[0] or args.perturb_all else (0.0,)
                for rel in rels:
                    name = f"{kind.replace(' ', '_')}_b{beta2}_lr{rel:+g}"
                    loss = run(args, tmp, name, [flag, f"--optimizer.beta2={beta2}",
                                                 f"--optimizer.lr={args.lr * (1 + rel)!r}"])
                    families.setdefault((kind, beta2), []).append(loss)
                    print(f"{name}: mean loss over the last quarter {loss:.4f}", flush=True)
    for (kind, beta2), v in families.items():
        spread = max(v) - min(v)
        print(f"{kind}, beta2 {beta2}: mean {statistics.mean(v):.4f} over {len(v)} runs, spread {spread:.4f}")


if __name__ == "__main__":
    main()
