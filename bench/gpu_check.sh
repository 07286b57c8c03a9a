#!/usr/bin/env bash
# The GPU checks of issues 2 and 5 in one call, each step under its own timeout:
#   bash bench/gpu_check.sh [steps...]   (default: stubs e2e tp tpforward)
set -uo pipefail
# shellcheck source=bench/gpu_env.sh
source bench/gpu_env.sh
out=${OUT:-/tmp/out}
mkdir -p "$out"
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(stubs e2e tp tpforward)
quiet() { grep -v -e Warning -e USDT; }
for what in "${steps[@]}"; do
  echo "=== $what ($(date +%T))"
  case $what in
    # The committed stubs under the image's own grpcio (1.84), not the carried one.
    stubs) env -u PYTHONPATH python3 -c "import grpc, sys; sys.path.insert(0, '.')
from distill_common.proto.teacher.v1 import teacher_pb2, teacher_pb2_grpc
print('stubs import under grpcio', grpc.__version__)" ;;
    e2e) timeout 170 python3 -m pytest -q -s -m gpu tests/gpu/test_nccl_end_to_end.py -p no:cacheprovider 2>&1 \
           | tee "$out/e2e.log" | quiet | tail -8 ;;
    tp) timeout 200 python3 -m pytest -q -s -m gpu tests/gpu/test_tp_gpu.py -p no:cacheprovider 2>&1 \
          | tee "$out/tp_tests.log" | quiet | tail -10 ;;
    tpforward) timeout 150 python3 -m torch.distributed.run --standalone --nproc-per-node 2 bench/tp_forward.py \
                 --profile "$out/tpprof" --out "$out/tp_forward.md" 2>&1 | quiet | tail -45 ;;
    restart) timeout 200 python3 -m pytest -q -s -m gpu tests/gpu/test_restart_nccl.py -p no:cacheprovider 2>&1 \
               | tee "$out/restart.log" | quiet | tail -8 ;;
    faults) timeout 200 python3 -m pytest -q -s -m gpu tests/gpu/test_gpu_faults.py -p no:cacheprovider 2>&1 \
              | tee "$out/faults.log" | quiet | tail -8 ;;
    *) bash bench/run_gpu.sh "$what" ;;
  esac
done
echo "=== done ($(date +%T))"
