#!/usr/bin/python3
"""Golden reference for moecore's FP8 quantisation (ops::fp8_quantize, kernels/common/fp8.h), written from the recipes'
published definitions (Transformer Engine's recipe documentation and docs/fp8-spec.md §3-4), not from their code, with
PyTorch's float8_e4m3fn / float8_e5m2 dtypes doing the rounding.

Produces tests/golden/fp8_quantize.safetensors: one input x [130, 260] f32 (random normal with std 3 and planted
values: a zero row and column, a run of equal values, a NaN, infinities, values past the formats' max, tiny values in
blocks with large ones, a block of subnormal-sized values), and for each case <name>.q (F8_E4M3 or F8_E5M2),
<name>.scale_inv [block rows, block cols] F32 and <name>.amax [1] F32. The cases (the metadata's "cases") are
(format, rule, block rows, block cols[, scale]):
  tensorwise (current per-tensor scaling): scale = fp32(fp8_max / amax); amax 0, inf or NaN: 1; an infinite quotient
    FLT_MAX -- E4M3 and E5M2;
  blockwise: the same per block, then rounded down to a power of two (the exponent bits kept) -- 1 x 128 (E4M3),
    128 x 1 (E5M2), 128 x 128 (E4M3);
  mxfp8: per 32 elements, scale_inv = 2^(e - 127) with e the E8M0 of fp32(amax * fp32(1 / fp8_max)), its exponent
    rounded up (NaN 0xFF, inf 0xFE, 0 and values up to 2^-127 0x00) and the block quantised with 2^(127 - e) --
    1 x 32 (E4M3), 32 x 1 (E5M2);
  delayed (a given scale, the first micro-batch after an update): E4M3 and E5M2 with scale 37.5.
Every block's amax skips NaN (fmaxf); q = fp8(fp32(x * scale)) rounded to nearest even, saturating to +-max (infinities
too) as TE's cvt.rn.satfinite does, NaN the canonical 0x7F; scale_inv = fp32(1 / scale).
Usage: tools/fp8_reference.py [--check]   (--check recomputes the golden and compares it bit for bit)
"""
import json
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpt_reference import load_safetensors, save_safetensors  # noqa: E402

GOLDEN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "golden", "fp8_quantize.safetensors")
M, K = 130, 260
FP8 = {"e4m3": (torch.float8_e4m3fn, 448.0), "e5m2": (torch.float8_e5m2, 57344.0)}
FLT_MAX = float(np.finfo(np.float32).max)
CASES = [
    ("tensorwise_e4m3", "e4m3", "current", 0, 0),
    ("tensorwise_e5m2", "e5m2", "current", 0, 0),
    ("blockwise_1x128_e4m3", "e4m3", "current_pow2", 1, 128),
    ("blockwise_128x1_e5m2", "e5m2", "current_pow2", 128, 1),
    ("blockwise_128x128_e4m3", "e4m3", "current_pow2", 128, 128),
    ("mxfp8_1x32_e4m3", "e4m3", "mx", 1, 32),
    ("mxfp8_32x1_e5m2", "e5m2", "mx", 32, 1),
    ("delayed_e4m3", "e4m3", "given", 0, 0, 37.5),
    ("delayed_e5m2", "e5m2", "given", 0, 0, 37.5),
]


def make_input():
    rng = np.random.default_rng(2026)
    x = (rng.standard_normal((M, K)) * 3.0).astype(np.float32)
    x[129, :] = 0.0  # a zero row
    x[:, 259] = 0.0  # a zero column
    x[5, 0:40] = 2.5  # equal values (an all-equal 1 x 32 block)
    x[7, 3] = np.nan
    x[7, 127] = x[127, 5] = np.nan  # NaN last in its blocks (the amax skips it wherever it is)
    x[9, 100] = np.inf  # an infinite amax in its blocks
    x[11, 200] = -np.inf
    x[13, 0:32] = [470.0, 464.0, 448.0, 61440.0, 60000.0, 1e5, -470.0, -1e5] + [1.0] * 24  # past the maxima
    x[20, 64:96] = np.float32(1e-3) * rng.standard_normal(32).astype(np.float32)  # a small block
    x[20, 64] = 1000.0  # ... with one large value: the rest falls into the subnormals
    x[40, 128:256] = np.float32(1e-40)  # subnormal f32 values: the quotient overflows
    x[41, 0:128] = np.float32(2.0**-127)  # around E8M0's smallest scales
    x[41, 1] = np.float32(3.0 * 2.0**-128)
    return x


