# GPU check of branch hfround (kernels round where transformers bf16 rounds). Run from the
# folder holding the wheel, ./cuda_ops, tests/ and benches/ (GPU_CHECK_hfround.md says how to
# build it): bash run.sh. Logs under $OUT/logs.tgz; the summary lines go to stdout.
set -u; cd "$(dirname "$0")"
libdirs=$(find /usr/local/cuda*/ /usr/lib/x86_64-linux-gnu -name "libnvrtc.so.1[23]*" -o -name "libcublas.so.1[23]*" 2>/dev/null | xargs -r -n1 dirname | sort -u | tr '\n' ':')
export LD_LIBRARY_PATH="$libdirs${LD_LIBRARY_PATH:-}" NINFER_KERNEL_CACHE=/tmp/nk PYTHONUNBUFFERED=1
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
L=/tmp/logs; mkdir -p $L; finish() { tar czf $OUT/logs.tgz -C $L . ; }; trap finish EXIT
C=${C:-hfround}
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site *.whl 2>&1 | grep -v WARNING | tail -2; export PYTHONPATH=/tmp/site
# 1. Op parity of every kernel this branch touched (CPU op at 1e-2 / bitwise contracts) and the
#    rounding-point tests (share of elements equal to an emulation of transformers' rounding).
timeout 100 ./cuda_ops rounding rmsnorm swiglu sigmoid rope gemv gdn conv --skip every_kernel_compiles --skip 27b_shape --test-threads 1 --nocapture > $L/cuda_ops_$C.log 2>&1; echo "cuda_ops rc $? t=$(el)"
grep -E "test result|FAILED|panicked|differs" $L/cuda_ops_$C.log | tail -12
grep -E "^ROUNDING" $L/cuda_ops_$C.log
# 2. Model parity vs transformers bf16 / f32 and the bitwise contracts (graph == eager, batch == alone).
timeout 170 python3 -m pytest -q -s -m gpu -p no:cacheprovider tests/test_gpu_model.py > $L/pytest_$C.log 2>&1; echo "pytest rc $? t=$(el)"
grep -E "passed|failed|^FAILED" $L/pytest_$C.log | tail -5
grep -E "rel err|greedy|tokens agree|perplexity|batched outputs" $L/pytest_$C.log | grep -v "^tests/" | head -40
# 3. Teacher-forced greedy agreement with transformers bf16 on the demo model (20 prompts x 64 steps).
timeout 100 python3 benches/diag_greedy_ties.py > $L/diag_greedy_ties_$C.log 2>&1; echo "diag rc $? t=$(el)"
grep -E "prompts equal" $L/diag_greedy_ties_$C.log
