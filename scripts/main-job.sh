#!/usr/bin/env bash
# The main job: builds moecore, then trains a small GPT on a real English corpus from Debian's `fortunes`
# package (about 2.5 MB of quotations, byte-level tokens), showing the loss fall and a generated sample.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/build.sh
corpus=build/fortunes.txt
if [ ! -s "$corpus" ]; then
  find /usr/share/games/fortunes -maxdepth 1 -type f ! -name '*.dat' ! -name '*.u8' | sort | xargs cat >"$corpus"
fi
exec ./build/apps/moecore train --data-path "$corpus" --swiglu --untie-embeddings-and-output-weights "$@"