def amax_of(block):
    a = block.abs()
    return torch.where(torch.isnan(a), torch.zeros_like(a), a).amax() if a.numel() else torch.tensor(0.0)


def as_bits(f):
    return torch.tensor([f], dtype=torch.float32).view(torch.int32).item()


def from_bits(i):
    return torch.tensor([i], dtype=torch.int32).view(torch.float32)[0]


def block_scale(amax, fp8_max, rule, given):
    """(scale, scale_inv) of one block as fp32 scalars."""
    f32 = lambda v: torch.tensor(v, dtype=torch.float32)
    if rule == "given":
        s = f32(given)
        return s, f32(1.0) / s
    if rule in ("current", "current_pow2"):
        if torch.isnan(amax) or torch.isinf(amax) or amax == 0:
            s = f32(1.0)
        else:
            s = f32(fp8_max) / amax
            if torch.isinf(s):
                s = f32(FLT_MAX)
            if rule == "current_pow2":
                s = from_bits(as_bits(s.item()) & 0x7F800000)  # the exponent kept (scales are positive)
        return s, f32(1.0) / s
    # mx: E8M0 of fp32(amax * fp32(1 / fp8_max)), the exponent rounded up
    p = amax * f32(1.0 / fp8_max)
    if torch.isnan(p):
        e = 0xFF
    elif torch.isinf(p):
        e = 0xFE
    elif p == 0:
        e = 0
    else:
        bits = as_bits(p.item())
        e, m = (bits >> 23) & 0xFF, bits & 0x7FFFFF
        if m > 0 and e != 0xFE and not (e == 0 and m <= 0x400000):
            e += 1
    if e == 0xFF:
        return f32(float("nan")), f32(float("nan"))
    pow2 = lambda k: torch.tensor(2.0**k, dtype=torch.float64).float()
    return pow2(127 - e), pow2(e - 127)


def quantize(x, fmt, rule, br, bc, given=None):
    dtype, fp8_max = FP8[fmt]
    br, bc = br or M, bc or K
    rows, cols = (M + br - 1) // br, (K + bc - 1) // bc
    q = torch.zeros((M, K), dtype=torch.int32)
    inv = torch.zeros((rows, cols), dtype=torch.float32)
    total = torch.tensor(0.0)
    for i in range(rows):
        for j in range(cols):
            blk = x[i * br:(i + 1) * br, j * bc:(j + 1) * bc]
            amax = amax_of(blk)
            total = torch.maximum(total, amax)
            s, si = block_scale(amax, fp8_max, rule, given)
            inv[i, j] = si
            y = (blk * s).float()  # the product rounded to fp32 first
            y = torch.clamp(y, -fp8_max, fp8_max)  # saturation (infinities too); NaN stays NaN
            b = y.to(dtype).view(torch.uint8).to(torch.int32)
            b[torch.isnan(y)] = 0x7F  # the canonical NaN
            q[i * br:(i + 1) * br, j * bc:(j + 1) * bc] = b
    return q, inv, total.reshape(1).float()


def generate():
    x = make_input()
    xt = torch.from_numpy(x)
    out, cases = {"x": x}, []
    for c in CASES:
        name, fmt, rule, br, bc = c[:5]
        given = c[5] if len(c) > 5 else None
        q, inv, amax = quantize(xt, fmt, rule, br, bc, given)
        out[name + ".q"] = ("F8_E4M3" if fmt == "e4m3" else "F8_E5M2", q.numpy().astype(np.uint8))
        out[name + ".scale_inv"] = inv.numpy()
        out[name + ".amax"] = amax.numpy()
        cases.append({"name": name, "format": fmt, "rule": rule, "block_rows": br, "block_cols": bc,
                      "scale": given if given is not None else 1.0})
    return out, {"cases": json.dumps(cases), "torch": torch.__version__}


def main():
    out, meta = generate()
    if "--check" in sys.argv:
        got, _ = load_safetensors(GOLDEN)
        bytes_of = lambda t: (t[1] if isinstance(t, tuple) else t).tobytes()
        bad = [n for n in out if bytes_of(out[n]) != np.asarray(got[n]).tobytes()]
        print("fp8 golden:", "differs in " + ", ".join(bad) if bad else "matches")
        return 1 if bad else 0
    save_safetensors(GOLDEN, out, meta)
    print("wrote", GOLDEN)
    return 0


if __name__ == "__main__":
    sys.exit(main())
