#!/usr/bin/env python3
"""Turns Debian's fortune files (entries separated by lines holding a single '%') into JSONL documents
{"text": ...}, one per fortune, for `moecore preprocess`. Usage: fortunes_to_jsonl.py OUT.jsonl FILE..."""
import json
import sys


def main():
    out_path, inputs = sys.argv[1], sys.argv[2:]
    count = 0
    with open(out_path, "w", encoding="utf-8") as out:
        for path in inputs:
            with open(path, encoding="utf-8", errors="replace") as f:
                entry = []
                for line in f.read().split("\n") + ["%"]:
                    if line.strip() == "%":
                        text = "\n".join(entry).strip()
                        if text:
                            out.write(json.dumps({"text": text}) + "\n")
                            count += 1
                        entry = []
                    else:
                        entry.append(line)
    print(f"{count} documents -> {out_path}", file=sys.stderr)


if __name__ == "__main__":
    main()
