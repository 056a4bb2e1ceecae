#!/usr/bin/env bash
# Build the mla-diff wheel into .whl/ (docs/pytest.md): the release binary, stripped, into
# python/mla_diff/bin/ (the wheel's `mla-diff` command), then maturin (pip install maturin) builds the
# native module against the same target/ and packs both with python/mla_diff.
set -euo pipefail
cd "$(dirname "$0")/../.."
maturin="${MATURIN:-maturin}"
cargo build --release --bin mla-diff
mkdir -p python/mla_diff/bin
cp target/release/mla-diff python/mla_diff/bin/mla-diff
strip python/mla_diff/bin/mla-diff
rm -f .whl/mla_diff-*.whl
"$maturin" build --release --strip -o .whl
ls -la .whl/mla_diff-*.whl
