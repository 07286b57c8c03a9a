#!/usr/bin/env bash
# One call on the GPU machine: the GPU tests and benches named as arguments, each under its
# own timeout, each output kept under $OUT:
#   bash bench/run_gpu.sh stubs e2e tp tpforward transport
# tests: every GPU test; or one file each: e2e, tp, restart, faults, graphs, dataplane, isolation, logprobs, fp8,
# hostile.
# Benches: transport, transportgraphs, pipeline, busy, trace, tracegraphs, profile, tpforward, connect, connectcpu,
# scorecost;
# one GPU: launch, recipe (the seed recipe's student side), eagle3 (EAGLE-3 with a colocated target),
# store (the store of teacher outputs: bytes per token, dump against the forward alone, reads);
# fp8speed and fp8quality (the FP8 teacher: bench/fp8_teacher.py's two halves), fp8torchao and
# fp8torchaoquality (the same halves for torchao's float8 against ours; its wheel carried in .whl/);
# eagle3attention (its fused attention's GPU test), eagle3kernels (the attention's kernel choice);
# moe (the MoE teacher's kernels against transformers' eager forward, then bench/moe_teacher.py: Qwen3-30B-A3B- and
# gpt-oss-20b-shaped forwards beside Llama-3-8B's, a profile of Qwen's); moefp8 (the FP8 experts' kernels alone, then
# the Qwen3-30B-A3B-shaped forward in bf16 and FP8);
# two GPUs: recipeserved (the seed recipe with its teacher served, and colocated), eagle3served and
# eagle3servedlong (EAGLE-3 from a served target, with the colocated baseline).
# Investigations (bench/investigations/): tpsend, disk, fp8tiles, fp8tileswidek, fp8gap, fp8gapgraphs,
# fp8gapgraphsnotma, fp8gapgraphsrouter, fp8gapgraphssort, fp8gapgraphsinductor, quantize, qkv, topk.
# Run from the repository root: every bench is a module of this checkout (python3 -m bench.x).
set -uo pipefail
# shellcheck source=bench/gpu_env.sh
source bench/gpu_env.sh
out=${OUT:-/tmp/out}
mkdir -p "$out"
nvidia-smi --query-gpu=index,name,memory.used,memory.total --format=csv
quiet() { grep -v -e Warning -e USDT; }
gpu_test() {  # FILE SECONDS: one GPU test file, its log kept
  timeout "$2" python3 -m pytest -q -s -m gpu "tests/gpu/$1.py" -p no:cacheprovider 2>&1 | tee "$out/$1.log" | quiet | tail -10
}
torchrun2=(python3 -m torch.distributed.run --standalone --nproc-per-node 2)
for what in "$@"; do
  echo "=== $what ($(date +%T))"
  case $what in
    # The committed stubs under the image's own grpcio (1.84), not the carried one.
    stubs) env -u PYTHONPATH python3 -c "import grpc
