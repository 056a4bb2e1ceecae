# Shared by bench/gpu-check.sh and bench/gpu-bench.sh (sourced from the repository root; not run alone).
# Reads B (the mla-diff binary; default target/release/mla-diff, or .carry/NAME/mla-diff.xz unpacked),
# OUT (results folder; default gpu-out), BUDGET (seconds for the whole call; default 540, the device's
# per-call limit less the packing). Sets D="$OUT/$NAME", fail; defines step, left, tmo, timed, expect,
# peers_env, kdir, run_steps; writes $D/env.txt (date, commit, GPU, host cores).
export LD_LIBRARY_PATH=/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export NO_COLOR=1 PYTHONUNBUFFERED=1
OUT=${OUT:-gpu-out}
BUDGET=${BUDGET:-540}
if [ -z "${B:-}" ] && [ -f ".carry/$NAME/mla-diff.xz" ]; then
    B=/tmp/mla-diff-$NAME
    xz -dc ".carry/$NAME/mla-diff.xz" > "$B" && chmod +x "$B"
fi
B=${B:-target/release/mla-diff}
D="$OUT/$NAME"
mkdir -p "$D"
fail=0
step() { echo "$1: exit $2"; [ "$2" -eq 0 ] || fail=1; }
left() { echo $((BUDGET - SECONDS)); }
# A step's timeout: T seconds, or what is left of the budget less 8 (so the call always packs its files).
tmo() { local l=$(($(left) - 8)); echo $(($1 < l ? $1 : l)); }
# timed LABEL T FILE CMD…: one step under its timeout, output in FILE, its exit code captured before
# anything else runs (a `$(tail …)` in the same line would overwrite `$?`). Skipped near the budget's end.
timed() {
    local label=$1 t=$2 f=$3 t0=$SECONDS rc
    shift 3
    [ "$(left)" -gt 30 ] || { echo "skip $label: budget"; fail=1; return 0; }
    timeout "$(tmo "$t")" "$@" > "$f" 2>&1
    rc=$?
    step "$label ($((SECONDS - t0)) s): $(tail -1 "$f" | cut -c1-160)" $rc
}
# expect WANT RC WHAT: one summary line; a mismatch fails the call.
expect() {
    local want=$1 rc=$2
    shift 2
    if [ "$rc" -eq "$want" ]; then echo "ok    $* (exit $rc)"; else echo "FAIL  $* (exit $rc, expected $want)"; fail=1; fi
}
# The peers (FlashMLA, vLLM TRITON_MLA, torch SDPA on cuDNN) from .carry/peers (runners/fetch_peers.sh).
peers_env() {
    [ -d .carry/peers ] || { echo "no .carry/peers: peers unavailable (bash runners/fetch_peers.sh)"; return 0; }
    [ -d /tmp/peers-site/flash_mla ] || { mkdir -p /tmp/peers-site && tar xJf .carry/peers/sgl_flash_mla.tar.xz -C /tmp/peers-site; }
    export PYTHONPATH="$PWD/.carry/peers:/tmp/peers-site${PYTHONPATH:+:$PYTHONPATH}" MLA_DIFF_PYTHON=python3
    export MLA_DIFF_SDPA_BACKEND=cudnn
}
# kdir ITEM: a kernel directory for `--kernels`. ITEM is a directory (used as is) or a probe patch
# (bench/probes/*.patch: applied to a copy of kernels/ under $D/k/NAME, whose path is printed).
kdir() {
    case "$1" in
    *.patch)
        local k
        k="$D/k/$(basename "$1" .patch)"
        rm -rf "$k" && mkdir -p "$(dirname "$k")" && cp -r kernels "$k"
        patch -s -d "$k" -p2 < "$1" || { echo "probe $1 does not apply to kernels/" >&2; return 1; }
        echo "$k"
        ;;
    *) echo "$1" ;;
    esac
}
# run_steps DEFAULT [STEP…]: the script's steps (functions; DEFAULT, a list, when none is given) in order,
# then $D packed into $OUT/$NAME.tar.gz and the summary line; exits 0 when every step passed.
run_steps() {
    local t default=$1
    shift
    STEPS=${*:-$default}
    for t in $STEPS; do
        declare -F "$t" > /dev/null || { echo "mla-diff: error: bench/gpu-$NAME.sh: unknown step '$t'" >&2; exit 2; }
    done
    for t in $STEPS; do "$t"; done
    echo "left: $(left) s"
    tar czf "$OUT/$NAME.tar.gz" -C "$OUT" "$NAME" && rm -rf "$D"
    echo "$([ $fail -eq 0 ] && echo PASS || echo FAIL): bench/gpu-$NAME.sh $STEPS ($SECONDS s)"
    exit $fail
}
{
    date -u
    echo "commit $(cat ".carry/$NAME/COMMIT" 2>/dev/null || git rev-parse --short HEAD 2>/dev/null || echo unknown)"
    nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader
    echo "host cores $(nproc)"
} | tee "$D/env.txt"
