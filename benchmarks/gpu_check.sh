#!/usr/bin/env bash
# The GPU checks of the accelerator fast path, as one script for one lent GPU (an H200):
# about 10 minutes at most, each command under its own timeout, every log kept.
#
#   bash benchmarks/gpu_check.sh      # logs in $OUT (a lent machine's), else /tmp/spmd-gpu-check
#   NO_INSTALL=1 MODEL=small SEQ=128 BATCH=4 PARITY_SEQ=256 bash benchmarks/gpu_check.sh   # its logic, on a CPU
#   ONLY=4 bash benchmarks/gpu_check.sh   # step 0's checks and step 4 alone
#
# 0. JAX sees the GPU (else `pip install -e ".[cuda12]"`, which needs the package index),
#    and every flag of spmd.run.xla_flags is known to this jaxlib (tests/test_xla_flags.py).
# 1. Parity in bfloat16 of the cudnn kernel against the chunked one (and the xla one), forward
#    and gradients, on one GPU (benchmarks/attention_parity.py).
# 2. MFU of llama3.2-1b, seq 2048, batch 16, bfloat16 on one GPU (benchmarks/mfu.py), with
#    spmd.run.xla_flags' flags (without them it measured the same on one H200: 47.3% against
#    47.4%, as one GPU has no collective to overlap), its peak memory as the device held it and
#    as XLA planned it. Batch 16 fits an H100: compiled ahead of time for one (`spmd.plan ...
#    --target h100x1`) XLA:GPU plans a peak of 59.6 GiB.
# 3. Dropless experts by jax.lax.ragged_all_to_all (ep = the GPUs there are; one GPU: ep=1)
#    against the padded all-to-all: the op compiles, outputs and gradients agree
#    (benchmarks/ragged_check.py; on a CPU it runs the op's model).
# 4. The trainer end to end on the GPU: the README's default job, then a bf16 run of `small`
#    that saves, is resumed and continues from its checkpoint (Orbax on device arrays).
# 5. spmd.plan of step 2's job on the GPU: the theory's memory beside XLA:GPU's own figures
#    for the compiled step, and the fused kernels in it.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
LOGS=${OUT:-/tmp/spmd-gpu-check}
mkdir -p "$LOGS" && rm -f "$LOGS"/[0-9].log "$LOGS/summary.log"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.95}  # JAX's default takes 75%
MODEL=${MODEL:-llama3.2-1b} SEQ=${SEQ:-2048} BATCH=${BATCH:-16} PARITY_SEQ=${PARITY_SEQ:-2048}
declare -a SUMMARY=()

step() {  # step NAME SECONDS COMMAND...: run it under a timeout, log it (NAME's prefix before
  # the first '-' names the log: at most 8 files come back from a lent machine), note its status
  local name=$1 limit=$2 log="$LOGS/${1%%-*}.log"
  shift 2
  if [ -n "${ONLY:-}" ] && [ "${name%%-*}" != 0 ] && [[ ",$ONLY," != *",${name%%-*},"* ]]; then
    return 0  # ONLY=2,4: those steps (and step 0's checks) alone
  fi
  echo "=== $name (at most ${limit}s): $*" | tee -a "$log"
  local start=$SECONDS
  timeout --kill-after=10 "$limit" "$@" 2>&1 | tee -a "$log"
  local rc=${PIPESTATUS[0]}
  SUMMARY+=("$name: exit $rc$([ "$rc" = 124 ] && echo ' (timed out)') in $((SECONDS - start))s")
  return "$rc"
}

GPU_JAX='import jax, flax, optax; print("jax", jax.__version__, "flax", flax.__version__, "optax", optax.__version__, jax.devices()); assert jax.default_backend() == "gpu", "no GPU"'
if ! step 0-jax 90 "$PY" -c "$GPU_JAX" && [ -z "${NO_INSTALL:-}" ]; then
  step 0-install 240 "$PY" -m pip install -q -e ".[cuda12]" && step 0-jax-again 90 "$PY" -c "$GPU_JAX"
fi
step 0-nvidia-smi 30 nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
step 0-flags 60 "$PY" -m pytest -q -n 0 -p no:cacheprovider tests/test_xla_flags.py

step 1-parity 120 "$PY" benchmarks/attention_parity.py --kernels cudnn,chunked,xla --dtype bfloat16 \
  --batch 2 --seq "$PARITY_SEQ" --kv-heads 8 --groups 4 --head-dim 64

step 2-mfu 200 "$PY" benchmarks/mfu.py --model "$MODEL" --seq "$SEQ" --batch "$BATCH" --dtype bfloat16 \
  --steps 10 --rounds 3

step 3-ragged 120 "$PY" benchmarks/ragged_check.py

RUNS=$(mktemp -d)
step 4-default 120 "$PY" -m spmd.train
step 4-save 120 "$PY" -m spmd.train --model small --dtype bfloat16 --steps 20 --save-every 10 --out "$RUNS/small"
step 4-resume 120 "$PY" -m spmd.train --model small --dtype bfloat16 --steps 30 --save-every 10 --out "$RUNS/small" \
  --resume-with-changes
rm -rf "$RUNS"

step 5-plan 150 "$PY" -m spmd.plan --model "$MODEL" --seq "$SEQ" --batch "$BATCH" --dtype bfloat16 --mesh dp=1

echo "=== summary"
printf '%s\n' "${SUMMARY[@]}" | tee "$LOGS/summary.log"
grep -h -E "^(xla|cudnn|chunked) vs|^(xla|cudnn|chunked):|MFU|ragged|error|FAILED|fell back|cannot take|passed|failed|resum|final|^step +(10|20|30) |peak|fits|fused kernels" \
  "$LOGS"/[0-9].log | tee -a "$LOGS/summary.log"
