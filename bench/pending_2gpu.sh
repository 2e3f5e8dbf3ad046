#!/usr/bin/env bash
# The 2-GPU measurements the open issues wait for, one part per device call (each fits the 10-minute
# limit of a device command). On the device machine, from the repository root:
#
#     bash bench/pending_2gpu.sh marks|energy|clocks|tests|rest|zb-halves|precision-again|issue-again|issue|memsets|cuts|fga|fga-suite|own-default|half-blocks|dualpipev-halves|own-part|moe-ce|precision|suite-ce|pipeline-zb|boundary|watch|priority|suite|gather|fsdp|fsdp-b1|moe|p2p-1f1b|p2p-v2|pipeline|pipeline-cut|hf_moe  [OUT dir, default $OUT]
#
# Each part writes its JSON and log under OUT and prints the table; record results in bench/RESULTS.md
# (date, machine, command). In priority order (session 33: MoE at ep=2 hides 92-94% of the exposed
# all-to-all time, issue 15's targets met; nothing ran for the pipelines, whose 2-GPU parts lead now;
# session 34 made the fused gradient accumulation the default, measured on one GPU only; session 38 ran
# 1F1B / V=2 / DualPipeV graphed and the half-block cuts next to the compiled peer: 1.15x and 1.21x in two
# jobs, not the fused-against-unfused rows, not the GPU tests below):
#   marks     the stalled-peer and graphed-pipeline GPU tests with Config(wait_marks) (the stall's report
#             names the collective), then interleaved V=2 graphed with and without the marks (~5 min)
#   energy    interleaved V=2 and ZB-H1 graphed between two runs of the compiled peer, each row with its
#             energy a step (~4 min; session 44: fxshard 161-163 J, the peer 196-210 J)
#   clocks    interleaved V=2 and ZB-H1 eager and graphed, the compiled peer, with each rank's SM clock and
#             power sampled during the timed steps and V=2's traces kept (~4 min; session 44: the graphed
#             step runs at the 700 W cap at 1,710-1,800 MHz, eager at 1,770-1,920: its GEMMs 4-9% longer)
#   issue-again  the issue's whole job with both peers run first and again last (~7 min; session 43:
#             graphed 1.41-1.49x the faster compiled-peer run, bubble +1.4 / +2.0 / +1.7 over the
#             measured-cost simulation, graphed vs eager 1.21x for 1F1B and 1.02-1.03x where eager's
#             host kept up). The job to run for issue 14's record.
#   precision-again  1F1B, V=2 and ZB-H1 graphed, fp32 and bf16 gradients (the peer's precision), the
#             compiled peer first and last (~7 min; session 43: bf16 gradients no faster any more)
#   tests     the pipeline's GPU tests (over NCCL against single-device eager, graphed against eager
#             bit for bit, the flat-gradient ops), then the single-GPU suite (~8 min; session 42 ran
#             them at fb8fbc6, direct calls included: 4 + 54 passed)
#   rest      the two multigpu tests session 42 could not finish with direct calls in eager replay:
#             expert parallelism over NCCL against single-device eager, ranks that lower their
#             collectives differently (session 43: both passed, 157 s)
#   zb-halves 1F1B and ZB-H1 graphed, the whole-block FLOP cut (10,8) and the half-block cut 19,17, one
#             job (~7 min with the default peers; session 43 ran it: the ranks even out, no step faster)
#   issue     the issue's whole job (session 42 ran it at fb8fbc6: V=2 graphed 122.5 ms, 1.42x the
#             compiled peer, 1.06x its eager replay on a fast host), traces kept for `drift` (~6 min)
#   memsets   the single-GPU suite with the memset rewrite (session 40 ran the non-finite skip test,
#             which had failed once in session 39, twice with both settings: passed), ~9 min
#   cuts      then interleaved V=2 and DualPipeV graphed with the memset rewrite, whole blocks and the
#             half-block cut 10,10,9,7, next to the compiled peer (~8 min; session 38 measured the half-block
#             cut with the memsets kept: no gain for V=2; the one-GPU probe had DualPipeV's ranks 106.8 / 96.8
#             ms busy there against the FLOP simulator's even split)
#   fga       issue 14: 1F1B and interleaved V=2 graphed, the fused accumulation (now in place and
#             the default; since session 35 the first microbatch's product is one fp32 GEMM too) against
#             -unfused, next to the compiled peer, then its GPU test (~7 min; one H200, fake process
#             group: each stage's GPU work 2.6-4.3% less a step, then 0.5-1.4% more off; session 39 ran
#             its GPU tests and the pipeline's graphed-vs-eager test on 2x H200: passed; the rows not yet)
#   fga-suite the multigpu tests whose bf16 microbatch programs now use it: pipelines graphed against
#             eager bit for bit, copy-engine collectives against NCCL (~8 min)
#   half-blocks  then: the cut inside a block for 1F1B (19,17: the FLOP simulator predicts
#             1.8% shorter than 10,8; not measured yet) and V=2 again (10,10,9,7: measured 1.5% faster
#             once, though the FLOP simulator predicts it slower)
#   dualpipev-halves  DualPipeV graphed (session 31's fastest schedule, 128.8 ms), whole-block cut and
#             10,10,9,7 in halves, which evens its ranks' FLOPs (its busy times were 107.0 / 118.8 ms)
#   precision then suite-ce, moe (profiled: what the remaining ~0.6-0.9 ms of exposed all-to-all is)
#   own-default  the multigpu tests of the own part read from the input, then MoE with the default,
#             profiled (~8 min; session 32 ran both, the test at 14fedcb too)
#   half-blocks  issue 14: 1F1B and interleaved V=2 graphed, the FLOP cut of whole blocks, then a cut inside
#             a block (bench/pipeline.py --half-blocks: Config(layers) of each block's attention and MLP),
#             no peers (~6 min; session 32 ran V=2 alone: 131.2 -> 129.3 ms, ranks' busy times evened out;
#             1F1B's 19,17 is not run yet)
#   own-part  bench/probes/cat_gather.py, the multigpu test against NCCL (aten replay), then MoE with
#             --own-part copy and input in one job (~8 min; session 32 ran it)
#   moe-ce    MoE with ZeRO-1's collectives on the copy engines too, profiled: session 31 measured no gain
#             without a profile, though its gathers hold no SM (~4 min)
#   precision issue 14: 1F1B and interleaved V=2 graphed, fp32 and bf16 gradients (-gbf16: the peer's
#             precision), next to the compiled peer (~7 min; session 32: interleaved 1.21x / 1.26x the
#             peer, whose time moves ~7% between jobs)
#   suite-ce  the copy-engine multigpu tests (~6 min)
#   pipeline-zb  ZB-H1 and DualPipeV, eager and graphed, next to the issue's peer (~6 min; session 31:
#             DualPipeV graphed 128.8 ms, the fastest schedule)
#   boundary  1F1B and V=2 eager with the per-layer excess the eager rows print (~4 min)
#   watch     the capture guard's test and the stalled-peer tests (~4 min)
#   priority  MoE and the pipeline with Config(nccl_high_priority) (~7 min)
#   gather, suite, fsdp, fsdp-b1, moe, p2p-1f1b, p2p-v2, pipeline, pipeline-cut, hf_moe: as before
set -euo pipefail
part=${1:?usage: bench/pending_2gpu.sh PART [OUT]}
out=${2:-${OUT:?set OUT or pass a directory}}
mkdir -p "$out"
day=$(date +%F)
case "$part" in
  marks) timeout 200 python -m pytest -q -p no:cacheprovider tests/test_gpu.py -rf \
           -k "stalled_peer_under_cuda_graphs or pipeline_cuda_graph_replay" 2>&1 \
           | tee "$out/marks_tests.log" | grep "FAILED\|passed\|failed\|Error" | tail -8 || true
         timeout 200 python bench/pipeline.py --gpus 2 --schedules interleaved-v2 --replays graphed --peers \
           --no-wait-marks --steps 8 --out "$out/pipeline_marks_2gpu_$day.json" 2>&1 | tee "$out/pipeline_marks.log" \
           | grep -v "codegen: region\|Warning\|warn\|func(" | grep -A6 "^all modes"
         grep "marked\|J a step" "$out/pipeline_marks.log" | sed 's/.*\(waits for NCCL marked[^;]*\).*/\1/' ;;
  energy) timeout 400 python bench/pipeline.py --gpus 2 --schedules interleaved-v2 zb-h1 --replays graphed \
            --peers pipelining-interleaved-compile --peers-again --steps 8 \
            --out "$out/pipeline_energy_2gpu_$day.json" 2>&1 | tee "$out/pipeline_energy.log" \
            | grep -v "codegen: region\|Warning\|warn\|func(" | grep -A12 "^all modes"
          grep "J a step\|SM clock" "$out/pipeline_energy.log" | sed 's/.*\(~[0-9]* J a step\).*/\1/' ;;
  clocks) timeout 420 python bench/pipeline.py --gpus 2 --schedules interleaved-v2 zb-h1 --replays eager graphed \
            --peers pipelining-interleaved-compile --steps 8 --trace-dir /tmp/pipeline_traces \
            --out "$out/pipeline_clocks_2gpu_$day.json" 2>&1 | tee "$out/pipeline_clocks.log" \
            | grep -v "codegen: region\|Warning\|warn\|func(" | grep -A40 "^all modes"
          grep "SM clock\|GEMMs" "$out/pipeline_clocks.log" | head -20
          (cd /tmp/pipeline_traces && tar czf "$out/pipeline_clocks_traces.tgz" interleaved-v2*) ;;
  tests) timeout 230 python -m pytest -q -p no:cacheprovider tests/test_gpu.py -rf \
           -k "pipeline_over_nccl or pipeline_cuda_graph_replay or nccl_max_ctas_for_the_pp or flat_gradient" 2>&1 \
           | tee "$out/pipeline_tests.log" | grep "FAILED\|passed\|failed" | tail -8 || true
         timeout 320 python -m pytest -q -p no:cacheprovider -m "gpu and not multigpu" tests/ -rf 2>&1 \
           | tee "$out/suite_1gpu.log" | grep "FAILED\|passed\|failed" | tail -8 ;;
  rest) timeout 300 python -m pytest -v -p no:cacheprovider tests/test_gpu.py -rf \
          -k "expert_parallel_over_nccl_matches or lower_their_collectives_differently" 2>&1 \
          | tee "$out/rest.log" | grep "PASSED\|FAILED\|passed\|failed" | tail -6 ;;
  zb-halves) for cut in blocks halves; do
               extra=""; [ "$cut" = halves ] && extra="--half-blocks --stage-layers 19,17"
               timeout 270 python bench/pipeline.py --gpus 2 --schedules 1f1b zb-h1 --replays graphed --steps 8 $extra \
                 --out "$out/pipeline_zb_${cut}_2gpu_$day.json" 2>&1 | tee "$out/pipeline_zb_$cut.log" \
                 | grep -v "codegen: region\|Warning\|warn\|func(" | grep -A4 "^all modes" || echo "cut $cut: status $?"
             done ;;
  precision-again) timeout 560 python bench/pipeline.py --gpus 2 --schedules 1f1b interleaved-v2 zb-h1 --replays graphed \
                     --peers pipelining-interleaved-compile --peers-again --bf16-grads --steps 8 \
                     --out "$out/pipeline_precision_again_2gpu_$day.json" 2>&1 | tee "$out/pipeline_precision_again.log" \
                     | grep -v "codegen: region\|Warning\|warn\|func(" | grep -A40 "^all modes" ;;
  issue-again) timeout 560 python bench/pipeline.py --gpus 2 --schedules 1f1b interleaved-v2 zb-h1 --replays eager graphed \
                 --peers pipelining-interleaved pipelining-interleaved-compile --peers-again --steps 8 \
                 --out "$out/pipeline_issue_again_2gpu_$day.json" 2>&1 | tee "$out/pipeline_issue_again.log" \
                 | grep -v "codegen: region\|Warning\|warn\|func(" | grep -A40 "^all modes" ;;
  issue) timeout 480 python bench/pipeline.py --gpus 2 --schedules 1f1b interleaved-v2 zb-h1 --replays eager graphed \
           --peers pipelining-interleaved pipelining-interleaved-compile --steps 8 --trace-dir /tmp/pipeline_traces \
           --out "$out/pipeline_issue_2gpu_$day.json" 2>&1 | tee "$out/pipeline_issue.log" \
           | grep -v "codegen: region\|Warning\|warn\|func(" | grep -A60 "^all modes"
         (cd /tmp/pipeline_traces && tar czf "$out/pipeline_issue_traces.tgz" interleaved-v2*) ;;
  memsets) for attempt in 1 2 3; do  # each run: both codegens x both Config(cuda_graph_memsets)
             timeout 150 python -m pytest -q -p no:cacheprovider tests/test_gpu.py -k "nonfinite_step_is_skipped_inside" \
               -rf 2>&1 | grep "FAILED\|passed\|failed" | sed "s/^/run $attempt: /"
           done
           timeout 330 python -m pytest -q -p no:cacheprovider -m "gpu and not multigpu" tests/ 2>&1 \
             | tee "$out/suite_1gpu.log" | tail -4 ;;
  cuts) # with the memset rewrite, the whole-block FLOP cut and the half-block one (10,10,9,7: the FLOP
        # simulator's best for both schedules, 2.0% bubble for DualPipeV), next to the compiled peer
        for cut in blocks halves; do
          extra=""; [ "$cut" = halves ] && extra="--half-blocks --stage-layers 10,10,9,7"
          timeout 270 python bench/pipeline.py --gpus 2 --schedules interleaved-v2 dualpipev --replays graphed \
            --peers pipelining-interleaved-compile --steps 8 $extra --out "$out/pipeline_cuts_${cut}_2gpu_$day.json" \
            2>&1 | tee "$out/pipeline_cuts_$cut.log" | grep -v "codegen: region\|Warning\|warn\|func(" \
            | grep -A5 "^all modes" || echo "cut $cut: status $?"
        done ;;
  moe) timeout 580 python bench/moe.py --dump-stacks-after 150 --gpus 2 --ep 2 --chunks 1 --all-to-all nccl copy-engine copy-engine-stream --microbatches 2 \
         --interleave dual-batch --warmup 3 --iters 8 --profile "$out/moe_profile" --keep-traces --out "$out/moe_2gpu_$day.json" \
         2>&1 | tee "$out/moe.log" | grep -v "codegen: region" | tail -40
       # per mode: kernel time by class, and the copy engines' time beside kernels (what ep-overlap1-ce
       # left exposed in session 24: 26%); one archive, the device tool returns at most 8 files
       tar czf "$out/moe_profile.tgz" -C "$out" moe_profile && rm -r "$out/moe_profile" ;;
  gather) timeout 60 python bench/probes/dtod_stall.py --out "$out/dtod_stall_$day.json" 2>&1 | tail -8 || true
          timeout 400 python -m pytest -q -p no:cacheprovider tests/test_gpu.py -m multigpu \
            -k "fsdp_over_nccl or mesh_is_bit_identical or nccl_max_ctas_reaches or (bit_identical_to_nccl and (optim or zero1))" \
            2>&1 | tee "$out/suite_gather.log" | tail -8 || true
          timeout 200 python bench/moe.py --dump-stacks-after 150 --gpus 2 --ep 2 --chunks 1 --all-to-all copy-engine-stream --microbatches 2 \
            --interleave dual-batch --warmup 3 --iters 8 --profile "$out/moe_profile" --keep-traces \
            --out "$out/moe_gather_2gpu_$day.json" 2>&1 | tee "$out/moe_gather.log" | grep -v "codegen: region" | tail -14
          tar czf "$out/moe_gather_profile.tgz" -C "$out" moe_profile && rm -r "$out/moe_profile" ;;
  priority) timeout 200 python bench/moe.py --dump-stacks-after 150 --gpus 2 --ep 2 --chunks 1 --all-to-all copy-engine-stream nccl --microbatches 2 \
              --interleave dual-batch --warmup 3 --iters 8 --nccl-high-priority --out "$out/moe_priority_2gpu_$day.json" \
              2>&1 | tee "$out/moe_priority.log" | grep -v "codegen: region" | tail -14 || echo "moe: status $?"
            for hp in "" --nccl-high-priority; do
              timeout 170 python bench/pipeline.py --gpus 2 --schedules 1f1b interleaved-v2 --replays graphed --peers \
                --steps 8 $hp --out "$out/pipeline_priority${hp:+_hp}_2gpu_$day.json" 2>&1 \
                | tee "$out/pipeline_priority${hp:+_hp}.log" | grep -v "codegen: region\|Warning\|warn\|func(" | tail -8 \
                || echo "pipeline $hp: status $?"
            done ;;
  boundary) timeout 300 python bench/pipeline.py --gpus 2 --schedules 1f1b interleaved-v2 --replays eager --peers \
              --steps 8 --out "$out/pipeline_boundary_2gpu_$day.json" 2>&1 | tee "$out/pipeline_boundary.log" \
              | grep -v "codegen: region\|Warning\|warn\|func(" | grep "ms a step over\|ms/step\|eager " | tail -20 ;;
  own-part) timeout 60 python bench/probes/cat_gather.py --out "$out/cat_gather_$day.json" 2>&1 | tail -5 || true
            timeout 150 python -m pytest -q -p no:cacheprovider tests/test_gpu.py -k "bit_identical_to_nccl and own_part" \
              2>&1 | tee "$out/own_part_test.log" | tail -4 || true
            for own in copy input; do
              timeout 190 python bench/moe.py --dump-stacks-after 120 --gpus 2 --ep 2 --chunks 1 --all-to-all copy-engine-stream \
                --microbatches 2 --interleave dual-batch --warmup 3 --iters 8 --own-part $own \
                --out "$out/moe_own_part_${own}_2gpu_$day.json" 2>&1 | tee "$out/moe_own_part_$own.log" \
                | grep -v "codegen: region" | tail -12 || echo "own part $own: status $?"
            done ;;
  half-blocks) # the FLOP cut of whole blocks, then a cut inside a block (half a block moved from rank 0 to
               # rank 1, whose busy time was 13.5 ms a step shorter in session 32's V=2 job), graphed, one job
               for cut in blocks halves; do
                 extra=""; [ "$cut" = halves ] && extra="--half-blocks --stage-layers 19,17 10,10,9,7"
                 timeout 280 python bench/pipeline.py --gpus 2 --schedules 1f1b interleaved-v2 --replays graphed --peers \
                   --steps 8 $extra --out "$out/pipeline_${cut}_2gpu_$day.json" 2>&1 | tee "$out/pipeline_$cut.log" \
                   | grep -v "codegen: region\|Warning\|warn\|func(" | tail -12 || echo "cut $cut: status $?"
               done ;;
  dualpipev-halves) # DualPipeV holds chunks 0 and 3 on rank 0: its FLOP cut 5,5,5,3 left rank 1 11.8 ms a step
               # busier (session 31); the half-block cut 10,10,9,7 evens the ranks' FLOPs here too
               for cut in blocks halves; do
                 extra=""; [ "$cut" = halves ] && extra="--half-blocks --stage-layers 10,10,9,7"
                 timeout 280 python bench/pipeline.py --gpus 2 --schedules dualpipev --replays graphed --peers \
                   --steps 8 $extra --out "$out/pipeline_dualpipev_${cut}_2gpu_$day.json" 2>&1 \
                   | tee "$out/pipeline_dualpipev_$cut.log" | grep -v "codegen: region\|Warning\|warn\|func(" | tail -8 \
                   || echo "cut $cut: status $?"
               done ;;
  own-default) timeout 200 python -m pytest -q -p no:cacheprovider tests/test_gpu.py \
                -k "own_part_from_the_input_under_codegen or (bit_identical_to_nccl and own_part)" 2>&1 \
                | tee "$out/own_default_test.log" | tail -4 || true
              timeout 330 python bench/moe.py --dump-stacks-after 150 --gpus 2 --ep 2 --chunks 1 --all-to-all copy-engine-stream \
                --microbatches 2 --interleave dual-batch --warmup 3 --iters 8 --profile "$out/moe_profile" --keep-traces \
                --out "$out/moe_own_default_2gpu_$day.json" 2>&1 | tee "$out/moe_own_default.log" \
                | grep -v "codegen: region" | tail -40 || echo "moe: status $?"
              tar czf "$out/moe_own_default_profile.tgz" -C "$out" moe_profile && rm -r "$out/moe_profile" ;;
  moe-ce) timeout 580 python bench/moe.py --dump-stacks-after 150 --collective-timeout 60 --gpus 2 --ep 2 --chunks 1 --all-to-all copy-engine-stream --microbatches 2 \
         --interleave dual-batch --fsdp-collectives copy-engine --warmup 3 --iters 8 --profile "$out/moe_profile" --keep-traces \
         --out "$out/moe_ce_2gpu_$day.json" 2>&1 | tee "$out/moe_ce.log" | grep -v "codegen: region" | tail -40
       # session 31 ran it without profiles: with ZeRO-1 off the SMs the step was no faster, so where did
       # the end-of-step time go? one archive (the device tool returns at most 8 files)
       tar czf "$out/moe_ce_profile.tgz" -C "$out" moe_profile && rm -r "$out/moe_profile" ;;
  fsdp) timeout 570 python bench/fsdp.py --gpus 2 --batch 4 --rounds 2 --modes nocomm-compile nocomm-fxshard fxshard \
          fxshard-ce fxshard-ce-stream --profile "$out/fsdp_profile" --out "$out/fsdp_2gpu_$day.json" 2>&1 | tee "$out/fsdp.log" \
          | grep -v "codegen: region" | tail -30
        # one file for the profiles (a mode and batch each): the device tool returns at most 8 files
        tar czf "$out/fsdp_profile.tgz" -C "$out" fsdp_profile && rm -r "$out/fsdp_profile" ;;
  fsdp-b1) timeout 570 python bench/fsdp.py --gpus 2 --batch 1 4 --modes nocomm-compile fxshard fsdp2-compile \
             --out "$out/fsdp_b1_2gpu_$day.json" 2>&1 | tee "$out/fsdp_b1.log" | grep -v "codegen: region" | tail -30 ;;
  fga) timeout 480 python bench/pipeline.py --gpus 2 --schedules 1f1b interleaved-v2 --replays graphed \
         --unfused-grad-accumulation --peers pipelining-interleaved-compile --steps 8 \
         --out "$out/pipeline_fga_2gpu_$day.json" 2>&1 \
         | tee "$out/pipeline_fga.log" | grep -v "codegen: region\|Warning\|warn\|func(" | tail -30
       timeout 100 python -m pytest -q -p no:cacheprovider tests/test_gpu.py -k "fused_grad_accumulation or embedding_rows" \
         2>&1 | tee -a "$out/pipeline_fga.log" | tail -5 ;;
  fga-suite) # the multigpu tests whose bf16 microbatch programs now accumulate in place (session 34's default)
             timeout 570 python -m pytest -q -p no:cacheprovider tests/test_gpu.py \
               -k "pipeline_cuda_graph_replay_is_bit_identical or copy_engine_collectives_are_bit_identical_to_nccl" \
               2>&1 | tee "$out/fga_suite.log" | tail -8 ;;
  p2p-1f1b) timeout 580 python bench/pipeline.py --gpus 2 --schedules 1f1b --replays eager graphed --peers \
              --p2p-ctas 2 --p2p-receives late early --steps 8 --out "$out/pipeline_p2p_1f1b_2gpu_$day.json" 2>&1 \
              | tee "$out/pipeline_p2p_1f1b.log" | grep -v "codegen: region\|Warning\|warn\|func(" | tail -45 ;;
  p2p-v2) timeout 580 python bench/pipeline.py --gpus 2 --schedules interleaved-v2 --replays graphed \
            --peers pipelining-interleaved --p2p-ctas 2 --p2p-receives late early --steps 8 \
            --out "$out/pipeline_p2p_v2_2gpu_$day.json" 2>&1 | tee "$out/pipeline_p2p_v2.log" \
            | grep -v "codegen: region\|Warning\|warn\|func(" | tail -40 ;;
  pipeline) timeout 580 python bench/pipeline.py --gpus 2 --schedules 1f1b interleaved-v2 \
              --out "$out/pipeline_2gpu_$day.json" 2>&1 | tee "$out/pipeline.log" | grep -v "codegen: region" | tail -30 ;;
  pipeline-cut) # the FLOP cut and one block over, back to back in one call (no peers: the two cuts are the subject)
                # (the FLOP cut's eager modes print the cut their measured layer times would make)
                for cut in flops 9,9; do
                  if [ "$cut" = flops ]; then extra="--replays eager graphed"; limit=330
                  else extra="--replays graphed --stage-layers 9,9 4,5,5,4"; limit=235; fi
                  timeout $limit python bench/pipeline.py --gpus 2 --schedules 1f1b interleaved-v2 \
                    --peers $extra --steps 8 --out "$out/pipeline_cut_${cut/,/_}_2gpu_$day.json" 2>&1 \
                    | tee "$out/pipeline_cut_${cut/,/_}.log" | grep -v "codegen: region\|Warning\|warn\|func(" | tail -12 \
                    || echo "cut $cut: ended with status $?"  # the other cut still runs
                done ;;
  precision) timeout 580 python bench/pipeline.py --gpus 2 --schedules 1f1b interleaved-v2 --replays graphed \
               --peers pipelining-interleaved-compile --bf16-grads --steps 8 \
               --out "$out/pipeline_precision_2gpu_$day.json" 2>&1 | tee "$out/pipeline_precision.log" \
               | grep -v "codegen: region\|Warning\|warn\|func(" | tail -30 ;;
  pipeline-zb) timeout 580 python bench/pipeline.py --gpus 2 --schedules zb-h1 dualpipev --peers pipelining-interleaved \
                 --steps 8 --out "$out/pipeline_zb_2gpu_$day.json" 2>&1 | tee "$out/pipeline_zb.log" | grep -v "codegen: region" | tail -20 ;;
  hf_moe) timeout 580 python bench/hf_moe.py --out "$out/hf_moe_2gpu_$day.json" 2>&1 | tee "$out/hf_moe.log" \
            | grep -v "codegen: region" | tail -30 ;;
  suite-ce) timeout 570 python -m pytest -q -p no:cacheprovider tests/test_gpu.py -k copy_engine 2>&1 \
              | tee "$out/suite_ce.log" | tail -15 ;;
  watch) timeout 450 python -m pytest -q -p no:cacheprovider tests/test_gpu.py \
           -k "another_steps_replays or stalled_peer or without_waiting_for_later_work or for_the_pp_axis" 2>&1 \
           | tee "$out/watch.log" | tail -15 ;;
  suite) # the tests the new default "auto" changes first, then the rest (two calls' worth at most: each part
         # stops at its own limit, so the first one's results come back whatever the second does)
         timeout 330 python -m pytest -q -p no:cacheprovider tests/test_gpu.py -m multigpu \
           -k "fsdp_over_nccl or mesh_is_bit_identical or lower_their_collectives" 2>&1 \
           | tee "$out/suite_auto.log" | tail -8 || true
         timeout 250 python -m pytest -q -p no:cacheprovider tests/test_gpu.py -m multigpu \
           -k "not copy_engine and not stalled_peer_under_cuda_graphs and not fsdp_over_nccl \
               and not mesh_is_bit_identical and not lower_their_collectives" 2>&1 \
           | tee "$out/suite.log" | tail -8 ;;
  *) echo "unknown part $part" >&2; exit 2 ;;
esac
