#!/usr/bin/env bash
# fetch_peers.sh: downloads the peer kernels' wheels (pip, PyPI) on a machine with internet and
# extracts what the GPU machine needs into the git-ignored .carry/peers/, small enough to carry
# (the device machine has no internet and takes at most 64 MiB of working tree + carried paths).
# Nothing here is committed; the runners import these packages, they do not vendor them.
#
# Produces .carry/peers/:
#   sgl_flash_mla.tar.xz  the sgl-flash-mla 1.0.0 wheel's contents (flash_mla/ + dist-info), its two
#                         extensions with debug info stripped (strip --strip-debug: 22.9 MB -> 8.3 MB;
#                         STRIP=0 keeps them whole); unpack into a folder on PYTHONPATH:
#                         mkdir -p /tmp/peers-site && tar xJf .carry/peers/sgl_flash_mla.tar.xz -C /tmp/peers-site
#   vllm/                 three modules taken verbatim from the vllm 0.33.0 wheel,
#                           v1/attention/ops/triton_decode_attention.py  (decode_attention_fwd)
#                           v1/attention/ops/triton_merge_attn_states.py (the Triton merge)
#                           v1/attention/ops/merge_attn_states.py        (vLLM's dispatcher, for reference)
#                         and shims written by this script (not vLLM code) for what they import:
#                           vllm/__init__.py (version only), vllm/platforms (current_platform: CUDA,
#                           fp8 dtype), vllm/triton_utils (triton, tl), empty v1 package __init__s.
#                         Put .carry/peers on PYTHONPATH.
#   MANIFEST.txt          versions, sha256 of the wheels, sizes, the import chain.
# FlashInfer is not extracted: flashinfer-python 0.7.4 is a 101 MB wheel (716 MB unpacked, mostly
# CUDA sources and CUTLASS/CCCL headers for its JIT) and needs apache-tvm-ffi, nvidia-cutlass-dsl,
# cuda-tile, nccl4py, nvidia-cudnn-frontend and more; `import flashinfer` imports all of its
# submodules. FLASHINFER=1 downloads it into the cache and prints those numbers.
#
# Usage: bash runners/fetch_peers.sh        (from anywhere; writes <repo>/.carry/peers)
# Env: PEERS_CACHE (download folder, default ${TMPDIR:-/tmp}/mla-diff-peer-wheels), PYTHON (python3),
#      STRIP (1), FLASHINFER (0). Needs: python3 with pip, tar with xz, strip (binutils) unless STRIP=0.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
CACHE=${PEERS_CACHE:-${TMPDIR:-/tmp}/mla-diff-peer-wheels}
OUT=.carry/peers
VLLM_VERSION=0.33.0
FLASH_MLA_VERSION=1.0.0
mkdir -p "$CACHE"
git check-ignore -q .carry/ || { echo "fetch_peers.sh: .carry/ is not git-ignored; refusing to write there" >&2; exit 2; }

# The GPU machine runs CPython 3.12 on x86-64 Linux; ask pip for wheels that install there.
dl() {
    "$PY" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        --platform any -d "$CACHE" "$1"
}
dl "vllm==$VLLM_VERSION"
dl "sgl-flash-mla==$FLASH_MLA_VERSION"
VLLM_WHL=$(ls "$CACHE"/vllm-"$VLLM_VERSION"-*.whl)
FMLA_WHL=$(ls "$CACHE"/sgl_flash_mla-"$FLASH_MLA_VERSION"-*.whl)

rm -rf "$OUT"
mkdir -p "$OUT"

