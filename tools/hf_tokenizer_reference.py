#!/usr/bin/env python3
"""Reference for moecore's HuggingFaceTokenizer on the Qwen2/Qwen3 and DeepSeek-V3 pre-tokenizers.

Uses Hugging Face `tokenizers` itself (the Rust library, Oniguruma regexes) to train tiny byte-level BPE models
(a few hundred merges on the start of tinyshakespeare plus a short multilingual snippet written here) and writes,
per configuration, a small tokenizer.json whose normalizer / pre_tokenizer / post_processor / decoder / added_tokens
sections copy the structure of the published files, a tokenizer_config.json with their eos/pad names, and
expected.json: the ids HF gives for test texts (contractions, numbers, CJK, kana, punctuation runs, newlines,
spaces, emoji, combining marks, added tokens), HF's decode of them (skip_special_tokens=False), the normalized text
and the pieces of the pre-tokenizer's Split steps alone on it (the regex engine's boundaries, which ids of a
400-merge model do not always show).
Configurations:
  qwen3        Qwen3's (= Qwen2/2.5's) file: NFC, Split(Qwen2 regex, Isolated) + ByteLevel(use_regex false).
  deepseek_v3  DeepSeek-V3's file: empty normalizer Sequence, three Isolated Splits (digit groups of up to 3,
               CJK/kana runs, the letters/punctuation regex) + ByteLevel(use_regex false), BOS template.
  flags        qwen3 with added tokens that use lstrip / rstrip / single_word / normalized (not in the real files).

Usage (test-time only; tests/data/test_hf_tokenizers.cpp reads the output):
  /work/venv-torch/bin/pip install tokenizers
  python3 tools/hf_tokenizer_reference.py [--shakespeare ../shared/data/tinyshakespeare/input.txt]
                                          [--out tests/golden/hf_tokenizers]
"""
import argparse
import copy
import json
import os
import random

from tokenizers import AddedToken, Regex, Tokenizer, models, pre_tokenizers, trainers

QWEN2_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
               r"\s*[\r\n]+|\s+(?!\S)|\s+")
DEEPSEEK_LETTERS_REGEX = ("[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?"
                          "[\\p{L}\\p{M}]+| ?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+")

BYTE_LEVEL_QWEN = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}

QWEN3 = {
    "normalizer": {"type": "NFC"},
    "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": QWEN2_REGEX}, "behavior": "Isolated", "invert": False},
        BYTE_LEVEL_QWEN]},
    "post_processor": BYTE_LEVEL_QWEN,
    "decoder": BYTE_LEVEL_QWEN,
}

