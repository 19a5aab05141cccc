#!/usr/bin/env bash
# Batch-1 decode of the Llama-3-8B shape (benches/gpu_bench.py --decode-8b) under a list of
# decode GEMV settings, one process per variant, one line per variant: which kernel each weight
# shape runs (NINFER_TC_GEMV, NINFER_GEMV_SHAPES) and how deep the tensor-core GEMV prefetches
# before its PDL wait (NINFER_TC_PREFETCH_STEPS), measured IN THE MODEL.
#
# Why: the per-shape table (GEMV_TC_RULES in ops/gemv.rs) came from an isolated cold-L2 sweep
# that put the 8B's qkv / o on tensor cores (+13-14% there), yet in the model that default
# decodes ~3% slower than CUDA cores everywhere (docs/performance-history.md "The decode GEMV choice").
# The settings are read once per device, so each variant is its own process; the random
# checkpoint is written by the first and kept (--keep-checkpoints, deleted at the end unless
# KEEP=1), so a variant costs ~15-18 s after the first (load from the page cache, warm-up
# request, 256 timed tokens).
#
# Usage: benches/gemv_variants.sh [VARIANTS_FILE]
#   VARIANTS_FILE: lines "NAME [VAR=VALUE ...]" ('#' comments); default: the list below.
#   BENCH: the bench script (default benches/gpu_bench.py; a stub tests this script);
#   BENCH_ARGS: extra gpu_bench.py arguments (e.g. "--tokens 512"); WORKDIR: checkpoint folder;
#   LOGDIR: per-variant logs (default $OUT or /tmp/gemv_variants); REPEAT: passes over the list;
#   COMBO=0: skip the combination run (see below).
# After the list, unless COMBO=0, one more variant "combo" runs every winner together: the
# NINFER_GEMV_SHAPES entries of the single-setting variants and the best
# NINFER_TC_PREFETCH_STEPS that beat the default ("base*" variants' mean tok/s) by more than the
# noise (the base variants' spread, at least 0.5%); that line is the candidate new default.
# Output: "VARIANT name tok_s=... fraction=... load_s=... env=..." per variant, then the same
# lines sorted by tok/s, and LOGDIR/gemv_variants.txt with them.
set -uo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
bench="${BENCH:-$here/gpu_bench.py}"
logdir="${LOGDIR:-${OUT:-/tmp/gemv_variants}}"
workdir="${WORKDIR:-/tmp/ninfer_bench}"
repeat="${REPEAT:-1}"
mkdir -p "$logdir"

# Llama-3-8B weight shapes (rows x K; gate_up is the fused weight, 2 x 14336 rows):
# qkv 6144x4096, o 4096x4096, gate_up 28672x4096, down 4096x14336, lm_head 128256x4096.
# This list was written against the session-5 table (qkv / o / gate_up on tensor cores at M = 1);
# since e22cb94 every shape runs on CUDA cores at M = 1, so the `*_cc` variants equal `base` and
# the informative ones move a shape to tensor cores (e.g. `down_tc`): pass a VARIANTS_FILE.
default_variants() {
    cat <<'EOF'
base
all_cc NINFER_TC_GEMV=0
qkv_cc NINFER_GEMV_SHAPES=6144x4096=cc
o_cc NINFER_GEMV_SHAPES=4096x4096=cc
gate_up_cc NINFER_GEMV_SHAPES=28672x4096=cc
down_tc NINFER_GEMV_SHAPES=4096x14336=w16u4
pf0 NINFER_TC_PREFETCH_STEPS=0
pf32 NINFER_TC_PREFETCH_STEPS=32
pf64 NINFER_TC_PREFETCH_STEPS=64
pf128 NINFER_TC_PREFETCH_STEPS=128
base_again
EOF
}

