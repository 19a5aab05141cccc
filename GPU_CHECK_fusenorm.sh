# GPU check of branch fusenorm-on-main (see GPU_CHECK_fusenorm.md). Run from a folder holding the
# wheels, the release cuda_ops test binary, tests/ and benches/: bash run.sh
set -u; cd "$(dirname "$0")"
libdirs=$(find /usr/local/cuda*/ /usr/lib/x86_64-linux-gnu -name "libnvrtc.so.1[23]*" -o -name "libcublas.so.1[23]*" 2>/dev/null | xargs -r -n1 dirname | sort -u | tr '\n' ':')
export LD_LIBRARY_PATH="$libdirs${LD_LIBRARY_PATH:-}" NINFER_KERNEL_CACHE=/tmp/nk PYTHONUNBUFFERED=1
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
L=/tmp/logs; mkdir -p $L; finish() { cp $OUT/*.json $L/ 2>/dev/null; tar czf $OUT/logs.tgz -C $L . ; }; trap finish EXIT
C=fusenorm
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site *.whl 2>&1 | grep -v WARNING | tail -2; export PYTHONPATH=/tmp/site
timeout 100 ./cuda_ops --test-threads 1 --nocapture rmsnorm gemv linear > $L/norm_ops_$C.log 2>&1; echo "norm ops rc $? t=$(el)"
grep -E "test result|FAILED|panicked|differs" $L/norm_ops_$C.log | head -8
timeout 60 ./cuda_ops --ignored --test-threads 1 --nocapture report_gemv_add_rmsnorm_throughput > $L/perf_$C.log 2>&1; echo "perf rc $? t=$(el)"
grep -E "op=gemv_add_rmsnorm" $L/perf_$C.log
timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu_model.py > $L/pytest_$C.log 2>&1; echo "pytest rc $? t=$(el)"; grep -E "passed|failed|^FAILED" $L/pytest_$C.log | tail -6
# Decode bs1, Llama-3-8B shape: default (per-shape GEMV; the down projection stays on CUDA cores
# unfused), then every projection on tensor cores (every output projection fused), each with
# the fusion off. The first run keeps the random checkpoint for the others.
b() { local tag=$1; shift; env "$@" timeout 70 python3 benches/gpu_bench.py --out $OUT/bench8_$tag.json --commit $C-$tag --decode-8b --skip-peer --keep-checkpoints > $L/bench8_$tag.log 2>&1; echo "bench $tag rc $? t=$(el)"; grep -E "record|copy|tok/s" $L/bench8_$tag.log | tail -2; }
b byshape_fused NINFER_FUSED_NORM=1
b tc_fused NINFER_TC_GEMV=1 NINFER_FUSED_NORM=1
b byshape_unfused NINFER_FUSED_NORM=0
b tc_unfused NINFER_TC_GEMV=1 NINFER_FUSED_NORM=0