DS_BOS = "<｜begin▁of▁sentence｜>"
DEEPSEEK_V3 = {
    "normalizer": {"type": "Sequence", "normalizers": []},
    "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": "\\p{N}{1,3}"}, "behavior": "Isolated", "invert": False},
        {"type": "Split", "pattern": {"Regex": "[一-龥぀-ゟ゠-ヿ]+"}, "behavior": "Isolated", "invert": False},
        {"type": "Split", "pattern": {"Regex": DEEPSEEK_LETTERS_REGEX}, "behavior": "Isolated", "invert": False},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}]},
    "post_processor": {
        "type": "TemplateProcessing",
        "single": [{"SpecialToken": {"id": DS_BOS, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [{"SpecialToken": {"id": DS_BOS, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                 {"SpecialToken": {"id": DS_BOS, "type_id": 1}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {DS_BOS: {"id": DS_BOS, "ids": [0], "tokens": [DS_BOS]}}},
    "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
}

# (content, special, normalized, lstrip, rstrip, single_word); ids follow the BPE vocab. A normalized token is
# matched (and decoded, by HF) in its normalized form: "s\u0323\u0307!" as "\u1e69!".
QWEN3_ADDED = [("<|endoftext|>", True, False, False, False, False), ("<|im_start|>", True, False, False, False, False),
               ("<|im_end|>", True, False, False, False, False), ("<tool_call>", False, False, False, False, False),
               ("</tool_call>", False, False, False, False, False), ("<think>", False, False, False, False, False),
               ("</think>", False, False, False, False, False)]
# DeepSeek-V3: BOS/EOS/pad are ids 0-2 (before the BPE vocab), the chat markers come after it.
DEEPSEEK_SPECIAL_FIRST = [DS_BOS, "<｜end▁of▁sentence｜>", "<｜▁pad▁｜>"]
DEEPSEEK_ADDED = [("<｜User｜>", False, True, False, False, False), ("<｜Assistant｜>", False, True, False, False, False),
                  ("<think>", False, True, False, False, False), ("</think>", False, True, False, False, False),
                  ("<|EOT|>", True, True, False, False, False)]
FLAGS_ADDED = QWEN3_ADDED + [("<sep>", True, False, True, True, False), ("[w]", False, False, False, False, True),
                             ("s\u0323\u0307!", False, True, False, False, False), ("<L>", True, False, True, False,
                                                                                     False)]

CONFIG_JSON = {
    "qwen3": {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
    "deepseek_v3": {"bos_token": {"content": DS_BOS}, "eos_token": {"content": "<｜end▁of▁sentence｜>"},
                    "pad_token": {"content": "<｜end▁of▁sentence｜>"}},
}
CONFIG_JSON["flags"] = CONFIG_JSON["qwen3"]

# Written for these tests (no third-party text): digits, CJK, kana, Hangul, accents, emoji, symbols.
SNIPPET = ("The year 2024 had 365 days; 1,234,567.89 is a number. 第一章 天地玄黄，宇宙洪荒。日月盈昃，辰宿列张。"
           "ひらがな と カタカナ の テスト です。한국어 문장. Café naïve résumé — “quotes” «guillemets» 😀👍🏽 …\n"
           "x = f(a, b) + 42 * (y - 7) / 3; // comment\n    indented  line\twith tab\r\n")

TEXTS = [
    "Hello world! I'm here, you're there; it's John's. We've, they'll, he'd. DON'T 'RE 'Ll",
    "Numbers: 0 7 42 123 1234 12345 1234567 3.14159 1,000,000 x² ١٢٣ Ⅻ 2024年",
    "中文文本测试：你好，世界！日本語のテキスト、カタカナとひらがな。한국어도 있어요.",
    "Punctuation runs!!! ??? ... ---> <<== (a) [b] {c} \"q\" 'r' #@$%^&*_+=|\\~`",
    "line1\nline2\n\n\nline3\r\n\tindented\n  two  spaces   three    four\n\n",
    "trailing spaces   ",
    "   leading spaces",
    "emoji 😀👍🏽 family 👨‍👩‍👧 flag 🇫🇷 ❤️ ✓",
    "Café vs cafe\u0301 (decomposed), naïve, e\u0301\u0302 marks, Zürich, Ω≈ç√∫",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n<think>\nFour.\n</think>\n\n4<|im_end|>"
    "<|endoftext|>",
    "<tool_call>{\"name\": \"f\", \"arguments\": {}}</tool_call> <|im_end|><|im_end|>x<|endoftext",
    DS_BOS + "<｜User｜>Hi there<｜Assistant｜><think>ok</think>Hello!<｜end▁of▁sentence｜><|EOT|>",
    "a<sep>b a <sep>  b [w] x[w] [w]y s\u0323\u0307! s\u0307\u0323! \u1e69! <L>z  <L>z",
    "Mongolian\u180eseparator (\u180e) !\u180e!, NEL\x85here, nbsp\xa0and\u3000ideographic\u2028line",
    "",
    "x",
]


def train(text, special_first, vocab_size, base):
    tok = Tokenizer(models.BPE())
    j = json.loads(tok.to_str())
    j.update(copy.deepcopy({k: base[k] for k in ("normalizer", "pre_tokenizer", "decoder")}))
    tok = Tokenizer.from_str(json.dumps(j))
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=[AddedToken(s, special=True, normalized=False)
                                                  for s in special_first], show_progress=False)
    tok.train_from_iterator([text], trainer=trainer)
    return tok


def stress_text(n=120, seed=1):
    """Seeded random runs of the characters and tokens the regexes treat differently."""
    atoms = list("aZ09 \t\n\r'!?.,-_()[]{}\"") + [
        "\u00e9", "e\u0301", "\u4e2d", "\u3042", "\u30a2", "\uac00", "\u0661", "\u00b2", "\u2163", "\U0001F600",
        "\u200d", "\u180e", "\x85", "\u00a0", "\u3000", "\u2028", "\u0301", "\u0323", "\u017f", "'S", "'re", "'LL",
        "<think>", "<|im_end|>", "<\uff5cUser\uff5c>", "<sep>", "[w]", "  ", "\n\n", "1234567"]
    rng = random.Random(seed)
    return "".join("".join(rng.choice(atoms) for _ in range(rng.randint(1, 40))) for _ in range(n))


def split_steps(base):
    """The Split steps of a pre_tokenizer alone (no ByteLevel), so pieces show the regex engine's boundaries."""
    steps = []
    for p in base["pre_tokenizer"]["pretokenizers"]:
        if p["type"] == "Split":
            steps.append(pre_tokenizers.Split(Regex(p["pattern"]["Regex"]), behavior=p["behavior"].lower(),
                                              invert=p["invert"]))
    return pre_tokenizers.Sequence(steps)


def build(name, base, text, special_first, added):
    tok = train(text, special_first, 256 + len(special_first) + 400, base)
    tok.add_tokens([AddedToken(c, special=s, normalized=n, lstrip=l, rstrip=r, single_word=w)
                    for c, s, n, l, r, w in added])
    j = json.loads(tok.to_str())
    # The published files' sections, verbatim in structure.
    for k in ("normalizer", "pre_tokenizer", "post_processor", "decoder"):
        j[k] = copy.deepcopy(base[k])
    flags = {c: (s, n, l, r, w) for c, s, n, l, r, w in added}
    for t in j["added_tokens"]:
        if t["content"] in flags:
            s, n, l, r, w = flags[t["content"]]
        else:  # the special tokens trained first
            s, n, l, r, w = True, name == "deepseek_v3", False, False, False
        t.update({"special": s, "normalized": n, "lstrip": l, "rstrip": r, "single_word": w})
    return Tokenizer.from_str(json.dumps(j)), j


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    ap = argparse.ArgumentParser()
    ap.add_argument("--shakespeare", default=os.path.join(here, "../../shared/data/tinyshakespeare/input.txt"))
    ap.add_argument("--out", default=os.path.join(here, "../tests/golden/hf_tokenizers"))
    ap.add_argument("--train-bytes", type=int, default=60000)
    args = ap.parse_args()
    shakespeare = open(args.shakespeare, encoding="utf-8").read()
    text = shakespeare[:args.train_bytes] + SNIPPET * 20
    slice_text = shakespeare[200000:204000]  # not in the training text
    configs = [("qwen3", QWEN3, [], QWEN3_ADDED), ("deepseek_v3", DEEPSEEK_V3, DEEPSEEK_SPECIAL_FIRST, DEEPSEEK_ADDED),
               ("flags", QWEN3, [], FLAGS_ADDED)]
    for name, base, first, added in configs:
        tok, j = build(name, base, text, first, added)
        out = os.path.join(args.out, name)
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "tokenizer.json"), "w", encoding="utf-8") as f:
            json.dump(j, f, ensure_ascii=False, separators=(",", ":"))
        with open(os.path.join(out, "tokenizer_config.json"), "w", encoding="utf-8") as f:
            json.dump(CONFIG_JSON[name], f, ensure_ascii=False, indent=1)
        splits = split_steps(base)
        cases = []
        for t in TEXTS + [SNIPPET, slice_text, stress_text()]:
            ids = tok.encode(t).ids
            norm = tok.normalizer.normalize_str(t) if tok.normalizer else t
            case = {"text": t, "ids": ids, "decoded": tok.decode(ids, skip_special_tokens=False)}
            if name != "flags":  # flags shares qwen3's pre-tokenizer
                case["normalized"] = norm
                case["split_pieces"] = [p for p, _ in (splits.pre_tokenize_str(norm) if norm else [])]
            cases.append(case)
        expected = {"generator": "tools/hf_tokenizer_reference.py", "tokenizers_version": __import__(
            "tokenizers").__version__, "vocab_size": tok.get_vocab_size(with_added_tokens=True), "cases": cases}
        with open(os.path.join(out, "expected.json"), "w", encoding="utf-8") as f:  # one case per line
            head = json.dumps({k: v for k, v in expected.items() if k != "cases"}, ensure_ascii=False)[:-1]
            f.write(head + ', "cases": [\n' + ",\n".join(json.dumps(c, ensure_ascii=False, separators=(",", ":"))
                                                         for c in cases) + "\n]}\n")
        print(f"{name}: vocab {expected['vocab_size']}, {len(cases)} cases -> {out}")


if __name__ == "__main__":
    main()
