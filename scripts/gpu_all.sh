#!/usr/bin/env bash
# Every GPU check and benchmark in one go, for the few minutes a GPU is lent: the kernels
# (gpu_check.py), the model path with CUDA graphs and async scheduling (gpu_model_check.py),
# the decode step of random-weight SmolLM2-135M- and Llama-3.1-8B-shaped checkpoints with
# graphs against --enforce-eager, Hugging Face and the weight-read limit (bench step --shape
# --compare-eager), the host cost of a step (bench step --overhead), and offline W1v on the
# 8B shape against Hugging Face's generate (bench throughput --shape). Each part has its
# own time limit, and a part that fails does not stop the others; logs, JSON and PNG files go
# to $OUT (default gpu-results/).
#
#     OUT=/path/to/results bash scripts/gpu_all.sh        # from the repository root
#
# Without an installed environment, PYTHON names an interpreter that has torch, triton and
# transformers, and PYTHONPATH may add a folder of wheels' contents (trio, trio-parallel...);
# triode itself is then imported from src/ through a link named triode.
set -u
OUT=${OUT:-gpu-results}
PY=${PYTHON:-python3}
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

part gpu_model_check 150 "$PY" scripts/gpu_model_check.py
part gpu_check 120 "$PY" scripts/gpu_check.py --budget 100
part step_smollm2 150 "$PY" -m triode.frontend.cli bench step --shape smollm2-135m --compare-eager \
    --batch-sizes 1 8 64 256 --context 512 --steps 16 --output-dir "$OUT/step-smollm2"
part step_llama8b 300 "$PY" -m triode.frontend.cli bench step --shape llama-3.1-8b --compare-eager \
    --batch-sizes 1 8 64 256 --context 512 --steps 16 --output-dir "$OUT/step-llama8b"
part overhead 120 "$PY" -m triode.frontend.cli bench step --overhead --model-steps 0 --repeats 2 \
    --output-dir "$OUT/overhead"
part throughput_llama8b 300 "$PY" -m triode.frontend.cli bench throughput --shape llama-3.1-8b --dtype bfloat16 \
    --workloads W1v --output-dir "$OUT/throughput-llama8b"
exit $status
