# Run on the GPU machine from .gpu-bf16logits (see GPU_CHECK_bf16logits.md). Writes logs to $OUT.
set -u; cd "$(dirname "$0")"
libdirs=$(find /usr/local/cuda*/ /usr/lib/x86_64-linux-gnu -name "libnvrtc.so.1[23]*" -o -name "libcublas.so.1[23]*" 2>/dev/null | xargs -r -n1 dirname | sort -u | tr '\n' ':')
export LD_LIBRARY_PATH="$libdirs${LD_LIBRARY_PATH:-}" NINFER_KERNEL_CACHE=/tmp/nk PYTHONUNBUFFERED=1
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site *.whl 2>&1 | grep -v WARNING | tail -2; export PYTHONPATH=/tmp/site
timeout 60 ./cuda_ops logits_round --test-threads 1 > $OUT/cuda_ops_logits_round.log 2>&1; echo "cuda_ops logits_round rc $? t=$(el)"; grep -E "test result|FAILED|panicked" $OUT/cuda_ops_logits_round.log
timeout 60 ./cuda_ops sampling::device_greedy --test-threads 1 > $OUT/cuda_ops_greedy.log 2>&1; echo "cuda_ops greedy ties rc $? t=$(el)"; grep -E "test result|FAILED|panicked" $OUT/cuda_ops_greedy.log
timeout 90 ./cuda_ops gemv --test-threads 1 > $OUT/cuda_ops_gemv.log 2>&1; echo "cuda_ops gemv rc $? t=$(el)"; grep -E "test result|FAILED|panicked" $OUT/cuda_ops_gemv.log
timeout 300 python3 -m pytest -q -s -m gpu -p no:cacheprovider tests/test_gpu_model.py > $OUT/pytest_gpu_model.log 2>&1; echo "pytest rc $? t=$(el)"
grep -E "prompts equal transformers|greedy tokens equal|passed|failed|^FAILED" $OUT/pytest_gpu_model.log | tail -12
