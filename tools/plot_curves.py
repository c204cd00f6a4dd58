#!/usr/bin/env python3
"""Plots training and validation loss curves from `moecore train --metrics-jsonl` files into a PNG
(matplotlib's Agg backend: no display needed; Debian's python3-matplotlib).

Usage: plot_curves.py [--title T] [--xlabel X] OUT.png RUN...
  RUN is "label=metrics.jsonl" (several compare runs) or a bare metrics.jsonl (one run, unlabelled).
Training loss is the `lm_loss` of each logged iteration, validation loss the `valid_lm_loss` records.
The JSONL is appended to by every run: an iteration logged again (a resumed run repeating the steps after
its checkpoint, or a fresh run starting over at 1) replaces what the file held from that iteration on.
Prints each run's last validation loss."""
import argparse
import json

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def _append(points, it, value):
    while points and points[-1][0] >= it:  # a later run redoes this iteration: drop the older tail
        points.pop()
    points.append((it, value))


def read(path):
    train, valid = [], []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                r = json.loads(line)
            except json.JSONDecodeError as e:
                raise SystemExit(f"plot_curves: {path}:{n}: not JSON ({e})")
            it = r.get("iteration")
            if it is None:
                continue
            if "valid_lm_loss" in r:
                _append(valid, it, r["valid_lm_loss"])
            elif "lm_loss" in r:
                # A new training record at iteration i also supersedes old validations from i on.
                while valid and valid[-1][0] >= it:
                    valid.pop()
                _append(train, it, r["lm_loss"])  # null (NaN/Inf) stays a gap in the curve
    return [(i, v if v is not None else float("nan")) for i, v in train], valid


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", help="PNG to write")
    ap.add_argument("runs", nargs="+", help='"label=metrics.jsonl" or metrics.jsonl')
    ap.add_argument("--title", default="loss curves")
    ap.add_argument("--xlabel", default="iteration")
    args = ap.parse_args()

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for spec in args.runs:
        label, path = spec.split("=", 1) if "=" in spec else ("", spec)
        train, valid = read(path)
        if not train and not valid:
            raise SystemExit(f"plot_curves: {path} holds no lm_loss or valid_lm_loss records")
        prefix = f"{label}: " if label else ""
        color = None
        if valid:
            (line,) = ax.plot(*zip(*valid), marker="o", label=f"{prefix}validation")
            color = line.get_color()
            print(f"{label or path}: final validation loss {valid[-1][1]:.4f} at iteration {valid[-1][0]}")
        if train:
            (line,) = ax.plot(*zip(*train), color=color, alpha=0.45 if valid else 1.0, label=f"{prefix}training")
    ax.set_xlabel(args.xlabel)
    ax.set_ylabel("cross-entropy loss (nats)")
    ax.set_title(args.title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)


if __name__ == "__main__":
    main()