# --- sgl-flash-mla ------------------------------------------------------------------------------
stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
"$PY" -m zipfile -e "$FMLA_WHL" "$stage/fmla"
if [ "${STRIP:-1}" = 1 ]; then
    strip --strip-debug "$stage"/fmla/flash_mla/*.so
fi
tar -C "$stage/fmla" -cJf "$OUT/sgl_flash_mla.tar.xz" .

# --- vLLM: three modules verbatim, shims for their imports --------------------------------------
"$PY" - "$VLLM_WHL" "$OUT" "$VLLM_VERSION" <<'EOF'
import ast, os, sys, zipfile
whl, out, version = sys.argv[1:]
take = [
    "vllm/v1/attention/ops/triton_decode_attention.py",
    "vllm/v1/attention/ops/triton_merge_attn_states.py",
    "vllm/v1/attention/ops/merge_attn_states.py",
]
with zipfile.ZipFile(whl) as z:
    for name in take:
        dst = os.path.join(out, name)
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        with open(dst, "wb") as f:
            f.write(z.read(name))

def shim(rel, text):
    path = os.path.join(out, rel)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)

HEAD = '"""Shim written by mla-diff\'s runners/fetch_peers.sh, not vLLM code: just enough of `{mod}` for the\nmodules extracted from the vllm {v} wheel next to it to import without the rest of vLLM."""\n'
shim("vllm/__init__.py", HEAD.format(mod="vllm", v=version) + f'''
__version__ = "{version}"
MLA_DIFF_EXTRACTED = "modules extracted from the wheel; vllm.platforms and vllm.triton_utils shimmed"
''')
for pkg in ("vllm/v1", "vllm/v1/attention", "vllm/v1/attention/ops"):
    shim(pkg + "/__init__.py", "")  # empty, as in the wheel
shim("vllm/platforms/__init__.py", HEAD.format(mod="vllm.platforms", v=version) + '''
import torch


class _CudaPlatform:
    """What the extracted kernels ask of vLLM's current_platform, answered for a CUDA (or ROCm) torch."""

    device_type = "cuda"

    def is_cuda(self):
        return torch.version.cuda is not None

    def is_rocm(self):
        return getattr(torch.version, "hip", None) is not None

    def is_cpu(self):
        return False

    def is_xpu(self):
        return False

    def fp8_dtype(self):
        return torch.float8_e4m3fnuz if self.is_rocm() else torch.float8_e4m3fn

    def __getattr__(self, name):
        raise AttributeError(f"mla-diff's vllm.platforms shim has no current_platform.{name}")


current_platform = _CudaPlatform()
''')
shim("vllm/triton_utils/__init__.py", HEAD.format(mod="vllm.triton_utils", v=version) + '''
import triton
import triton.language as tl

HAS_TRITON = True
LOG2E = 1.4426950408889634
LOGE2 = 0.6931471805599453
''')

# The import chain, checked: every vllm module the extracted files import at module level must be
# one we provide; imports inside functions are listed (they run only on paths the runner avoids).
provided = {"vllm", "vllm.platforms", "vllm.triton_utils", "vllm.v1", "vllm.v1.attention", "vllm.v1.attention.ops"}
provided |= {n[:-3].replace("/", ".") for n in take}
lines, missing = [], []
for name in take:
    tree = ast.parse(open(os.path.join(out, name)).read())
    top = set(id(n) for n in tree.body)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            mods, names = [node.module], [a.name for a in node.names]
        elif isinstance(node, ast.Import):
            mods, names = [a.name for a in node.names], []
        else:
            continue
        for m in mods:
            lazy = id(node) not in top
            lines.append(f"  {name}: {'(in a function) ' if lazy else ''}import {m}{' (' + ', '.join(names) + ')' if names else ''}")
            if m.split(".")[0] == "vllm" and m not in provided and not lazy:
                missing.append(f"{name}: {m}")
with open(os.path.join(out, "IMPORTS.txt"), "w") as f:
    f.write("\n".join(lines) + "\n")
if missing:
    sys.exit("fetch_peers.sh: extracted vLLM modules import modules no shim provides: " + "; ".join(missing))
EOF

# --- FlashInfer (measured only) ------------------------------------------------------------------
fi_note="flashinfer-python: not fetched (FLASHINFER=1 to download and measure it); not extracted"
if [ "${FLASHINFER:-0}" = 1 ]; then
    dl flashinfer-python
    FI_WHL=$(ls -t "$CACHE"/flashinfer_python-*.whl | head -1)
    fi_note=$("$PY" - "$FI_WHL" <<'EOF'
import sys, zipfile
z = zipfile.ZipFile(sys.argv[1])
unpacked = sum(i.file_size for i in z.infolist())
meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
deps = [l.split(":", 1)[1].strip() for l in z.read(meta).decode().splitlines() if l.startswith("Requires-Dist:") and "extra ==" not in l]
import os
print(f"{os.path.basename(sys.argv[1])}: {os.path.getsize(sys.argv[1])/1e6:.1f} MB wheel, {unpacked/1e6:.0f} MB unpacked, "
      f"{len(z.infolist())} files; needs {', '.join(deps)}; not extracted (does not fit a 64 MiB carry)")
EOF
)
fi

sha() { sha256sum "$1" | cut -d' ' -f1; }
{
    echo "peer packages for mla-diff's runners, made by runners/fetch_peers.sh on $(date -u +%Y-%m-%dT%H:%MZ)"
    echo "$(basename "$FMLA_WHL") sha256 $(sha "$FMLA_WHL") $(stat -c %s "$FMLA_WHL") B -> sgl_flash_mla.tar.xz $(stat -c %s "$OUT/sgl_flash_mla.tar.xz") B (strip-debug: ${STRIP:-1})"
    echo "$(basename "$VLLM_WHL") sha256 $(sha "$VLLM_WHL") $(stat -c %s "$VLLM_WHL") B -> vllm/ $(du -sb "$OUT/vllm" | cut -f1) B"
    echo "$fi_note"
    echo "imports of the extracted vLLM modules:"
    cat "$OUT/IMPORTS.txt"
} > "$OUT/MANIFEST.txt"
rm -f "$OUT/IMPORTS.txt"
cat "$OUT/MANIFEST.txt"
echo "total: $(du -sb "$OUT" | cut -f1) bytes in $OUT"
