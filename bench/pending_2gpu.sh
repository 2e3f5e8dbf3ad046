#!/usr/bin/env bash
# The 2-GPU measurements the open issues wait for, one part per device call (each fits the 10-minute
# limit of a device command). On the device machine, from the repository root:
#
#     bash bench/pending_2gpu.sh watch|fsdp|fsdp-b1|moe|moe-ce|pipeline|pipeline-cut|pipeline-zb|suite|suite-ce|hf_moe  [OUT dir, default $OUT]
#
# Each part writes its JSON and log under OUT and prints the table; record results in bench/RESULTS.md
# (date, machine, command). In priority order (session 25 ran fsdp, moe, moe-ce, pipeline, suite-ce and
# an NCCL-CTA sweep on 2x H200; RESULTS):
#   watch     the tests of session 25's code that never ran to a summary on a GPU: a stalled peer under
#             CUDA graphs ends the step (replay watch; if it fails, it hangs until this part's timeout),
#             the non-finite read that waits for its own step only, the copy-engine reduce-scatter's
#             one-pass sum kernel (bf16 rounding only checkable there) (~2 min); then suite-ce, which
#             checks that sum bit-identical to NCCL inside real steps (~2.5 min)
#   fsdp      issue 15: GPT 1b ZeRO-3 at batch 4 against one GPU's compiled step, next to one GPU's fxshard
#             step, two rounds (A B A B: medians), profiled (kernel time by class, idle gaps). Session 25:
#             1.02-1.04x in three jobs, the one-GPU baseline itself moving 3% between jobs; NCCL_PROTO=Simple
#             and fewer NCCL CTAs did not help, copy engines only traded GEMM time for sums and copies (~5 min)
#   fsdp-b1   the same at batch 1 and 4 with FSDP2 + compile, the peer the issue names (~4 min)
#   moe       issue 15: MoE ep=2, dual-batch, NCCL and copy-engine all-to-alls (>= 30% MFU, >= 90% hidden),
#             each mode profiled (~3 min)
#   pipeline  issue 14: bench/pipeline.py 1F1B and interleaved V=2 with the peer; the eager rows now name each
#             chunk's heaviest kernels per F and B (why stage 0's backward is slow) (~6 min; pipeline-zb: ZB-H1,
#             not run on H200 since session 19)
#   pipeline-cut  the same job with the cut moved by one block (--stage-layers 9,9 4,5,5,4), graphed only, next to
#             pipelining + compile: on the FLOP-balanced cut stage 0's F+B took 16-17 ms a microbatch against
#             stage 1's 12.8 in sessions 24 and 25 (1F1B, H200), so the measured costs ask for a block fewer
#             there (~5 min)
#   suite     the other multigpu tests (~7 min)
#   suite-ce  the copy-engine multigpu tests (passed in session 25, before the reduce-scatter's sum kernel)
#   moe-ce    ran through in session 25 (no stall); hf_moe: issue 17's model at ep=2
set -euo pipefail
part=${1:?usage: bench/pending_2gpu.sh PART [OUT]}
out=${2:-${OUT:?set OUT or pass a directory}}
mkdir -p "$out"
day=$(date +%F)
case "$part" in
  moe) timeout 580 python bench/moe.py --gpus 2 --ep 2 --chunks 1 --all-to-all nccl copy-engine --microbatches 2 \
         --interleave dual-batch --warmup 3 --iters 8 --profile "$out/moe_profile" --out "$out/moe_2gpu_$day.json" \
         2>&1 | tee "$out/moe.log" | grep -v "codegen: region" | tail -40
       # per mode: kernel time by class, and the copy engines' time beside kernels (what ep-overlap1-ce
       # left exposed in session 24: 26%); one archive, the device tool returns at most 8 files
       tar czf "$out/moe_profile.tgz" -C "$out" moe_profile && rm -r "$out/moe_profile" ;;
  moe-ce) timeout 580 python bench/moe.py --collective-timeout 60 --gpus 2 --ep 2 --chunks 1 --all-to-all copy-engine --microbatches 2 \
         --interleave dual-batch --fsdp-collectives copy-engine --warmup 3 --iters 8 \
         --out "$out/moe_ce_2gpu_$day.json" 2>&1 | tee "$out/moe_ce.log" | grep -v "codegen: region" | tail -40 ;;
  fsdp) timeout 570 python bench/fsdp.py --gpus 2 --batch 4 --rounds 2 --modes nocomm-compile nocomm-fxshard fxshard \
          fxshard-ce --profile "$out/fsdp_profile" --out "$out/fsdp_2gpu_$day.json" 2>&1 | tee "$out/fsdp.log" \
          | grep -v "codegen: region" | tail -30
        # one file for the profiles (a mode and batch each): the device tool returns at most 8 files
        tar czf "$out/fsdp_profile.tgz" -C "$out" fsdp_profile && rm -r "$out/fsdp_profile" ;;
  fsdp-b1) timeout 570 python bench/fsdp.py --gpus 2 --batch 1 4 --modes nocomm-compile fxshard fsdp2-compile \
             --out "$out/fsdp_b1_2gpu_$day.json" 2>&1 | tee "$out/fsdp_b1.log" | grep -v "codegen: region" | tail -30 ;;
  pipeline) timeout 580 python bench/pipeline.py --gpus 2 --schedules 1f1b interleaved-v2 \
              --out "$out/pipeline_2gpu_$day.json" 2>&1 | tee "$out/pipeline.log" | grep -v "codegen: region" | tail -30 ;;
  pipeline-cut) timeout 580 python bench/pipeline.py --gpus 2 --schedules 1f1b interleaved-v2 --replays graphed \
                  --peers pipelining-interleaved-compile --stage-layers 9,9 4,5,5,4 \
                  --out "$out/pipeline_cut_2gpu_$day.json" 2>&1 | tee "$out/pipeline_cut.log" | grep -v "codegen: region" | tail -30 ;;
  pipeline-zb) timeout 580 python bench/pipeline.py --gpus 2 --schedules zb-h1 --peers \
                 --out "$out/pipeline_zb_2gpu_$day.json" 2>&1 | tee "$out/pipeline_zb.log" | grep -v "codegen: region" | tail -20 ;;
  hf_moe) timeout 580 python bench/hf_moe.py --out "$out/hf_moe_2gpu_$day.json" 2>&1 | tee "$out/hf_moe.log" \
            | grep -v "codegen: region" | tail -30 ;;
  suite-ce) timeout 580 python -m pytest -q -p no:cacheprovider tests/test_gpu.py -m multigpu -k copy_engine 2>&1 \
              | tee "$out/suite_ce.log" | tail -15 ;;
  watch) timeout 150 python -m pytest -q -p no:cacheprovider tests/test_gpu.py \
           -k "stalled_peer_under_cuda_graphs or without_waiting_for_later_work" 2>&1 | tee "$out/watch.log" | tail -15
         timeout 150 python -m pytest -q -p no:cacheprovider tests/test_copy_engine.py -k rank_order 2>&1 \
           | tee -a "$out/watch.log" | tail -5 ;;
  suite) timeout 580 python -m pytest -q -p no:cacheprovider tests/test_gpu.py -m multigpu \
           -k "not copy_engine and not stalled_peer_under_cuda_graphs" 2>&1 \
           | tee "$out/suite.log" | tail -15 ;;
  *) echo "unknown part $part" >&2; exit 2 ;;
esac