from distill_common.proto.teacher.v1 import teacher_pb2, teacher_pb2_grpc
print('stubs import under grpcio', grpc.__version__)" ;;
    tests) timeout 580 python3 -m pytest -q -m gpu tests/gpu -p no:cacheprovider 2>&1 | tee "$out/gpu_tests.log" | tail -15 ;;
    e2e) gpu_test test_nccl_end_to_end 170 ;;
    tp) gpu_test test_tp_gpu 200 ;;
    restart) gpu_test test_restart_nccl 200 ;;
    # A student killed with a 1 GiB send in flight; detection and recovery times.
    faults) gpu_test test_gpu_faults 200 ;;
    graphs) gpu_test test_cuda_graphs 200 ;;
    # The per-batch header on the device, NCCL on the rendezvous store, a tampering teacher.
    dataplane) gpu_test test_nccl_data_plane 200 ;;
    # Hostile students of a CUDA teacher (gloo and NCCL peers): their sessions end, the teacher lives.
    hostile) gpu_test test_hostile_peer_gpu 300 ;;
    # Join to group formed through a transport process and inline, a CUDA teacher and CPU students.
    connectcpu) timeout 300 python3 -m bench.connect_time --teacher-device cuda:0 --student-device cpu \
                  --session-transport process,inline --out "$out/connect_cpu_students.md" 2>&1 | quiet | tail -12 ;;
    # The teacher's memory running out: a pack served batch by batch, top-k of the vocabulary failing alone.
    isolation) gpu_test test_isolation_gpu 150 ;;
    # Log-probabilities at given tokens over NCCL, a 128k vocabulary in row chunks on the device.
    logprobs) gpu_test test_logprobs_gpu 200 ;;
    # A published-format FP8 checkpoint and --quantize fp8 (with CUDA graphs) against dequantized references.
    fp8) gpu_test test_fp8_gpu 200 ;;
    # The FP8 teacher's forward against bf16, 8B-shaped at 2 x 4096 and 4 x 8192 (docs/performance.md).
    fp8speed) timeout 400 python3 -m bench.fp8_teacher --sections speed --iters 5 --profile row-layers \
                --variants bf16,row-layers,row-served,row-eager,row-qcompile,block-layers,block-served \
                --out "$out/fp8_speed.md" 2>&1 | quiet | tail -60 ;;
    # torchao's float8 against ours on the same 8B-shaped forward, then on the trained model's distribution.
    fp8torchao) timeout 560 python3 -m bench.fp8_teacher --sections speed --iters 5 --profile ao-row-layers \
                  --variants bf16,row-layers,row-layers+fastacc,ao-row-layers,ao-row-layers+nofastacc,ao-row-model,block-layers,ao-block-layers \
                  --out "$out/fp8_torchao_speed.md" 2>&1 | quiet | tail -60 ;;
    fp8torchaoquality) timeout 400 python3 -m bench.fp8_teacher --sections quality --torchao --students 0 \
                  --train-s "${FP8_TRAIN_S:-40}" --out "$out/fp8_torchao_quality.md" 2>&1 | quiet | tail -30 ;;
    # What the machine's disk gives one process (the ceiling of the store's reads).
    disk) timeout 200 python3 -m bench.investigations.disk_read --size-gib 2 --threads 1,4,16 --chunks-mib 32,4 \
            --out "$out/disk.md" 2>&1 | tail -30 ;;
    # What FP8 does to a trained teacher's distribution, and to students distilled from it.
    fp8quality) timeout 400 python3 -m bench.fp8_teacher --sections quality --train-s "${FP8_TRAIN_S:-120}" \
                  --out "$out/fp8_quality.md" 2>&1 | quiet | tail -30 ;;
    # The engine's host time per forward of the bench model, eager and with CUDA graphs (one GPU).
    launch) timeout 300 python3 -m bench.forward_launch --cuda-graphs 16 --side-threads 0,3 --out "$out/launch.md" 2>&1 | quiet | tail -40 ;;
    transport) timeout 400 python3 -m bench.transport_throughput --inflight 8,16 --out "$out/transport.md" 2>&1 | quiet | tail -12 ;;
    # The same with the teacher's decoder replayed from CUDA graphs: 64 shapes, as every size
    # packs 1..16 batches per forward and one server serves all four sizes.
    transportgraphs) timeout 400 python3 -m bench.transport_throughput --inflight 8,16 --cuda-graphs 64 \
                       --out "$out/transport_graphs.md" 2>&1 | quiet | tail -12 ;;
    # The teacher's cost per scored token: log-probabilities at given tokens against full bf16 logits.
    scorecost) timeout 400 python3 -m bench.score_cost --device cuda:0 --student-device cuda:1 --dtype bfloat16 \
                 --rows 4 --seq 2048 --batches 20 --out "$out/score_cost.md" 2>&1 | quiet | tail -12 ;;
    pipeline) timeout 500 python3 -m bench.distill_pipeline --out "$out/pipeline.md" 2>&1 | quiet | tail -12 ;;
    # Two student jobs saturating one teacher: teacher_busy_fraction >= 0.90.
    busy) timeout 500 python3 -m bench.busy_fraction --out "$out/busy.md" 2>&1 | quiet | tail -20 ;;
    trace) mkdir -p "$out/trace"
           timeout 200 python3 -m bench.transport_trace --size-mib 256 --batches 128 --inflight 16 --keep "$out/trace" 2>&1 | quiet | head -45 ;;
    tracegraphs) timeout 200 python3 -m bench.transport_trace --size-mib 256 --batches 128 --inflight 16 --cuda-graphs 64 2>&1 | quiet | head -45 ;;
    profile) export PATH=/tmp/site/bin:$PATH
             timeout 200 python3 -m bench.transport_trace --size-mib 256 --batches 1000 --inflight 16 --profile "$out/profile" 2>&1 | quiet | head -20 ;;
    # The seed recipe's student (deepseek-coder-6.7b-shaped, LoRA, bf16, grad ckpt): full logits vs head on student.
    recipe) timeout 240 python3 -m bench.recipe_student --out "$out/recipe.md" 2>&1 | quiet | tail -12 ;;
    # The seed recipe served (teacher GPU 0, trainer GPU 1) against each side alone and against the teacher
    # in the student's process (GPU 1): peak GiB per GPU, tokens/s, served vs min(teacher, student).
    recipeserved) timeout 550 python3 -m bench.recipe_served --teacher-gpu 0 --student-gpu 1 \
                    --out "$out/recipe_served.md" 2>&1 | quiet | tail -24 ;;
    # EAGLE-3 draft training with a Llama-3-8B-shaped target in the same process (one GPU): the reference
    # and the fused path, tokens/s, TFLOP/s and share of the bf16 peak, peak memory, at 2k .. 64k tokens,
    # each step's loss on both paths, and a profile of a fused step at 2k and 16k (docs/eagle3.md).
    eagle3) timeout 300 python3 -m bench.eagle3_colocated --profile-dir "$out" --out "$out/eagle3_colocated.md" 2>&1 \
              | quiet | tail -60 ;;
    # The unroll's fused attention against the chunked reference in bf16, values and gradients (one GPU).
    eagle3attention) gpu_test test_eagle3_attention_gpu 120 ;;
    # Which causal kernel the fused attention merges with: flash, cudnn, flex (one GPU).
    eagle3kernels) timeout 150 python3 -m bench.investigations.ttt_attention_kernels --out "$out/ttt_kernels.md" 2>&1 \
                     | quiet | tail -20 ;;
    # Tiny MoE models served in bf16 against transformers' eager forward in float32; then tokens/s, share of
    # the bf16 peak, peak memory and expert imbalance at 2 x 4096 and 4 x 8192 (docs/performance.md).
    moe) gpu_test test_moe_gpu 400
         timeout 560 python3 -m bench.moe_teacher --profile qwen3-30b-a3b --profile-dir "$out" \
           --out "$out/moe_teacher.md" 2>&1 | quiet | tail -60 ;;
    # FP8 experts: the grouped FP8 kernels alone (Qwen3-30B-A3B and gpt-oss-20b layers), then the
    # Qwen3-30B-A3B-shaped forward in bf16 and FP8 (fast accumulation, promoted sums, block scales) with
    # profiles. Its timings come right after each build, when the host stalls at times: the ratio to
    # quote is fp8gap's (both models in one process, timed in turns).
    moefp8) timeout 200 python3 -m bench.moe_teacher --models qwen3-30b-a3b,gpt-oss-20b --shapes '' \
              --experts-probe --iters 10 --out "$out/moe_probe.md" 2>&1 | quiet | tail -60
            timeout 400 python3 -m bench.moe_teacher --models qwen3-30b-a3b --shapes 2x4096 --baseline-shapes '' \
              --router-std 0 --iters 5 --quantize --fp8-scalings row+fastacc,row,block --profile qwen3-30b-a3b \
              --profile-dir "$out" --out "$out/moe_fp8.md" 2>&1 | quiet | tail -20 ;;
    # The grouped FP8 kernels' variants on Qwen3-30B-A3B's layer (plain, persistent; tiles, TMA, flattening).
    fp8tiles) timeout 400 python3 -m bench.investigations.fp8_grouped_tiles --out "$out/tiles.md" 2>&1 | quiet | tail -60 ;;
    # Only the K steps of 256 and 64 (row scales), beside the autotuned set's fastest tile.
    fp8tileswidek) timeout 300 python3 -m bench.investigations.fp8_grouped_tiles --out "$out/tiles_widek.md" \
        --variants ' k256 , k64 ,128x256 w8 s4 x1 flat' 2>&1 | quiet | tail -60 ;;
    # bf16 and FP8 (fast accumulation) Qwen3-30B-A3B-shaped forwards built in one process, timed in turns.
    fp8gap) timeout 400 python3 -m bench.investigations.fp8_forward_gap --variants bf16,fp8,fp8-inductor \
              --out "$out/gap.md" 2>&1 | quiet | tail -20 ;;
    # The same under --cuda-graphs (the decoder replayed as one graph: the timed forward without host gaps).
    fp8gapgraphs) timeout 400 python3 -m bench.investigations.fp8_forward_gap --cuda-graphs 2 --kernels 40 \
              --out "$out/gap_graphs.md" 2>&1 | quiet | tail -110 ;;
    # The same without the 128 x 256 tile that reads its weights through TMA (as served before 2026-12-06).
    fp8gapgraphsnotma) timeout 400 python3 -m bench.investigations.fp8_forward_gap --cuda-graphs 2 --kernels 12 \
              --no-tma --out "$out/gap_graphs_notma.md" 2>&1 | quiet | tail -50 ;;
    # The same with the routers as the model writes them (inductor's softmax, torch's top-k) instead of
    # teacher_server/routing.py's kernel: the kernel's share of both forwards.
    fp8gapgraphsrouter) timeout 400 python3 -m bench.investigations.fp8_forward_gap --cuda-graphs 2 --kernels 16 \
              --router torch --out "$out/gap_graphs_router.md" 2>&1 | quiet | tail -60 ;;
    # The routers as the model writes them, their top-k through inductor's sort, both forwards.
    fp8gapgraphssort) timeout 400 python3 -m bench.investigations.fp8_forward_gap --cuda-graphs 2 --kernels 16 \
              --router torch --inductor triton.decompose_sort_ops=True --out "$out/gap_graphs_sort.md" 2>&1 \
              | quiet | tail -60 ;;
    # The same with o's and down's inputs quantized by inductor (the kernel's share under graphs: against fp8gapgraphs).
    fp8gapgraphsinductor) timeout 400 python3 -m bench.investigations.fp8_forward_gap --cuda-graphs 2 \
              --variants bf16,fp8-inductor --out "$out/gap_graphs_inductor.md" 2>&1 | quiet | tail -24 ;;
    # The FP8 forward's activation quantizations: inductor's against a Triton kernel written for them.
    quantize) timeout 200 python3 -m bench.investigations.quantize_rows_speed --out "$out/quantize.md" 2>&1 | quiet \
                | tail -12 ;;
    # One FP8 product for q, k and v against three (Qwen3-30B-A3B's and Llama-3-8B's attention shapes).
    qkv) timeout 120 python3 -m bench.investigations.qkv_fusion --out "$out/qkv.md" 2>&1 | quiet | tail -8 ;;
    # The MoE router's softmax and top-k: torch's top-k kernel against inductor's sort (Qwen3-30B-A3B's router).
    topk) timeout 120 python3 -m bench.investigations.router_topk --out "$out/topk.md" 2>&1 | quiet | tail -8 ;;
    # The stores are written under /tmp (local disk) and removed after.
    store) timeout 400 python3 -m bench.store_throughput --profile --out "$out/store.md" 2>&1 | quiet | tail -40 ;;
    # EAGLE-3 draft training from a served Llama-3-8B-shaped target (GPU 0) on GPU 1 at 2k .. 32k tokens: target
    # alone, draft alone, served, then the colocated baseline on GPU 1, one run (about 5 minutes estimated from the
    # colocated figures: 3 timed steps of the draft's, alone and served, dominate).
    eagle3served) timeout 550 python3 -m bench.eagle3_served --steps 3 --out "$out/eagle3_served.md" 2>&1 | quiet | tail -40 ;;
    # The same at 48k and 64k tokens, one timed step each: does the served draft train at twice the longest
    # colocated length (32k, docs/eagle3.md)?
    eagle3servedlong) timeout 550 python3 -m bench.eagle3_served --seq-lens 49152,65536 --steps 1 \
                        --out "$out/eagle3_served_long.md" 2>&1 | quiet | tail -40 ;;
    # Tensor parallelism: the TP=2 forward against TP=1.
    tpforward) timeout 200 "${torchrun2[@]}" -m bench.tp_forward --profile "$out/tpprof" --out "$out/tp_forward.md" 2>&1 | quiet | tail -8 ;;
    # Gathered logits from rank 0 or a vocabulary shard from each rank (docs/performance.md).
    tpsend) timeout 300 "${torchrun2[@]}" -m bench.investigations.tp_send_choice --out "$out/tp_send.md" 2>&1 | quiet | tail -16 ;;
    # Join to group formed over NCCL (teacher GPU 0, students GPU 1): what --join-timeout-s must exceed.
    connect) timeout 300 python3 -m bench.connect_time --teacher-device cuda:0 --student-device cuda:1 \
               --out "$out/connect.md" 2>&1 | quiet | tail -8 ;;
    *) echo "unknown step $what" ;;
  esac
done
echo "=== done ($(date +%T))"
