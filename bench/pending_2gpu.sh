#!/usr/bin/env bash
# The 2-GPU measurements the open issues wait for, one part per device call (each fits the 10-minute
# limit of a device command). On the device machine, from the repository root:
#
#     bash bench/pending_2gpu.sh moe|moe-ce|fsdp|suite-ce|pipeline|pipeline-zb|hf_moe|suite  [OUT dir, default $OUT]
#
# Each part writes its JSON and log under OUT and prints the table; record results in bench/RESULTS.md
# (date, machine, command). In priority order (session 24 ran all but hf_moe and suite; times on 2x H200):
#   fsdp      issue 15: GPT 1b ZeRO-3 at batch 4 and 1 against one GPU's compiled step and FSDP2 + compile,
#             next to one GPU's fxshard step (what ZeRO-3 adds); profiled (kernel time by class). Session 24
#             (RESULTS): ZeRO-3's GEMMs ran 9% slower beside NCCL's kernels; NCCL_PROTO=Simple
#             (fxshard-protoSimple) and the copy engines (fxshard-ce) are the two ways tried next (~5 min)
#   moe       issue 15: MoE ep=2, dual-batch, NCCL and copy-engine all-to-alls (>= 30% MFU, >= 90% hidden),
#             each mode profiled: what the copy-engine dual-batch mode leaves exposed (~3 min)
#   moe-ce    the same with ZeRO-1's collectives on the copy engines too (Config(fsdp_collectives)); it
#             stalled once in session 24 (RESULTS): a stall now ends after 60 s naming the collective
#   pipeline  issue 14: bench/pipeline.py 1F1B and interleaved V=2 with the peer; a graphed mode prints the
#             action-span diagnostic beside the bubble target (~6 min; pipeline-zb: ZB-H1)
#   suite-ce  the multigpu tests of the copy-engine collectives (bit-identical to NCCL, dual-batch MoE with
#             every collective on copy engines; a stalled peer)
#   suite     the other multigpu tests (~7 min)
#   hf_moe    issue 17: the Qwen3-MoE-like transformers model at ep=2 against FSDP2 eager
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
  fsdp) timeout 570 python bench/fsdp.py --gpus 2 --batch 4 1 --modes nocomm-compile nocomm-fxshard fxshard fxshard-protoSimple \
          fxshard-ce fsdp2-compile \
          --profile "$out/fsdp_profile" --out "$out/fsdp_2gpu_$day.json" 2>&1 | tee "$out/fsdp.log" \
          | grep -v "codegen: region" | tail -30
        # one file for the profiles (a mode and batch each): the device tool returns at most 8 files
        tar czf "$out/fsdp_profile.tgz" -C "$out" fsdp_profile && rm -r "$out/fsdp_profile" ;;
  pipeline) timeout 580 python bench/pipeline.py --gpus 2 --schedules 1f1b interleaved-v2 \
              --out "$out/pipeline_2gpu_$day.json" 2>&1 | tee "$out/pipeline.log" | grep -v "codegen: region" | tail -30 ;;
  pipeline-zb) timeout 580 python bench/pipeline.py --gpus 2 --schedules zb-h1 --peers \
                 --out "$out/pipeline_zb_2gpu_$day.json" 2>&1 | tee "$out/pipeline_zb.log" | grep -v "codegen: region" | tail -20 ;;
  hf_moe) timeout 580 python bench/hf_moe.py --out "$out/hf_moe_2gpu_$day.json" 2>&1 | tee "$out/hf_moe.log" \
            | grep -v "codegen: region" | tail -30 ;;
  suite-ce) timeout 580 python -m pytest -q -p no:cacheprovider tests/test_gpu.py -m multigpu -k copy_engine 2>&1 \
              | tee "$out/suite_ce.log" | tail -15 ;;
  suite) timeout 580 python -m pytest -q -p no:cacheprovider tests/test_gpu.py -m multigpu -k "not copy_engine" 2>&1 \
           | tee "$out/suite.log" | tail -15 ;;
  *) echo "unknown part $part" >&2; exit 2 ;;
esac
