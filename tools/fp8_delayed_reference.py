#!/usr/bin/python3
"""Golden reference for moecore's FP8 delayed scaling (--fp8-recipe delayed; nn/fp8_delayed.h), written from
Transformer Engine's published DelayedScaling recipe (docs/fp8-spec.md §3.1), not from its code or moecore's, with
PyTorch's float8_e4m3fn / float8_e5m2 dtypes doing the rounding.

One linear layer y = x W^T (x [T, K], W [N, K], f32) trained for two steps of two micro-batches each, both forwards of
a step before their backwards (a pipeline's order), with an evaluation forward between the steps; W changes between the
steps. Recipe: format hybrid (input and weight E4M3, output gradient E5M2), --fp8-amax-history-len 3,
--fp8-amax-compute-algo max, --fp8-margin 1. Three quantizer slots -- input, weight, output gradient -- each with a scale
(1 at first) and an amax history of 3 rows (row 0 the accumulator, then past amaxes oldest first):
  * a quantisation uses its slot's scale, q = fp8(fp32(x * scale)) saturating, and maxes amax |x| into row 0;
  * fprop quantises x with the input scale (saved for its micro-batch's backward) and W with the step's weight scale,
    taken (and W's amax recorded) on the step's first training forward only; an evaluation uses the current scales and
    records its amaxes, with no update;
  * dgrad quantises dy with the gradient scale and W with the step's weight scale; wgrad dy likewise and x with its
    forward's saved input scale (the same FP8 x);
  * after each training forward the input and weight slots update, after each backward the gradient slot: with a = row
    0, nothing changes if a == 0; else used = max(a, rows 1..2), the history rolls (row 0 := 0, row 1 := row 2,
    row 2 := a) and scale = fp32(fp8_max * 2^-margin) / used (an infinite quotient: FLT_MAX).
The GEMMs multiply the dequantised operands in float64.

Writes tests/golden/fp8_delayed_linear.safetensors: x.s{s}.m{m}, dy.s{s}.m{m}, w.s{s}, x.eval; y.s{s}.m{m},
dx.s{s}.m{m}, dw.s{s}.m{m} (f32, each micro-batch's own), y.eval; state.s{s} [3, 1 + 3] (each slot's scale, then its
history rows) after each step, state.eval after the evaluation.
Usage: tools/fp8_delayed_reference.py [--check]   (--check recomputes the golden and compares it bit for bit)
"""
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpt_reference import load_safetensors, save_safetensors  # noqa: E402

GOLDEN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "golden",
                      "fp8_delayed_linear.safetensors")
T, K, N = 24, 64, 32
L, MARGIN = 3, 1
FP8 = {"e4m3": (torch.float8_e4m3fn, 448.0), "e5m2": (torch.float8_e5m2, 57344.0)}
INPUT, WEIGHT, GRAD = 0, 1, 2
FORMAT = {INPUT: "e4m3", WEIGHT: "e4m3", GRAD: "e5m2"}
FLT_MAX = float(np.finfo(np.float32).max)
f32 = lambda v: torch.tensor(v, dtype=torch.float32)


def dequantised(x, fmt, scale):
    """x quantised with the given scale and dequantised (float64): fp8(fp32(x * scale)) * fp32(1 / scale)."""
    dtype, fp8_max = FP8[fmt]
    y = (x * scale).float()
    y = torch.clamp(y, -fp8_max, fp8_max)
    return y.to(dtype).double() * (f32(1.0) / scale).double()


class Slots:
    def __init__(self):
        self.scale = [f32(1.0) for _ in range(3)]
        self.history = [torch.zeros(L, dtype=torch.float32) for _ in range(3)]

    def record(self, k, x):
        self.history[k][0] = torch.maximum(self.history[k][0], x.abs().amax())

    def update(self, k):
        a = self.history[k][0].clone()
        if a == 0:
            return
        old = self.history[k].clone()
        used = torch.maximum(a, old[1:].amax())  # max over the past amaxes and the new one
        new = torch.zeros(L, dtype=torch.float32)
        new[1:L - 1] = old[2:L]
        new[L - 1] = a
        self.history[k] = new
        scaled_max = f32(FP8[FORMAT[k]][1] * 2.0 ** -MARGIN)
        if torch.isfinite(used) and used > 0:
            s = scaled_max / used
            self.scale[k] = f32(FLT_MAX) if torch.isinf(s) else s

    def state(self):
        out = np.zeros((3, 1 + L), dtype=np.float32)
        for k in range(3):
            out[k, 0] = self.scale[k].item()
            out[k, 1:] = self.history[k].numpy()
        return out


def generate():
    rng = np.random.default_rng(32)
    data = {}
    for s in range(2):
        data[f"w.s{s}"] = (rng.standard_normal((N, K)) * (0.1 + 0.05 * s)).astype(np.float32)
        for m in range(2):
            data[f"x.s{s}.m{m}"] = (rng.standard_normal((T, K)) * (2.0 + m + 2 * s)).astype(np.float32)
            data[f"dy.s{s}.m{m}"] = (rng.standard_normal((T, N)) * 1e-3 * (1 + m)).astype(np.float32)
    data["x.eval"] = (rng.standard_normal((T, K)) * 9.0).astype(np.float32)
    t = {k: torch.from_numpy(v) for k, v in data.items()}
    out = dict(data)
    st = Slots()
    for s in range(2):
        w = t[f"w.s{s}"]
        w_scale = None
        saved = {}
        for m in range(2):  # the forwards
            x = t[f"x.s{s}.m{m}"]
            saved[m] = st.scale[INPUT].clone()
            if w_scale is None:  # the step's first training forward: W quantised with the weight scale of now
                w_scale = st.scale[WEIGHT].clone()
                st.record(WEIGHT, w)
            st.record(INPUT, x)
            y = dequantised(x, "e4m3", saved[m]) @ dequantised(w, "e4m3", w_scale).T
            out[f"y.s{s}.m{m}"] = y.float().numpy()
            st.update(INPUT)
            st.update(WEIGHT)
        for m in range(2):  # the backwards
            x, dy = t[f"x.s{s}.m{m}"], t[f"dy.s{s}.m{m}"]
            g = dequantised(dy, "e5m2", st.scale[GRAD])
            st.record(GRAD, dy)
            out[f"dx.s{s}.m{m}"] = (g @ dequantised(w, "e4m3", w_scale)).float().numpy()
            out[f"dw.s{s}.m{m}"] = (g.T @ dequantised(x, "e4m3", saved[m])).float().numpy()
            st.update(GRAD)
        out[f"state.s{s}"] = st.state()
        if s == 0:  # an evaluation: the current scales, amaxes recorded for the next update
            x = t["x.eval"]
            y = dequantised(x, "e4m3", st.scale[INPUT]) @ dequantised(w, "e4m3", st.scale[WEIGHT]).T
            st.record(INPUT, x)
            st.record(WEIGHT, w)
            out["y.eval"] = y.float().numpy()
            out["state.eval"] = st.state()
    return out, {"torch": torch.__version__, "recipe": "delayed hybrid, history 3, max, margin 1"}


def main():
    out, meta = generate()
    if "--check" in sys.argv:
        got, _ = load_safetensors(GOLDEN)
        bad = [n for n in out if out[n].tobytes() != np.asarray(got[n]).tobytes()]
        print("fp8 delayed golden:", "differs in " + ", ".join(bad) if bad else "matches")
        return 1 if bad else 0
    save_safetensors(GOLDEN, out, meta)
    print("wrote", GOLDEN)
    return 0


if __name__ == "__main__":
    sys.exit(main())
