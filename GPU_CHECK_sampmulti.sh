# Run on the GPU machine from .gpu-sampmulti (see GPU_CHECK_sampmulti.md). Writes logs to $OUT.
set -u; cd "$(dirname "$0")"
libdirs=$(find /usr/local/cuda*/ /usr/lib/x86_64-linux-gnu -name "libnvrtc.so.1[23]*" -o -name "libcublas.so.1[23]*" 2>/dev/null | xargs -r -n1 dirname | sort -u | tr '\n' ':')
export LD_LIBRARY_PATH="$libdirs${LD_LIBRARY_PATH:-}" NINFER_KERNEL_CACHE=/tmp/nk PYTHONUNBUFFERED=1
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site *.whl 2>&1 | grep -v WARNING | tail -2; export PYTHONPATH=/tmp/site
timeout 60 ./cuda_ops sampling:: --test-threads 1 --nocapture > $OUT/cuda_ops_sampling.log 2>&1; echo "cuda_ops sampling rc $? t=$(el)"
grep -E "test result|FAILED|panicked|TIMING" $OUT/cuda_ops_sampling.log
grep PARITY $OUT/cuda_ops_sampling.log | sort -t= -k5 -g | tail -3
timeout 30 ./cuda_ops argmax --test-threads 1 > $OUT/cuda_ops_argmax.log 2>&1; echo "cuda_ops argmax rc $? t=$(el)"; grep "test result" $OUT/cuda_ops_argmax.log
timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu_model.py > $OUT/pytest_gpu_model.log 2>&1; echo "pytest rc $? t=$(el)"; grep -E "passed|failed|^FAILED" $OUT/pytest_gpu_model.log | tail -5
timeout 80 python3 benches/gpu_bench.py --out $OUT/bench8.json --commit sampmulti --decode-8b --skip-peer > $OUT/bench8.log 2>&1; echo "bench8 rc $? t=$(el)"; grep -E "tok/s|sample" $OUT/bench8.log | tail -4
