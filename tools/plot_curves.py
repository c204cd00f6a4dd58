#!/usr/bin/env python3
"""Plots validation (and training) loss curves from `moecore train --metrics-jsonl` files.
Usage: plot_curves.py OUT.png "label=metrics.jsonl" ...   (needs python3-matplotlib)"""
import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def read(path):
    train, valid = [], []
    with open(path) as f:
        for line in f:
            r = json.loads(line)
            if "valid_lm_loss" in r:
                valid.append((r["iteration"], r["valid_lm_loss"]))
            elif r.get("lm_loss") is not None:
                train.append((r["iteration"], r["lm_loss"]))
    return train, valid


def main():
    out, runs = sys.argv[1], sys.argv[2:]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for spec in runs:
        label, path = spec.split("=", 1)
        train, valid = read(path)
        line, = ax.plot(*zip(*valid), marker="o", label=f"{label}: validation")
        ax.plot(*zip(*train), color=line.get_color(), alpha=0.35, label=f"{label}: training")
        print(f"{label}: final validation loss {valid[-1][1]:.4f} at iteration {valid[-1][0]}")
    ax.set_xlabel("iteration (16 x 128 tokens each)")
    ax.set_ylabel("cross-entropy loss (nats)")
    ax.set_title("tinyshakespeare, GPT-2 tokenizer: MoE vs dense at equal active parameters")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=110)


if __name__ == "__main__":
    main()
