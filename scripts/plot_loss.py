#!/usr/bin/env python3
"""Draws metrics.jsonl's loss curve as an SVG, with no plotting library.

  python3 scripts/plot_loss.py RUN/metrics.jsonl OUT.svg
"""
import json
import sys


def main(metrics_path, out_path):
    steps, losses = [], []
    with open(metrics_path) as f:
        for line in f:
            m = json.loads(line)
            steps.append(m["step"])
            losses.append(m["loss"])
    if not steps:
        raise SystemExit(f"{metrics_path}: no steps")
    w, h, pad = 640, 360, 48
    lo, hi = min(losses), max(losses)
    span = (hi - lo) or 1.0
    last = max(steps[-1], 2)

    def x(s):
        return pad + (s - 1) / (last - 1) * (w - 2 * pad)

    def y(v):
        return h - pad - (v - lo) / span * (h - 2 * pad)

    points = " ".join(f"{x(s):.1f},{y(v):.1f}" for s, v in zip(steps, losses))
    svg = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" font-size="12">',
           f'<rect width="{w}" height="{h}" fill="white"/>',
           f'<line x1="{pad}" y1="{h-pad}" x2="{w-pad}" y2="{h-pad}" stroke="black"/>',
           f'<line x1="{pad}" y1="{pad}" x2="{pad}" y2="{h-pad}" stroke="black"/>',
           f'<text x="{pad}" y="{pad-12}">training loss (moetrain)</text>',
           f'<text x="{w-pad}" y="{h-pad+20}" text-anchor="end">step {steps[-1]}</text>',
           f'<text x="{pad-6}" y="{y(hi)+4:.1f}" text-anchor="end">{hi:.2f}</text>',
           f'<text x="{pad-6}" y="{y(lo)+4:.1f}" text-anchor="end">{lo:.2f}</text>',
           f'<polyline fill="none" stroke="#1f77b4" stroke-width="2" points="{points}"/>',
           "</svg>"]
    with open(out_path, "w") as f:
        f.write("\n".join(svg) + "\n")
    print(f"loss {losses[0]:.3f} at step {steps[0]} -> {losses[-1]:.3f} at step {steps[-1]}; plot: {out_path}")


if __name__ == "__main__":
    main(*sys.argv[1:3])
