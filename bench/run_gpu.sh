#!/usr/bin/env bash
# One call on the GPU machine: the GPU tests and the benches named as arguments
# (tests, transport, pipeline, trace, profile, tp, busy, faults), each output kept under $OUT.
#   bash bench/run_gpu.sh tests transport pipeline
set -uo pipefail
# shellcheck source=bench/gpu_env.sh
source bench/gpu_env.sh
out=${OUT:-/tmp/out}
mkdir -p "$out"
nvidia-smi --query-gpu=index,name,memory.used,memory.total --format=csv
for what in "$@"; do
  echo "=== $what"
  case $what in
    tests) timeout 400 python3 -m pytest -q -m gpu tests/gpu -p no:cacheprovider -x 2>&1 | tee "$out/gpu_tests.log" | tail -15 ;;
    transport) timeout 400 python3 bench/transport_throughput.py --inflight 8 --out "$out/transport.md" 2>&1 | grep -v Warning | tail -12 ;;
    pipeline) timeout 500 python3 bench/distill_pipeline.py --out "$out/pipeline.md" 2>&1 | grep -v Warning | tail -12 ;;
    # Two student jobs saturating one teacher (issue 5): teacher_busy_fraction >= 0.90.
    busy) timeout 500 python3 bench/busy_fraction.py --out "$out/busy.md" 2>&1 | grep -v Warning | tail -20 ;;
    trace) timeout 200 python3 bench/transport_trace.py --size-mib 256 --batches 128 --inflight 16 2>&1 | grep -v Warning | tail -60 ;;
    profile) export PATH=/tmp/site/bin:$PATH
             timeout 200 python3 bench/transport_trace.py --size-mib 256 --batches 1000 --inflight 16 --profile "$out/profile" 2>&1 | grep -v Warning | head -20 ;;
    # Tensor parallelism (issue 5): TP=2 vs TP=1 through the server, then the send-path choice.
    tp) timeout 400 python3 -m pytest -q -s -m gpu tests/gpu/test_tp_gpu.py -p no:cacheprovider 2>&1 \
          | tee "$out/tp_tests.log" | grep -v Warning | tail -12
        timeout 300 python3 -m torch.distributed.run --standalone --nproc-per-node 2 bench/tp_send_choice.py \
          --out "$out/tp_send.md" 2>&1 | grep -v Warning | tail -16 ;;
    # Student faults (issue 4): a student killed with a 1 GiB send in flight; detection and recovery times.
    faults) timeout 400 python3 -m pytest -q -s -m gpu tests/gpu/test_gpu_faults.py -p no:cacheprovider 2>&1 \
              | tee "$out/gpu_faults.log" | grep -v Warning | tail -12 ;;
    *) echo "unknown step $what" ;;
  esac
done
