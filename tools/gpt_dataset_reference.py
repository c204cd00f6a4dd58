#!/usr/bin/python3
"""Reference for moecore's GPTDataset / BlendedDataset index building (Megatron-Core semantics).

An independent numpy-only reimplementation of megatron/core/datasets/{gpt_dataset,helpers.cpp,
blended_dataset,blended_megatron_dataset_builder,utils}.py as described in docs/formats.md §1-§2.
It uses numpy.random.RandomState itself for the shuffles (the C++ side re-implements MT19937), so a
match checks the RNG port as well as the index logic.

Usage:
  gpt_dataset_reference.py golden [--out tests/golden/gpt_dataset_indices.json]
      Writes the synthetic datasets (sizes + tokens) and the expected indices/samples for
      tests/data/test_gpt_dataset.cpp.
  gpt_dataset_reference.py indices PREFIX --seq-length L [--seed S] [--split 969,30,1]
                           [--num-samples N] [--split-index 0]
      Prints the document/sample/shuffle indices of one split of a real .bin/.idx as JSON.
"""
import argparse
import json
import math
import os
import re
import sys

import numpy as np

IDX_MAGIC = b"MMIDIDX\x00\x00"
DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float32,
          8: np.uint16}


# ---------------------------------------------------------------------------------------------------
# .bin/.idx (docs/formats.md §1)

