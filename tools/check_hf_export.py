#!/usr/bin/env python3
"""Loads a `moetrain export-hf` folder with transformers and prints its loss on a
token matrix, in the same JSON form as `moetrain eval`, to compare the two.

  python3 tools/check_hf_export.py --model EXPORT_DIR --tokens batch.npy [--device cpu|cuda]

The token matrix is [B, T] (int32 or int64): inputs are columns 0..T-2 and labels
columns 1..T-1; the loss is the mean cross-entropy over all B*(T-1) positions.
Runs in fp32 with eager attention so the figures are comparable to moetrain's CPU
backend.
"""
import argparse
import json

import numpy as np
import torch
from transformers import AutoModelForCausalLM


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--tokens", required=True)
    p.add_argument("--device", default="cpu")
    args = p.parse_args()
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32, attn_implementation="eager")
    if hasattr(model, "set_experts_implementation"):
        model.set_experts_implementation("eager")
    model.to(args.device).eval()
    tokens = torch.from_numpy(np.load(args.tokens).astype(np.int64)).to(args.device)
    with torch.no_grad():
        logits = model(input_ids=tokens[:, :-1]).logits.float()
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
    print(json.dumps({"loss": loss.item(), "tokens": int(tokens[:, 1:].numel())}))


if __name__ == "__main__":
    main()
