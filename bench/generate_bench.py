#!/usr/bin/env python3
"""`moetrain generate --offload-experts N` on the GPU: tokens/s and the expert cache's
hit rate with a share of the experts' slots on the device, against all of them.

The model is Qwen3-30B-A3B cut to --layers (bench/configs), with transformers' random
initialization (bf16, saved once to a temporary folder): its routing is a random
model's, less skewed than a trained one's, so the hit rates are a floor. generate has
no KV cache: each new token runs the whole sequence again, so a layer's pass reaches
the experts of every position so far, not only the new token's k.

  python3 bench/generate_bench.py --moetrain build-cuda/moetrain --layers 8 --shares 1,0.5,0.1
"""
import argparse
import json
import os
import re
import subprocess
import tempfile

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--moetrain", required=True)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--prompt", type=int, default=8, help="prompt tokens (random ids)")
    p.add_argument("--new", type=int, default=32, help="new tokens")
    p.add_argument("--shares", default="1,0.5,0.1", help="shares of all experts' slots on the device")
    args = p.parse_args()
    cfg = json.load(open(os.path.join(HERE, "configs", "qwen3_30b_a3b.json")))
    cfg["num_hidden_layers"] = args.layers
    experts = cfg["num_experts"] * args.layers
    from transformers import AutoConfig, AutoModelForCausalLM
    with tempfile.TemporaryDirectory() as tmp:
        json.dump(cfg, open(os.path.join(tmp, "config.json"), "w"))
        torch.manual_seed(0)
        with torch.device("cuda"):
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tmp), dtype=torch.bfloat16)
        model.save_pretrained(tmp)
        del model
        torch.cuda.empty_cache()
        ids = ",".join(str(i) for i in np.random.default_rng(0).integers(0, cfg["vocab_size"], args.prompt))
        print(f"{torch.cuda.get_device_name()}: Qwen3-30B-A3B, {args.layers} layers ({experts} routed experts), "
              f"random weights; prompt {args.prompt} tokens, {args.new} new, greedy", flush=True)
        tokens = None
        # The first run compiles cuDNN's attention for each sequence length (the JIT
        # cache keeps them for the later runs): not counted.
        shares = [float(s) for s in args.shares.split(",")]
        for i, share in enumerate([shares[0]] + shares):
            slots = max(1, round(share * experts))
            cmd = [args.moetrain, "generate", "--model", tmp, "--device", "cuda", "--prompt-ids", ids,
                   "--max-new-tokens", str(args.new), "--temperature", "0", "--offload-experts", str(slots)]
            out = subprocess.run(cmd, capture_output=True, text=True)
            if out.returncode != 0:
                raise RuntimeError(f"moetrain failed ({out.returncode}):\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
            if i == 0:
                continue
            got = out.stdout.strip().splitlines()[-1]
            same = "" if tokens is None else (", the same tokens" if got == tokens else ", OTHER TOKENS")
            tokens = tokens or got
            tps = float(re.search(r"\(([\d.]+) tokens/s\)", out.stderr).group(1))
            used, found, loaded = (int(x) for x in re.search(
                r"(\d+) experts used, (\d+) of them .* (\d+) loaded", out.stderr).groups())
            gb, wait = (float(x) for x in re.search(r"([\d.]+) GB copied in, ([\d.]+) s waited", out.stderr).groups())
            secs = args.new / tps
            print(f"| {share:.0%} of the slots ({slots}) | {tps:.2f} tok/s | hit rate {found / max(used, 1):.3f} "
                  f"({found} of {used}) | {loaded} loaded, {gb:.1f} GB in, {gb / secs:.1f} GB/s over the run | "
                  f"waited {wait:.2f} s of {secs:.2f} s{same} |", flush=True)


if __name__ == "__main__":
    main()
