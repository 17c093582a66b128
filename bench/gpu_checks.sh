#!/bin/bash
# A lent GPU's checks for issue 41, as one command (device time is scarce): the CUDA tests, then
# bench/gpu_throughput.py per size. Python packages are the GPU image's own (torch, triton, transformers,
# grpcio, pytest); the tokenizer files travel (PDSERVE_TEST_TOKENIZER_DIR), the checkpoints are built there.
#
#   bash bench/gpu_checks.sh TOKDIR OUTDIR TEST_SECONDS "PYTEST ARGS" SIZE[:BENCH_SECONDS] ...
#
# With TUNE="ARGS;ARGS..." each ARGS first runs bench/tune_attention_tiles.py --save (e.g. TUNE="--kind prefill
# --heads 32 --kv-heads 8;--kind decode --seqs 128 --context 512 --heads 32 --kv-heads 8" for the 1B shape), so
# the benches launch attention with the tuned tiles.
#
# Engines size their KV cache by gpu_memory_utilization (0.9 of the device): give engine tests one pytest
# worker (-n 1, or -n 2 for the kernel-only files); ten workers on one GPU ran it out of memory.
set -u
tok=$1 out=$2 test_s=$3 tests=$4
shift 4
if ls .whl/*.whl > /dev/null 2>&1; then  # wheels the image lacks (llguidance), carried as .whl
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=/tmp/site || exit 1
fi
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PDSERVE_TEST_TOKENIZER_DIR=$tok
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 - <<'PY'
import inspect, torch, triton
print("torch", torch.__version__, "triton", triton.__version__, "capability", torch.cuda.get_device_capability())
try:
    from torch.nn.attention import varlen
    print("varlen_attn", inspect.signature(varlen.varlen_attn))
except Exception as exc:  # noqa: BLE001
    print("varlen_attn unavailable:", exc)
PY
if [ "$test_s" -gt 0 ]; then
    # shellcheck disable=SC2086
    timeout -s INT -k 20 "$test_s" python3 -m pytest -q -p no:cacheprovider -rfE --timeout 150 $tests > "$out/cuda_tests.log" 2>&1
    echo "pytest rc=$?"; tail -45 "$out/cuda_tests.log"
fi
IFS=';' read -ra tunes <<< "${TUNE:-}"
for i in "${!tunes[@]}"; do
    # shellcheck disable=SC2086
    timeout 300 python3 bench/tune_attention_tiles.py ${tunes[$i]} --save --output "$out/tune_$i.json" \
        > "$out/tune_$i.log" 2>&1
    echo "tune $i rc=$?"; tail -3 "$out/tune_$i.log"
done
for spec in "$@"; do
    size=${spec%%:*} secs=${spec#*:}
    [ "$secs" = "$spec" ] && secs=300
    timeout "$secs" python3 bench/gpu_throughput.py --size "$size" --tokenizer-dir "$tok" --workdir /tmp/gpu-bench \
        ${BENCH_ARGS:-} --output "$out/gpu_throughput_$size.json" > "$out/bench_$size.log" 2>&1
    echo "bench $size rc=$?"; grep -v "^ " "$out/bench_$size.log" | tail -25
done
