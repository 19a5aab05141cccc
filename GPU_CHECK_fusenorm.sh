# GPU check of branch fusenorm (see GPU_CHECK_fusenorm.md). Run from a folder holding the wheels,
# the release cuda_ops test binary, tests/ and benches/: bash run.sh
set -u; cd "$(dirname "$0")"
libdirs=$(find /usr/local/cuda*/ /usr/lib/x86_64-linux-gnu -name "libnvrtc.so.1[23]*" -o -name "libcublas.so.1[23]*" 2>/dev/null | xargs -r -n1 dirname | sort -u | tr '\n' ':')
export LD_LIBRARY_PATH="$libdirs${LD_LIBRARY_PATH:-}" NINFER_KERNEL_CACHE=/tmp/nk PYTHONUNBUFFERED=1
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
L=/tmp/logs; mkdir -p $L; finish() { cp $OUT/*.json $L/ 2>/dev/null; tar czf $OUT/logs.tgz -C $L . ; }; trap finish EXIT
C=fusenorm
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site *.whl 2>&1 | grep -v WARNING | tail -2; export PYTHONPATH=/tmp/site
timeout 100 ./cuda_ops --test-threads 1 --nocapture rmsnorm gemv linear > $L/norm_ops_$C.log 2>&1; echo "norm ops rc $? t=$(el)"
grep -E "test result|FAILED|panicked|differs" $L/norm_ops_$C.log | head -8
timeout 40 ./cuda_ops --ignored --test-threads 1 --nocapture report_gemv_add_rmsnorm_throughput > $L/perf_$C.log 2>&1; echo "perf rc $? t=$(el)"
grep -E "op=gemv_add_rmsnorm" $L/perf_$C.log
timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu_model.py > $L/pytest_$C.log 2>&1; echo "pytest rc $? t=$(el)"; grep -E "passed|failed|^FAILED" $L/pytest_$C.log | tail -6
timeout 80 python3 benches/gpu_bench.py --out $OUT/bench8_fused.json --commit $C --decode-8b --skip-peer --keep-checkpoints > $L/bench8_fused.log 2>&1; echo "bench fused rc $? t=$(el)"; grep -E "record|copy|tok/s" $L/bench8_fused.log | tail -3
NINFER_FUSED_NORM=0 timeout 60 python3 benches/gpu_bench.py --out $OUT/bench8_unfused.json --commit $C-unfused --decode-8b --skip-peer > $L/bench8_unfused.log 2>&1; echo "bench unfused rc $? t=$(el)"; grep -E "record|copy|tok/s" $L/bench8_unfused.log | tail -3