if [ $# -ge 1 ]; then
    variants="$(grep -v '^\s*#' "$1" | grep -v '^\s*$')"
else
    variants="$(default_variants)"
fi

summary="$logdir/gemv_variants.txt"
: > "$summary"
n=0
# run_variant NAME [VAR=VALUE ...]: one bench process, one VARIANT line.
run_variant() {
    local name="$1"; shift
    local settings="$*"
    n=$((n + 1))
    local log="$logdir/variant_${n}_${name}.log"
    # Every tuning variable unset unless the variant sets it: the parent's must not leak in.
    # shellcheck disable=SC2086
    env -u NINFER_TC_GEMV -u NINFER_GEMV_SHAPES -u NINFER_TC_PREFETCH_STEPS -u NINFER_CC_PREFETCH \
        -u NINFER_DA_MIN_WARP_KEYS -u NINFER_FUSED_ROPE -u NINFER_FUSED_NORM -u NINFER_CC_WARPS "$@" \
        python3 "$bench" --out "$logdir/variant_${n}_${name}.json" --commit "$name" --decode-8b \
        --skip-peer --keep-checkpoints --workdir "$workdir" ${BENCH_ARGS:-} < /dev/null > "$log" 2>&1
    local rc=$? out line tok load frac
    # "ninfer decode bs1 llama-3-8b: 209.40 tok/s (load 3.1 s), 0.738 of the copy rate"
    line="$(grep -E 'ninfer decode bs1 .*tok/s' "$log" | tail -1)"
    if [ $rc -eq 0 ] && [ -n "$line" ]; then
        tok=$(sed -E 's/.*: ([0-9.]+) tok\/s.*/\1/' <<<"$line")
        load=$(sed -E 's/.*\(load ([0-9.]+) s\).*/\1/' <<<"$line")
        frac=$(sed -E 's/.*, ([0-9.]+) of the copy rate.*/\1/' <<<"$line")
        out="VARIANT $name tok_s=$tok fraction=$frac load_s=$load env=${settings:-default}"
    else
        out="VARIANT $name FAILED rc=$rc env=${settings:-default}: $(grep -Ev '^\s*$' "$log" | tail -1)"
    fi
    echo "$out" | tee -a "$summary"
}

# No globbing while a variant's settings are split into words (`*=4` is a setting, not a pattern).
set -f
for pass in $(seq 1 "$repeat"); do
    while read -r name settings; do
        # shellcheck disable=SC2086
        run_variant "$name" $settings
    done <<<"$variants"
done
set +f

# The winners together: python reads the VARIANT lines and prints the combined settings (or
# nothing when no variant beat the default by more than the noise).
if [ "${COMBO:-1}" != 0 ]; then
    combo="$(python3 - "$summary" <<'PY'
import re, sys
rows = []
for line in open(sys.argv[1]):
    m = re.match(r"VARIANT (\S+) tok_s=([0-9.]+) .* env=(.*)$", line.strip())
    if m:
        env = {} if m[3] == "default" else dict(kv.split("=", 1) for kv in m[3].split())
        rows.append((m[1], float(m[2]), env))
base = [t for name, t, env in rows if name.startswith("base") and not env]
if not base:
    sys.exit(0)
mean = sum(base) / len(base)
noise = max(0.005, (max(base) - min(base)) / mean)
shapes = [env["NINFER_GEMV_SHAPES"] for _, t, env in rows
          if list(env) == ["NINFER_GEMV_SHAPES"] and t > mean * (1 + noise)]
pf = max(((t, env["NINFER_TC_PREFETCH_STEPS"]) for _, t, env in rows
          if list(env) == ["NINFER_TC_PREFETCH_STEPS"] and t > mean * (1 + noise)), default=None)
print(f"COMBO base mean {mean:.2f} tok/s, noise {100 * noise:.2f}%", file=sys.stderr)
out = ([f"NINFER_GEMV_SHAPES={','.join(shapes)}"] if shapes else []) + ([f"NINFER_TC_PREFETCH_STEPS={pf[1]}"] if pf else [])
print(" ".join(out))
PY
)"
    if [ -n "$combo" ]; then
        # shellcheck disable=SC2086
        run_variant combo $combo
    else
        echo "COMBO none: no variant beat the default by more than the noise" | tee -a "$summary"
    fi
fi
echo "--- by tok/s"
grep -v FAILED "$summary" | sort -t= -k2 -gr | tee "$summary.sorted"
if [ "${KEEP:-0}" != 1 ]; then rm -rf "$workdir"/llama-3-8b-*; fi