def read_indexed(prefix):
    raw = open(prefix + ".idx", "rb").read()
    assert raw[:9] == IDX_MAGIC, "bad magic"
    version = int(np.frombuffer(raw, np.uint64, 1, 9)[0])
    assert version == 1, "bad version"
    code = raw[17]
    s = int(np.frombuffer(raw, np.uint64, 1, 18)[0])
    d = int(np.frombuffer(raw, np.uint64, 1, 26)[0])
    sizes = np.frombuffer(raw, np.int32, s, 34)
    pointers = np.frombuffer(raw, np.int64, s, 34 + 4 * s)
    doc_idx = np.frombuffer(raw, np.int64, d, 34 + 12 * s)
    data = np.fromfile(prefix + ".bin", DTYPES[code])
    item = np.dtype(DTYPES[code]).itemsize
    seqs = [data[p // item:p // item + n].astype(np.int64) for p, n in zip(pointers, sizes)]
    return sizes.astype(np.int32), doc_idx, seqs


# ---------------------------------------------------------------------------------------------------
# Split string (§2.1)

def normalize(weights):
    w = np.array(weights, dtype=np.float64)
    return (w / np.sum(w)).tolist()


def parse_split(split):
    v = list(map(float, re.findall(r"[.0-9]+", split)))
    v = v + [0.0] * (3 - len(v))
    assert len(v) == 3 and all(x >= 0 for x in v)
    return normalize(v)


def split_matrix(v):
    exp = [0]
    for x in v:
        exp.append(exp[-1] + x)
    out = []
    for lo, hi in zip(exp[:-1], exp[1:]):
        out.append(None if hi <= lo else (lo, hi))
    return out


def split_ranges(matrix, n):
    return [None if m is None else (int(round(m[0] * float(n))), int(round(m[1] * float(n)))) for m in matrix]


# ---------------------------------------------------------------------------------------------------
# GPTDataset indices (§2.3-§2.8)

def build_sample_idx(sizes, document_index, L, num_epochs, T, drop_last, x):
    if drop_last:
        n = (num_epochs * T - x) // L
    else:
        n = int(math.ceil(float(np.float32(num_epochs * T - x) / np.float32(L))))
    out = np.zeros((n + 1, 2), dtype=np.int64)
    di, off = 0, 0
    k = 1
    while k <= n:
        remaining = L + x
        while remaining != 0:
            length = int(sizes[document_index[di]]) - off
            remaining -= length
            if remaining <= 0:
                off += remaining + length - x
                remaining = 0
            else:
                if di == len(document_index) - 1:
                    assert k == n
                    off = int(sizes[document_index[di]]) - x
                    break
                di += 1
                off = 0
        out[k] = (di, off)
        k += 1
    return out


def build_document_index(documents, num_epochs, rs, separate_final_epoch):
    if not separate_final_epoch or num_epochs == 1:
        doc = np.mgrid[0:num_epochs, 0:len(documents)][1]
        doc[:] = documents
        doc = doc.reshape(-1).astype(np.int32)
        rs.shuffle(doc)
        return doc
    first = build_document_index(documents, num_epochs - 1, rs, False)
    last = build_document_index(documents, 1, rs, False)
    return np.concatenate((first, last))


def build_shuffle_index(num_samples, total, rs):
    dtype = np.uint32 if total < np.iinfo(np.uint32).max - 1 else np.int64
    first = np.arange(0, num_samples, dtype=dtype)
    rs.shuffle(first)
    if num_samples == total:
        return first
    last = np.arange(num_samples, total, dtype=dtype)
    rs.shuffle(last)
    return np.concatenate((first, last))


class GptDataset:
    def __init__(self, sizes, seqs, begin, end, num_samples, L, seed, split_index=0, drop_last_valid=True,
                 x=1, pad=-1):
        self.sizes, self.seqs, self.L, self.x, self.pad = sizes, seqs, L, x, pad
        indices = np.arange(begin, end, dtype=np.int32)
        T = int(np.sum(sizes[indices]))
        assert T > 1, "split too small"
        epochs = 1
        if num_samples is not None:
            have, want = T, num_samples * L + x
            while have < want:
                epochs += 1
                have += T
        separate = False
        sans = None
        if epochs > 1:
            sans = ((epochs - 1) * T - x) // L
            final = num_samples - sans
            per = (T - x) // L
            assert 0 <= final <= per + 1
            separate = final < int(0.80 * per)
        rs = np.random.RandomState(seed)
        self.document_index = build_document_index(indices, epochs, rs, separate)
        drop_last = drop_last_valid if split_index == 1 else True
        self.sample_index = build_sample_idx(sizes, self.document_index, L, epochs, T, drop_last, x)
        total = self.sample_index.shape[0] - 1
        self.shuffle_index = build_shuffle_index(sans if separate else total, total, rs)
        self.num_epochs, self.separate, self.tokens_per_epoch = epochs, separate, T

    def __len__(self):
        return self.sample_index.shape[0] - 1

    def text(self, i):
        j = int(self.shuffle_index[i])
        b, ob = (int(v) for v in self.sample_index[j])
        e, oe = (int(v) for v in self.sample_index[j + 1])
        parts = []
        if b == e:
            seq = self.seqs[self.document_index[b]]
            parts.append(seq[ob:oe + self.x])
        else:
            for k in range(b, e + 1):
                seq = self.seqs[self.document_index[k]]
                off = 0 if k > b else ob
                parts.append(seq[off:] if k < e else seq[off:oe + self.x])
        t = np.concatenate(parts).astype(np.int64)
        n = self.L + self.x
        if len(t) < n:
            t = np.concatenate([t, np.full(n - len(t), self.pad, np.int64)])
        return t

    def sample(self, i):
        t = self.text(i)
        tokens, labels = t[:-1].copy(), t[1:].copy()
        mask = np.ones(self.L, np.float32)
        mask[labels == self.pad] = 0
        tokens[tokens == self.pad] = 0
        labels[labels == self.pad] = 0
        return tokens, labels, mask


# ---------------------------------------------------------------------------------------------------
# Blending (§2.10)

def build_blending_indices(weights, size):
    count = [0] * len(weights)
    di = np.zeros(size, np.int16)
    dsi = np.zeros(size, np.int64)
    for s in range(size):
        sd = max(float(s), 1.0)
        best, best_err = 0, weights[0] * sd - count[0]
        for d in range(1, len(weights)):
            err = weights[d] * sd - count[d]
            if err > best_err:
                best, best_err = d, err
        di[s], dsi[s] = best, count[best]
        count[best] += 1
    return di, dsi


def build_exhaustive_blending_indices(sizes):
    total = sum(sizes)
    w = [s / float(total) for s in sizes]
    count = [0] * len(sizes)
    unspent = list(range(len(sizes)))
    di, dsi = [], []
    s = 0
    while unspent:
        sd = max(float(s), 1.0)
        best, best_err = -1, -sys.float_info.max
        for d in unspent:
            err = w[d] * sd - count[d]
            if err > best_err:
                best, best_err = d, err
        di.append(best)
        dsi.append(count[best])
        count[best] += 1
        if count[best] == sizes[best]:
            unspent.remove(best)
        s += 1
    return np.array(di, np.int16), np.array(dsi, np.int64)


def parse_blend(words):
    if len(words) % 2 == 1:
        return [w.strip() for w in words], None
    weights = []
    for w in words[0::2]:
        try:
            weights.append(float(w))
        except ValueError:
            return [w.strip() for w in words], None
    return [w.strip() for w in words[1::2]], weights


def build_source(datasets, data_path, split, num_samples, L, seed, surplus=0.005):
    """BlendedMegatronDatasetBuilder with one blend; datasets maps prefix -> (sizes, seqs).
    Returns per split None, ("gpt", GptDataset) or ("blend", weights, size, di, dsi, [GptDataset])."""
    prefixes, weights = parse_blend(data_path)
    if weights is not None:
        weights = normalize(weights)
    matrix = split_matrix(parse_split(split))
    out = [None, None, None]
    for i in range(3):
        want = num_samples[i]
        if matrix[i] is None or want == 0:
            continue

        def mid(p, n):
            sizes, seqs = datasets[prefixes[p]]
            r = split_ranges(matrix, len(sizes))[i]
            return GptDataset(sizes, seqs, r[0], r[1], n, L, seed, split_index=i)

        if len(prefixes) == 1 and weights is None:
            out[i] = ("gpt", mid(0, want))
            continue
        if weights is not None:
            target = [int(math.ceil(want * w)) for w in weights]
            buffer = [int(math.ceil(math.ceil(want * w) * (1 + surplus))) for w in weights]
            mids = [mid(p, buffer[p]) for p in range(len(prefixes))]
            size = sum(target)
            bw = normalize(weights)
            di, dsi = build_blending_indices(bw, size)
        else:
            mids = [mid(p, None) for p in range(len(prefixes))]
            lens = [len(m) for m in mids]
            if want is not None:
                size = min(want, sum(lens))
                bw = normalize(lens)
                di, dsi = build_blending_indices(bw, size)
            else:
                size, bw = None, lens
                di, dsi = build_exhaustive_blending_indices(lens)
        for d in range(len(mids)):
            assert int(np.sum(di == d)) <= len(mids[d]), "blend oversamples"
        out[i] = ("blend", bw, size, di, dsi, mids)
    return out


# ---------------------------------------------------------------------------------------------------
# Golden file

def synthetic(num_docs, max_len, seed):
    rs = np.random.RandomState(seed)
    sizes = rs.randint(1, max_len + 1, size=num_docs).astype(np.int32)
    tokens = rs.randint(0, 50257, size=int(np.sum(sizes))).astype(np.int64)
    seqs, at = [], 0
    for n in sizes:
        seqs.append(tokens[at:at + n])
        at += n
    return sizes, seqs, tokens


def gpt_json(ds, samples):
    out = {"num_epochs": ds.num_epochs, "separate_final_epoch": bool(ds.separate),
           "tokens_per_epoch": ds.tokens_per_epoch, "document_index": ds.document_index.tolist(),
           "sample_index": ds.sample_index.reshape(-1).tolist(), "shuffle_index": ds.shuffle_index.tolist()}
    out["samples"] = []
    for i in samples:
        t, lab, m = ds.sample(i)
        out["samples"].append({"i": i, "tokens": t.tolist(), "labels": lab.tolist(), "loss_mask": m.tolist()})
    return out


def golden(path):
    a_sizes, a_seqs, a_tokens = synthetic(37, 50, 7)
    b_sizes, b_seqs, b_tokens = synthetic(23, 40, 11)
    L, seed = 16, 1234
    T = int(np.sum(a_sizes))
    per = (T - 1) // L
    sans3 = (2 * T - 1) // L
    cases = []
    # 3 epochs, separate final epoch: few samples from the third epoch.
    n_sep = sans3 + 5
    ds = GptDataset(a_sizes, a_seqs, 0, 37, n_sep, L, seed)
    assert ds.num_epochs == 3 and ds.separate
    cases.append({"name": "three_epochs_separate", "dataset": "A", "begin": 0, "end": 37, "num_samples": n_sep,
                  "seq_length": L, "seed": seed, "split": "train", **gpt_json(ds, [0, 1, len(ds) - 1])})
    # 3 epochs, final epoch mixed into the global shuffle.
    n_mix = sans3 + int(0.8 * per) + 1
    ds = GptDataset(a_sizes, a_seqs, 0, 37, n_mix, L, seed)
    assert ds.num_epochs == 3 and not ds.separate
    cases.append({"name": "three_epochs_mixed", "dataset": "A", "begin": 0, "end": 37, "num_samples": n_mix,
                  "seq_length": L, "seed": seed, "split": "train", **gpt_json(ds, [0, 5, len(ds) - 1])})
    # One epoch of the valid split with the padded final sample kept.
    r = split_ranges(split_matrix(parse_split("80,15,5")), 37)[1]
    ds = GptDataset(a_sizes, a_seqs, r[0], r[1], None, L, 99, split_index=1, drop_last_valid=False)
    cases.append({"name": "valid_keep_partial", "dataset": "A", "begin": r[0], "end": r[1], "num_samples": None,
                  "seq_length": L, "seed": 99, "split": "valid", "drop_last_partial_validation": False,
                  **gpt_json(ds, list(range(len(ds))))})

    split_cases = []
    for split, n in [("969, 30, 1", 1000), ("969,30,1", 37), ("99990,8,2", 100000), ("99990,8,2", 12345),
                     ("1", 10), ("1,1", 5), ("1,1", 7), ("1,1,2", 6), ("0.5,0.5", 9), ("80,15,5", 37),
                     ("80,15,5", 23), ("100,0,0", 50), ("0,1,1", 3)]:
        ranges = split_ranges(split_matrix(parse_split(split)), n)
        split_cases.append({"split": split, "n": n, "ranges": [None if x is None else list(x) for x in ranges]})

    datasets = {"A": (a_sizes, a_seqs), "B": (b_sizes, b_seqs)}
    source_cases = []
    for name, data_path, nums in [("weighted", ["0.3", "A", "0.7", "B"], [40, 10, 3]),
                                  ("unweighted", ["A", "B"], [30, None, 2])]:
        src = build_source(datasets, data_path, "80,15,5", nums, L, seed)
        splits = []
        for s in src:
            if s is None:
                splits.append(None)
                continue
            _, bw, size, di, dsi, mids = s
            samples = []
            for k in range(min(len(di), 6)):
                t, lab, m = mids[di[k]].sample(int(dsi[k]))
                samples.append({"i": k, "tokens": t.tolist(), "labels": lab.tolist(), "loss_mask": m.tolist()})
            splits.append({"weights": [float(w) for w in bw], "size": size, "dataset_index": di.tolist(),
                           "dataset_sample_index": dsi.tolist(), "mid_sizes": [len(m) for m in mids],
                           "samples": samples})
        source_cases.append({"name": name, "data_path": data_path, "split": "80,15,5", "num_samples": nums,
                             "seq_length": L, "seed": seed, "splits": splits})

    blend_cases = []
    for w, size in [([0.3, 0.7], 20), ([1.0, 1.0, 2.0], 17), ([0.5, 0.25, 0.25], 9)]:
        di, dsi = build_blending_indices(normalize(w), size)
        blend_cases.append({"weights": w, "normalized": normalize(w), "size": size, "dataset_index": di.tolist(),
                            "dataset_sample_index": dsi.tolist()})
    for sizes in [[3, 5], [4, 1, 2]]:
        di, dsi = build_exhaustive_blending_indices(sizes)
        blend_cases.append({"exhaustive_sizes": sizes, "dataset_index": di.tolist(),
                            "dataset_sample_index": dsi.tolist()})

    out = {"generator": "tools/gpt_dataset_reference.py golden", "numpy": np.__version__,
           "datasets": {"A": {"sizes": a_sizes.tolist(), "tokens": a_tokens.tolist()},
                        "B": {"sizes": b_sizes.tolist(), "tokens": b_tokens.tolist()}},
           "gpt_cases": cases, "split_cases": split_cases, "source_cases": source_cases,
           "blend_cases": blend_cases}
    with open(path, "w") as f:
        json.dump(out, f, separators=(",", ":"))
        f.write("\n")
    print(f"wrote {path} ({os.path.getsize(path)} bytes)")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("golden")
    g.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "tests", "golden",
                                                 "gpt_dataset_indices.json"))
    ix = sub.add_parser("indices")
    ix.add_argument("prefix")
    ix.add_argument("--seq-length", type=int, required=True)
    ix.add_argument("--seed", type=int, default=1234)
    ix.add_argument("--split", default="969, 30, 1")
    ix.add_argument("--split-index", type=int, default=0)
    ix.add_argument("--num-samples", type=int, default=None)
    args = ap.parse_args()
    if args.cmd == "golden":
        golden(args.out)
    else:
        sizes, _, seqs = read_indexed(args.prefix)
        r = split_ranges(split_matrix(parse_split(args.split)), len(sizes))[args.split_index]
        ds = GptDataset(sizes, seqs, r[0], r[1], args.num_samples, args.seq_length, args.seed,
                        split_index=args.split_index)
        json.dump(gpt_json(ds, []), sys.stdout)
        print()


if __name__ == "__main__":
    main()
