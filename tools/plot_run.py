#!/usr/bin/env python3
"""Plots a moetrain run folder's metrics.jsonl with matplotlib (Debian's
python3-matplotlib, which scripts/setup.sh installs):

  python3 tools/plot_run.py RUN_DIR [--output DIR]      (default DIR: RUN_DIR/plots)

writes, each as .png and .svg:
  metrics      loss, learning rate, gradient norm and tokens/s against step
  expert_load  (a run with MoE layers) the most loaded expert's tokens over the mean,
               per layer, against step; then per MoE layer a heatmap, expert against
               step, of each expert's tokens over the layer's mean (1 = balanced)
and prints one line per file written.
"""
import argparse
import json
import math
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

plt.rcParams["svg.fonttype"] = "none"  # text stays text in the SVG


def read_metrics(run):
    path = os.path.join(run, "metrics.jsonl")
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    if not rows:
        raise SystemExit(f"{path}: no steps")
    return rows


def save(fig, out, name):
    for ext in ("png", "svg"):
        path = os.path.join(out, f"{name}.{ext}")
        fig.savefig(path, dpi=110)
        print(path)
    plt.close(fig)


def plot_metrics(rows, out, title):
    steps = [r["step"] for r in rows]
    fig, axes = plt.subplots(2, 2, figsize=(11, 7), sharex=True, layout="constrained")
    panels = [("loss", "loss (cross-entropy)", False), ("lr", "learning rate", False),
              ("grad_norm", "gradient norm (before clipping)", True), ("tokens_per_s", "tokens/s", False)]
    for ax, (key, label, log) in zip(axes.flat, panels):
        ax.plot(steps, [r[key] for r in rows], color="#1f77b4", linewidth=1.5)
        ax.set_title(label)
        ax.set_ylabel(key)
        if log and min(r[key] for r in rows) > 0:
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
    for ax in axes[1]:
        ax.set_xlabel("step")
    fig.suptitle(title)
    save(fig, out, "metrics")


def plot_expert_load(rows, out, title):
    counts = [r["expert_counts"] for r in rows]  # [step][moe layer][expert]
    layers = rows[-1].get("moe_layers", list(range(len(counts[-1]))))
    if not layers:
        return
    steps = [r["step"] for r in rows]
    # load[l][e][s]: expert e's tokens over the mean of its layer at step s
    load = []
    for i in range(len(layers)):
        per_step = []
        for c in counts:
            mean = sum(c[i]) / len(c[i])
            per_step.append([n / mean if mean > 0 else 0.0 for n in c[i]])
        load.append([list(col) for col in zip(*per_step)])
    cols = min(4, len(layers) + 1)
    nrows = math.ceil((len(layers) + 1) / cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(4.2 * cols, 3.2 * nrows), squeeze=False, layout="constrained")
    ax = axes[0][0]
    for i, layer in enumerate(layers):
        ax.plot(steps, [max(s) for s in zip(*load[i])], label=f"layer {layer}")
    ax.axhline(1.0, color="grey", linewidth=0.8, linestyle="--")
    ax.set_title("max / mean expert load")
    ax.set_xlabel("step")
    ax.set_ylabel("max over mean")
    ax.grid(alpha=0.3)
    if len(layers) <= 12:
        ax.legend(fontsize=7)
    top = max(max(max(row) for row in m) for m in load)
    image = None
    for i, layer in enumerate(layers):
        ax = axes.flat[i + 1]
        image = ax.imshow(load[i], aspect="auto", origin="lower", cmap="viridis", vmin=0, vmax=max(top, 1.0),
                          extent=(steps[0] - 0.5, steps[-1] + 0.5, -0.5, len(load[i]) - 0.5), interpolation="nearest")
        ax.set_title(f"layer {layer}: tokens per expert / mean")
        ax.set_xlabel("step")
        ax.set_ylabel("expert")
    for ax in axes.flat[len(layers) + 1:]:
        ax.axis("off")
    fig.suptitle(title)
    fig.colorbar(image, ax=axes.flat[1:len(layers) + 1], shrink=0.8, label="load (1 = balanced)")
    save(fig, out, "expert_load")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("run", help="a run folder (job.dump_folder) holding metrics.jsonl")
    p.add_argument("--output", help="where the plots go (default: RUN/plots)")
    a = p.parse_args()
    out = a.output or os.path.join(a.run, "plots")
    os.makedirs(out, exist_ok=True)
    rows = read_metrics(a.run)
    title = f"{os.path.basename(os.path.abspath(a.run))}: steps {rows[0]['step']}-{rows[-1]['step']}"
    plot_metrics(rows, out, title)
    plot_expert_load(rows, out, title)


if __name__ == "__main__":
    main()
