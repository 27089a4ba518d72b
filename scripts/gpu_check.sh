#!/usr/bin/env bash
# The device check, in phases that each fit one device call (10 minutes). The latest full check (session 18) was
# three calls: `fp8-floor` (the FP8 and bf16 step of FLUX.1-dev, klein-4B and FLUX.2-dev, 184 s), then `fp8-tests`
# and `gpu-rest` (the whole GPU suite between them, each with room for RUNS's tiny trainings beside it).
#   bash scripts/gpu_check.sh kernels   GPU tests, kernel_check.py, FLUX.1 per-step bench (+ profile)
#   bash scripts/gpu_check.sh controlnet  the ControlNets' GPU tests, one FLUX.1-dev + ControlNet step vs diffusers
#   bash scripts/gpu_check.sh next-22   the GPU tests written on 2026-12-04 (adapters, GGUF kernel), the ControlNet step bench
#   bash scripts/gpu_check.sh next-23a  every GPU test written since 2026-12-04 and never run, ControlNet + Redux benches
#   bash scripts/gpu_check.sh next-23b  issue 33's cold start (FLUX.1-dev), then bench_cache.py eager and under graphs
#   bash scripts/gpu_check.sh next-24a  issue 33's read rates (buffers shared by back-to-back tensors or not), its cold start
#                                       after the start-up threads (bf16, --fp8, FP8 high +- cache, eager and
#                                       --cuda-graphs), the first call's profile, issue 37's eager FP8 high diagnosis
#   bash scripts/gpu_check.sh next-24b  issue 36's FP8-attention step at 1024² and 2048², issue 39's GGUF steps and memory against
#                                       diffusers' (carry the top-level wheels and .whl/fp8attn)
#   bash scripts/gpu_check.sh next-25a  what 2026-12-05 left: issue 36's image (eval_high_image.py) and FLUX.2-dev FP8-attention step,
#                                       issue 33's read A/B (carry the top-level wheels and .whl/fp8attn)
#   bash scripts/gpu_check.sh next-25b  issue 36's FP8 step with static input scales; issue 33's cold start after session 25's
#                                       start-up work, each piece switched off (verification record, text warm-up),
#                                       its GPU tests (carry the top-level wheels and .whl/fp8attn)
#   bash scripts/gpu_check.sh next-25c  issue 36's bf16 high on FLUX.3 Klein (new FP8 attention) and klein-4B; issue 33 from
#                                       disk (page cache dropped before each read row), klein-4B's cold flux-gen
#   bash scripts/gpu_check.sh next-26a  issue 33 on the H200 as a user's Python runs it (bytecode cached: the device's Python
#                                       writes none, and recompiling torch costs 1.5 s a process): FLUX.1-dev's and klein-4B's
#                                       cold flux-gen against their diffusers scripts, then the read bench (its GIL arms)
#   bash scripts/gpu_check.sh next-26b  issue 36 on the H200: the image (eval_high_image.py, static arms calibrated eagerly
#                                       now), FLUX.2-dev's FP8-attention step, FLUX.3 Klein's and klein-4B's bf16 high
#                                       (carry the top-level wheels and .whl/fp8attn for both)
#   bash scripts/gpu_check.sh cache-graphs  issue 37: step-cached calls under split CUDA graphs, GPU tests + bench_cache.py
#   bash scripts/gpu_check.sh gguf      the GGUF GPU tests (tests/gguf, the dequantization kernel's), then bench_gguf.py: reference
#                                       dequantization vs the Triton kernel vs the GEMMs at FLUX.1-dev's shapes, and a
#                                       FLUX.1-dev step with Q4_K / Q8_0 projections vs the bf16 step
#   bash scripts/gpu_check.sh gguf-diffusers  issue 39's remaining measurement, bench_gguf.py's step part alone: one
#                                       FLUX.1-dev step (1024²) with Q8_0 / Q5_K / Q4_K projections against our bf16 step and
#                                       diffusers' GGUF step (from_single_file of a GGUF file of the same blocks written under
#                                       /tmp), each model's weights and peak memory; about 4-5 min (carry .whl's top-level wheels)
#   bash scripts/gpu_check.sh fp8-attention  issue 36: fa3-fwd installed from .whl/fp8attn, the FP8 attention GPU tests,
#                                       scripts/bench_fp8_attention.py --ops (one attention call at FLUX shapes). Carry
#                                       .whl's top-level wheels and .whl/fp8attn, not all of .whl (.whl/flashinfer is 62 MiB)
#   bash scripts/gpu_check.sh fp8-attention-step  the same install, the FLUX.1-dev step in high with and without FP8
#                                       attention (bench_fp8_attention.py --steps)
#   bash scripts/gpu_check.sh e2e       FLUX.1 50-step pipeline bench, FLUX.2 per-step bench, FLUX.2-dev end to end
#   bash scripts/gpu_check.sh fp8       FP8 kernel + dispatch GPU tests, FP8 per-step bench (FLUX.1-dev, klein-4B, FLUX.2-dev)
#   bash scripts/gpu_check.sh fp8-flux3 FLUX.3 FP8 GPU tests, FLUX.3 Klein FP8 per-step bench (t2i, one reference)
#   bash scripts/gpu_check.sh merged    all GPU tests, an FP8 tiny image, the tiny models' scores, a profiled FP8 step
#   bash scripts/gpu_check.sh final     all GPU tests and the FP8 bench
#   bash scripts/gpu_check.sh high      all GPU tests, the decode bench
#   bash scripts/gpu_check.sh mid       new GPU tests (LoRA, high decode), the decode, variant, LoRA and FLUX.1 step benches
#   bash scripts/gpu_check.sh all3      all GPU tests, FLUX.3 flow-map step bench
#   bash scripts/gpu_check.sh verify    all GPU tests, then FLUX.3 flow-map step and whole-image (distilled) bench
#   bash scripts/gpu_check.sh flux3     FLUX.3 GPU tests, step benches (base, flow map; with and without a reference),
#                                       the base model's whole-image denoising (50 steps, CFG) vs diffusers
#   bash scripts/gpu_check.sh memory [flux1|flux2]  memory GPU tests, the build traced on meta, the memory-plan bench (ours, then diffusers' offloading on FLUX.1)
#   bash scripts/gpu_check.sh vae       all GPU tests, the autoencoders' decode bench (candidates for `high`)
#   bash scripts/gpu_check.sh serve     flux-serve's GPU tests, its load bench on the tiny model (carry .whl: .whl/serve too)
#   bash scripts/gpu_check.sh serve-flux1  flux-serve's load bench on full-size random FLUX.1-dev (1024², 28 steps)
#   bash scripts/gpu_check.sh serve-ray  issue 40: FLUX.1-dev (the random-weight folder /tmp/cold/flux1-dev, built if
#                                       missing), 1024², 28 steps, one flux-serve process against one Ray Serve replica
#                                       (bench_serve.py --compare-replicas): images/min, p50/p99 and Ray's overhead. Carry
#                                       .whl's top-level wheels, .whl/serve and .whl/ray (scripts/fetch_ray_wheels.sh), after
#                                       ray-stage (or with .whl/raytar, where the carry allows)
#   bash scripts/gpu_check.sh ray-stage  serve-ray's first call on a machine: carry .whl/raytar only (the Ray tree); it stays in
#                                       /tmp/ray-stage for serve-ray, then carrying the top-level wheels, .whl/serve and .whl/ray
#   bash scripts/gpu_check.sh train-tiny [SECONDS [BATCH [FG [TEXT [SEED]]]]]  both tiny models' DiTs trained on from the shipped weights
#                                       (the shipped text encoders frozen, or trained too with TEXT=train; SECONDS each [360],
#                                       side by side; with TEXT=train each model's DiT, loss log and text encoders come
#                                       back as one $OUT/<name>.tar), then their held-out scores and
#                                       grid (the shipped weights' are in docs/tiny-models.md); the new DiTs come back as $OUT/<name>.safetensors
#                                       (copy them over the shipped DiT files if they score better); FG > 0 weights
#                                       the shapes' tokens 1 + FG in the loss (train_tiny.py --fg-weight); SEED [0] picks the run's
#                                       pool of scenes and its noise (train_tiny.py --seed), so successive runs see new scenes
#                                       TRAIN_ARGS="..." in the environment adds train_tiny.py options (e.g. --caption-drop 0.3)
#   bash scripts/gpu_check.sh tiny-fresh [SECONDS]  both tiny models trained from scratch with the autoencoders'
#                                       batches half in random colours (train_tiny.py --vae-rgb 0.5), the text encoders
#                                       trained, shapes' tokens weighted 5x; SECONDS of DiT each [290]. Each model's whole
#                                       folder comes back as $OUT/<name>.tar; the logs print each autoencoder's round trip.
#                                       FLUX.1's new latent shift/scale (its stats.json) must go into TINY_TRAINED_VAE
#                                       before `tiny` can be scored, so only tiny-flux2 is scored here
#   bash scripts/gpu_check.sh tiny-decoder [SECONDS]  each shipped autoencoder's decoder fine-tuned alone for SECONDS [280]
#                                       with half of each batch in random colours (train_tiny.py --decoder-only --vae-rgb 0.5),
#                                       the encoder, DiT and text encoders kept; the new decoders' files come back as
#                                       $OUT/<name>.tar and both models are scored with them (eval_tiny.py --seen --autoencoder)
#   bash scripts/gpu_check.sh tiny-anchor [SECONDS [W ...]]  each shipped autoencoder fine-tuned whole for SECONDS [230]
#                                       once per anchor weight W [1 10], side by side (train_tiny.py --encoder-anchor W
#                                       --vae-rgb 0.5: the encoder learns random colour pairs too, held near its old
#                                       latents on palette scenes); each is scored with the shipped DiT
#                                       (eval_tiny.py --seen --autoencoder, $OUT/eval_<name>_w<W>.json); each run's
#                                       autoencoder and loss log come back as $OUT/<name>_w<W>.tar (tiny-ae-ab's preset)
#   bash scripts/gpu_check.sh tiny-ae-ab [SECONDS]  anchored autoencoder fine-tunes (--encoder-anchor 1 --vae-rgb 0.5)
#     side by side, RUNS="NAME LABEL [OPTIONS];...", each scored with the shipped DiT; the shipped files stay;
#     each run's autoencoder and loss log come back as $OUT/<NAME>_<LABEL>.tar
#   bash scripts/gpu_check.sh tiny-ae-dit [AE_SECONDS [DIT_SECONDS [SEED]]]  tiny-ae-ab's fine-tunes [150 s], then each run's
#     DiT + text encoders trained on from its new autoencoder [200 s, seed 16]; whole folders as $OUT/<NAME>_<LABEL>.tar
#   bash scripts/gpu_check.sh tiny-ab [SECONDS [SEED]]  an A/B of train_tiny.py options: RUNS="NAME LABEL [OPTIONS];..."
#                                       in the environment, e.g. RUNS="tiny ctrl;tiny splice --splice 0.5". Each run
#                                       trains NAME's DiT + text encoders from the shipped weights for SECONDS [300],
#                                       all side by side, with SEED [15] and the shapes' tokens weighted 5x; each
#                                       run's DiT, loss log and text encoders come back as $OUT/<NAME>_<LABEL>.tar and
#                                       its scores as $OUT/eval_<NAME>_<LABEL>.json (eval_tiny.py --seen --text-swap),
#                                       the shipped files restored after each (DEVICE and POOL: a CPU dry run); a run's
#                                       own `--seed N` in its OPTIONS overrides SEED (seeds side by side); GUIDANCES="G ..." in the
#                                       environment scores each run again at those guidances ($OUT/eval_<NAME>_<LABEL>_g<G>.json)
#                                       and SEEDS=N with N pictures per held-out prompt ($OUT/eval_<NAME>_<LABEL>_s<N>.json)
#   bash scripts/gpu_check.sh tiny-drop [SECONDS [F [SEED]]]  tiny-ab with RUNS="tiny ctrl;tiny drop --caption-drop F;
#                                       tiny-flux2 drop --caption-drop F" (F [0.3])
#   bash scripts/gpu_check.sh splice-gelu [SECONDS [SEED]]  tiny's train_tiny.py --splice 0.5 and 0.8 runs (as tiny-ab),
#                                       beside them attention_act_fp8's GPU tests, tiny-flux2's variants and the tiny
#                                       models' GPU tests; then the runs' scores and kernel_check's attention_act timing
#   bash scripts/gpu_check.sh tiny-verify  the shipped tiny models' scores and grid (eval_tiny.py --seen --sweeps 4), the
#                                       image-quality check of the paths that are not bit-exact (--variants) and the GPU tests
#                                       of the pipelines that run the tiny models; no training
#   bash scripts/gpu_check.sh tiny-final [SECONDS]  train-tiny with FG 4, then the new DiTs' image-quality check of the
#                                       paths that are not bit-exact (eval_tiny.py --variants: high, FP8, both against
#                                       bf16 lossless) and the GPU tests of the pipelines that run the tiny models
#   bash scripts/gpu_check.sh fp8-single   the single block's one-pass [attention | activation] FP8 producer: its GPU
#                                       tests and the FP8 ones, kernel_check against the three kernels it replaces,
#                                       the FP8 bench (FLUX.1-dev, FLUX.2-dev, klein-4B)
#   bash scripts/gpu_check.sh memory-rerun  FLUX.1-dev FP8 (ours) and FLUX.2-dev FP8 memory plans, each budget's
#                                       second call timed (after the graph-pool planning fix)
#   bash scripts/gpu_check.sh fp8-profile  attention_act_fp8's GPU tests and kernel_check (against the three kernels it
#                                       replaces), then FLUX.2-dev's FP8 step profiled (the kernel table), with SDPA
#                                       timed on the step's strided q, k, v and two contiguous layouts
#   bash scripts/gpu_check.sh fp8-floor  the FP8 bench (FLUX.1-dev, klein-4B, FLUX.2-dev) with each floor also timed in the
#                                       step's order as one CUDA graph, and each FP8 step's kernel table ($OUT/bench_fp8.txt)
#   bash scripts/gpu_check.sh fp8-gelu  the FP8 bench of FLUX.1-dev and klein-4B (MODELS) with a same-run A/B of the double
#                                       blocks' per-row GELU / SwiGLU producer tile (whole rows, 1024- or 2048-wide blocks),
#                                       kernel_check of those producers at their sites, the FP8 producers' GPU tests
#   bash scripts/gpu_check.sh fp8-layout [SECONDS [SEED]]  the FP8 bench (MODELS [flux1-dev,klein-4b]) with a same-run A/B
#                                       of the attention inputs' layout, the per-row producers' tile and the e4m3
#                                       conversion (hardware or integer); then RUNS's tiny-ab trainings (as tiny-ab, SECONDS [200]) beside the
#                                       layout's and the FP8 producers' GPU tests, and the runs' scores
#   bash scripts/gpu_check.sh fp8-tests [SECONDS [SEED]]  the GPU tests of the FP8 producers (the e4m3 conversion's
#                                       exhaustive test too), the attention inputs' layout and tests/fp8, in one 560 s run;
#                                       with RUNS, its tiny-ab trainings (SECONDS [270]) beside them, then their scores
#   bash scripts/gpu_check.sh gpu-rest [SECONDS [SEED]]  every other GPU test (all but fp8-tests'), with RUNS's tiny-ab
#                                       trainings (SECONDS [240]) beside them, then their scores
#   bash scripts/gpu_check.sh memory-28  the FLUX.1-dev FP8 and FLUX.2-dev FP8 memory plans at the issue's 28 steps
#                                       (seconds per image, and ms/step with one new prompt's graph capture amortised)
#   BEFORE=DIR bash scripts/gpu_check.sh refactor  the text encoders' and kernels' GPU tests, the FLUX.1-dev step bench of
#                                       the tree in DIR (an export of an older commit) and of this one, FLUX.1-dev's cold start
#   bash scripts/gpu_check.sh flux1-reach  FLUX.1-dev's memory plans in bf16 and FP8 (ours only), then the
#                                       flux-serve FLUX.1-dev bench with 8 requests per mode
# Carry .whl (the diffusers wheel: pip download diffusers==0.42.1 importlib_metadata --no-deps -d .whl).
set -uo pipefail
phase=${1:-kernels}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
# a call that carries none of .whl's top-level wheels (ray-stage) installs none
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
fi
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
# fa3-fwd (FlashAttention-3's FP8 forward) and einops from .whl/fp8attn, for the phases of issue 36
install_fp8_attention() {
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/fp8attn/*.whl
}
# klein-4B's random-weight folder (built again), then its cold flux-gen against its diffusers script, within $1 s
klein_cold() {
  timeout "$1" bash -c "python3 scripts/bench_cold_start.py build /tmp/cold --models klein-4b --out $OUT/cold_start.jsonl | grep '^{' && \
    python3 scripts/bench_cold_start.py cold /tmp/cold --models klein-4b --prompts 0 --out $OUT/cold_start.jsonl | tail -2"
  local rc=$?
  tail -1 "$OUT/cold_start.jsonl"
  return $rc
}
# the random-weight folder /tmp/cold/NAME (bench_cold_start.py build), unless an earlier call left it
cold_folder() {
  [ -d "/tmp/cold/$1" ] || timeout "$2" python3 scripts/bench_cold_start.py build /tmp/cold --models "$1" --out "$OUT/cold_start.jsonl" 2>&1 | grep '^{'
}
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv,noheader
python3 -c "import torch, triton, diffusers; print('torch', torch.__version__, 'triton', triton.__version__, 'diffusers', diffusers.__version__)"
swap_score() {
  # swap_score NAME DIR JSON [EVAL OPTIONS]: score DIR's weights (its *.safetensors and text encoders) in place of
  # NAME's shipped ones (eval_tiny.py --seen plus the options, the scores into $OUT/JSON), then put the shipped back
  local name=$1 dir=$2 json=$3 rc; shift 3
  rm -rf "/tmp/shipped_$name"; cp -r "flux_runtime/assets/models/$name" "/tmp/shipped_$name"
  cp "$dir"/*.safetensors "flux_runtime/assets/models/$name/"
  if compgen -G "$dir/text_encoder*" > /dev/null; then cp -r "$dir"/text_encoder* "flux_runtime/assets/models/$name/"; fi
  timeout 120 python3 scripts/eval_tiny.py --model "$name" --seen --json "$OUT/$json" "$@" 2>&1 | grep "^$name"
  rc=$?
  rm -rf "flux_runtime/assets/models/$name"; cp -r "/tmp/shipped_$name" "flux_runtime/assets/models/$name"
  return $rc
}
score_run() {
  # score_run NAME LABEL DEVICE: tar a tiny-ab run's DiT, loss log and text encoders into $OUT/NAME_LABEL.tar and
  # score them in place of the shipped ones (eval_tiny.py --seen --text-swap)
  local name=$1 label=$2 dev=$3 dir="/tmp/train/$1_$2" dit
  dit=$([ "$name" = tiny ] && echo flux1-tiny || echo flux2-tiny).safetensors
  grep "budget reached\|Error" "/tmp/train_${name}_$label.log"
  if [ ! -f "$dir/loss.json" ]; then echo "$name $label: training wrote no weights"; tail -3 "/tmp/train_${name}_$label.log"; return 1; fi
  tar -C "$dir" -cf "$OUT/${name}_$label.tar" "$dit" loss.json $(cd "$dir" && ls -d text_encoder*)
  swap_score "$name" "$dir" "eval_${name}_$label.json" --device "$dev" --text-swap
}
ae_tune() {
  # ae_tune NAME RESUME OUT SECONDS [OPTIONS]: an anchored autoencoder fine-tune of NAME's weights in RESUME (the
  # encoder held near its old latents, random colour pairs in half of each batch), written to OUT
  local name=$1 resume=$2 out=$3 secs=$4 fam; shift 4; fam=$([ "$name" = tiny ] && echo flux1 || echo flux2)
  timeout $((secs + 150)) python3 scripts/train_tiny.py --family $fam --resume "$resume" --encoder-anchor 1 --vae-rgb 0.5 \
    --vae-lr 3e-4 --vae-steps 100000 --vae-seconds "$secs" --out "$out" "$@"
}
dit_train() {
  # dit_train NAME RESUME OUT SECONDS SEED [OPTIONS]: NAME's DiT and text encoders trained on from RESUME's weights
  # (batch 128, the shapes' tokens weighted 4x), written to OUT
  local name=$1 resume=$2 out=$3 secs=$4 seed=$5 fam; shift 5; fam=$([ "$name" = tiny ] && echo flux1 || echo flux2)
  timeout $((secs + 150)) python3 scripts/train_tiny.py --family $fam --out "$out" --resume "$resume" --vae-steps 0 \
    --dit-steps 100000 --dit-seconds "$secs" --dit-batch 128 --fg-weight 4 --seed "$seed" "$@"
}
ab_start() {
  # ab_start SECONDS SEED DEVICE: RUNS's trainings (tiny-ab) started side by side in the background
  local run name label opts
  IFS=';' read -ra runs <<< "$RUNS"
  for run in "${runs[@]}"; do
    read -r name label opts <<< "$run"
    dit_train "$name" "flux_runtime/assets/models/$name" "/tmp/train/${name}_$label" "$1" "$2" --device "$3" \
      --pool "${POOL:-60000}" $opts > "/tmp/train_${name}_$label.log" 2>&1 &
  done
}
ab_score() {
  # ab_score DEVICE: each of RUNS's finished runs scored (tiny-ab), and again at each of GUIDANCES
  local run name label opts g rc=0
  IFS=';' read -ra runs <<< "$RUNS"
  for run in "${runs[@]}"; do
    read -r name label opts <<< "$run"; echo "== $name $label ($opts)"; score_run "$name" "$label" "$1" || rc=1
    for g in ${GUIDANCES:-}; do  # the same weights at other guidances (FLUX.1) or CFG scales
      echo "== $name $label at guidance $g"
      swap_score "$name" "/tmp/train/${name}_$label" "eval_${name}_${label}_g$g.json" --device "$1" --guidance "$g" || rc=1
    done
    if [ -n "${SEEDS:-}" ]; then  # SEEDS pictures per held-out prompt (eval_tiny.py --seeds): the score over noise draws
      echo "== $name $label, $SEEDS pictures per prompt"
      swap_score "$name" "/tmp/train/${name}_$label" "eval_${name}_${label}_s$SEEDS.json" --device "$1" --seeds "$SEEDS" || rc=1
    fi
  done
  return $rc
}
# the GPU tests of the FP8 producers, the e4m3 conversion and the attention inputs' layout (fp8-tests; gpu-rest runs
# every other GPU test)
FP8_TESTS="tests/kernels/test_fp8.py tests/kernels/test_attention_act_fp8.py tests/kernels/test_token_layer_norm_modulate_fp8.py tests/kernels/test_qk_norm_rope.py tests/kernels/test_qk_norm_rope_fp32.py tests/models/test_head_major.py tests/fp8"
status=0
# a phase's clock: `left N` is what remains of N seconds since the phase began
start=$SECONDS
left() { echo $(( $1 - (SECONDS - start) )); }
case "$phase" in
  kernels)
    timeout 200 python3 -m pytest -q -m gpu tests -p no:cacheprovider -x 2>&1 | tee "$OUT/gpu_tests.txt" | tail -20 || status=1
    timeout 200 python3 scripts/kernel_check.py 2>&1 | tee "$OUT/kernel_check.txt" || status=1
    timeout 240 python3 scripts/bench.py --dit --profile --json "$OUT/bench_dit.json" 2>&1 | tee "$OUT/bench_dit.txt" || status=1
    ;;
  e2e)
    timeout 330 python3 scripts/bench.py --pipeline --json "$OUT/bench_pipeline.json" 2>&1 | tee "$OUT/bench_pipeline.txt" || status=1
    timeout 240 python3 scripts/bench_flux2.py --json "$OUT/bench_flux2.json" 2>&1 | tee "$OUT/bench_flux2.txt" || status=1
    timeout 240 python3 scripts/bench_flux2_pipeline.py --json "$OUT/bench_flux2_pipeline.json" 2>&1 | tee "$OUT/bench_flux2_pipeline.txt" || status=1
    ;;
  fp8)
    timeout 150 python3 -m pytest -q -m gpu tests/kernels/test_fp8.py tests/kernels/test_dispatch.py -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests_fp8.txt" | tail -15 || status=1
    timeout 420 python3 scripts/bench_fp8.py --json "$OUT/bench_fp8.json" 2>&1 | tee "$OUT/bench_fp8.txt" || status=1
    ;;
  fp8-flux3)
    timeout 260 python3 -m pytest -q -m gpu tests/fp8/test_flux3_fp8.py tests/fp8/test_flux3_fp8_producers.py tests/kernels/test_token_layer_norm_modulate_fp8.py -p no:cacheprovider -s 2>&1 | tee "$OUT/gpu_tests_flux3_fp8.txt" | tail -15 || status=1
    timeout 380 python3 scripts/bench_fp8.py --models flux3-klein --json "$OUT/bench_fp8_flux3.json" 2>&1 | tee "$OUT/bench_fp8_flux3.txt" | tail -40 || status=1
    ;;
  merged)
    # the whole GPU test suite, an FP8 tiny image through flux-gen on CUDA, the tiny models' held-out
    # scores and grid, and one FP8 step profiled
    timeout 300 python3 -m pytest -q -m gpu tests -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.txt" | tail -25 || status=1
    (cd /tmp && python3 -c "from flux_runtime.cli.gen import main; main()" --model tiny --fp8 --prompt "a red circle on a blue background" --out "$OUT/tiny_fp8.png" -q) || status=1
    timeout 150 python3 scripts/eval_tiny.py --device cuda --json "$OUT/eval_tiny.json" --grid "$OUT/tiny_grid.png" 2>&1 | tail -30 || status=1
    timeout 200 python3 scripts/bench_fp8.py --models flux1-dev --profile --json "$OUT/bench_fp8_profile.json" 2>&1 | tee "$OUT/bench_fp8_profile.txt" | tail -60 || status=1
    ;;
  final)
    # the whole GPU test suite (pipelines with CUDA graphs, every kernel at every FLUX shape) and the FP8 bench
    timeout 300 python3 -m pytest -q -m gpu tests -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.txt" | tail -25 || status=1
    timeout 280 python3 scripts/bench_fp8.py --json "$OUT/bench_fp8.json" 2>&1 | tee "$OUT/bench_fp8.txt" | grep -v "^\[" || status=1
    ;;
  high)
    timeout 300 python3 -m pytest -q -m gpu tests -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.txt" | tail -25 || status=1
    timeout 150 python3 scripts/bench_vae.py --json "$OUT/bench_vae.json" 2>&1 | tee "$OUT/bench_vae.txt" || status=1
    ;;
  mid)
    timeout 200 python3 -m pytest -q -m gpu tests/lora/test_fp8_lora.py tests/kernels/test_group_norm.py tests/pipeline/test_flux1_pipeline.py -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests_mid.txt" | tail -15 || status=1
    timeout 120 python3 scripts/bench_vae.py --json "$OUT/bench_vae.json" 2>&1 | tee "$OUT/bench_vae.txt" | grep -v "^ *\"\(cudnn\|fp16\|channels_last\)" || status=1
    timeout 200 python3 scripts/bench.py --variants --json "$OUT/bench_variants.json" 2>&1 | tee "$OUT/bench_variants.txt" | tail -30 || status=1
    timeout 150 python3 scripts/bench.py --dit --json "$OUT/bench_dit.json" 2>&1 | tee "$OUT/bench_dit.txt" | tail -14 || status=1
    timeout 150 python3 scripts/bench_lora.py 2>&1 | tee "$OUT/bench_lora.txt" | tail -5 || status=1
    ;;
  all3)
    timeout 380 python3 -m pytest -q -m gpu tests -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.txt" | tail -25 || status=1
    timeout 180 python3 scripts/bench_flux3.py --models flow-map --json "$OUT/bench_flux3.json" 2>&1 | tee "$OUT/bench_flux3.txt" | tail -30 || status=1
    ;;
  verify)
    timeout 350 python3 -m pytest -q -m gpu tests -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.txt" | tail -25 || status=1
    timeout 200 python3 scripts/bench_flux3.py --models flow-map --per-image --json "$OUT/bench_flux3.json" 2>&1 | tee "$OUT/bench_flux3.txt" | tail -30 || status=1
    ;;
  flux3)
    # the FLUX.3 GPU tests, every step bench and the base model's whole-image denoising (50 steps, CFG)
    timeout 200 python3 -m pytest -q -m gpu tests/models/test_flux3_dit.py tests/pipeline/test_flux3_reference_images.py tests/kernels/test_qk_norm_rope_fp32.py tests/kernels/test_token_layer_norm_modulate.py tests/kernels/test_token_gated_residual.py tests/lora/test_flux3_pipeline_lora.py tests/text/test_flux3_upsampler.py -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests_flux3.txt" | tail -8 || status=1
    timeout 400 python3 scripts/bench_flux3.py --per-image --json "$OUT/bench_flux3.json" 2>&1 | tee "$OUT/bench_flux3.txt" | grep "^|" || status=1
    ;;
  memory)
    # the caching allocator's defaults (no expandable segments): what the planner budgets for
    unset PYTORCH_CUDA_ALLOC_CONF
    timeout 100 python3 -m pytest -q -m gpu tests/pipeline/test_memory.py tests/pipeline/test_memory_peaks.py -p no:cacheprovider 2>&1 | tail -4 || status=1
    timeout 60 python3 scripts/bench_memory.py --trace-build --model "${2:-flux1}" 2>&1 | tail -3 || status=1
    timeout 420 python3 scripts/bench_memory.py --model "${2:-flux1}" --json "$OUT/bench_memory_${2:-flux1}.json" 2>"$OUT/bench_memory_${2:-flux1}.err" | tee "$OUT/bench_memory_${2:-flux1}.txt" | tail -30 || status=1
    tail -45 "$OUT/bench_memory_${2:-flux1}.err"
    ;;
  vae)
    timeout 300 python3 -m pytest -q -m gpu tests -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.txt" | tail -25 || status=1
    python3 -c "import torch; print('quantized sdpa op:', hasattr(torch.ops.aten, '_scaled_dot_product_attention_quantized'), 'cudnn', torch.backends.cudnn.version())"
    timeout 240 python3 scripts/bench_vae.py --compile --profile --json "$OUT/bench_vae.json" 2>&1 | tee "$OUT/bench_vae.txt" || status=1
    ;;
  serve)
    # flux-serve's GPU tests and its load bench on the tiny model (.whl/serve: scripts/fetch_serve_wheels.sh)
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/serve/*.whl || exit 1
    timeout 200 python3 -m pytest -q -m gpu tests/serve -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests_serve.txt" | tail -8 || status=1
    timeout 300 python3 scripts/bench_serve.py --json "$OUT/bench_serve_tiny.json" 2>&1 | tail -8 || status=1
    ;;
  serve-flux1)
    # flux-serve's load bench on full-size FLUX.1-dev with random weights, 1024², 28 steps, batching on and off
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/serve/*.whl || exit 1
    timeout 560 python3 scripts/bench_serve.py --model flux1-dev --random-weights --json "$OUT/bench_serve_flux1.json" --log-dir "$OUT/serve_logs" 2>&1 | tail -12 || status=1
    ;;
  serve-ray)
    # issue 40: Ray Serve's overhead on one GPU. The serve wheels into /tmp/site, Ray's slim set into /tmp/ray-site
    # (first on PYTHONPATH: its protobuf is the one Ray's generated code was tested with), the random-weight
    # FLUX.1-dev folder, then one process and one replica back to back: 16 requests each from 8 clients with
    # batches of up to 4 (about 4 batches of 28 steps per server), warm-up and loads outside the clock
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/serve/*.whl || exit 1
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/ray-site .whl/ray/*.whl || exit 1
    # the Ray tree: carried now (.whl/raytar) or by the `ray-stage` call just before, which left it in /tmp/ray-stage
    tree=$(ls .whl/raytar/ray-*-slim.tar.xz /tmp/ray-stage/ray-*-slim.tar.xz 2>/dev/null | head -1)
    [ -n "$tree" ] || { echo "serve-ray: no Ray tree: carry .whl/raytar, or run ray-stage first on this machine"; exit 1; }
    tar -xJf "$tree" -C /tmp/ray-site || exit 1
    export PYTHONPATH=/tmp/ray-site:$PYTHONPATH RAY_USAGE_STATS_ENABLED=0
    python3 -c "import ray, ray.serve; print('ray', ray.__version__, 'from', ray.__file__)" || exit 1
    df -h /tmp /dev/shm | tail -2
    timeout 100 python3 scripts/bench_cold_start.py build /tmp/cold --models flux1-dev --out "$OUT/cold_start.jsonl" 2>&1 | grep '^{' || status=1
    timeout $((560 - (SECONDS - start))) python3 scripts/bench_serve.py --model /tmp/cold/flux1-dev --size 1024 --steps 28 --modes batching --compare-replicas --requests 16 --concurrency 8 --max-batch 4 --json "$OUT/bench_serve_ray.json" --log-dir "$OUT/serve_ray_logs" 2>&1 | tail -12 || status=1
    ps -eo pid,args | grep -E "ray::|/ray/core/src/ray/" | grep -v grep || echo "no Ray processes left"
    # the replica's own log (its load, its traceback if it failed) when something went wrong
    [ $status = 0 ] || cp -r /tmp/ray/session_latest/logs/serve "$OUT/ray_serve_logs" 2>/dev/null
    echo "serve-ray: $((SECONDS - start)) s"
    ;;
  ray-stage)
    # the first of serve-ray's two calls: the tree and the wheels do not fit one call's carry beside the repository,
    # so this one carries .whl/raytar alone and leaves the tree in /tmp/ray-stage for serve-ray on the warm machine
    mkdir -p /tmp/ray-stage && cp .whl/raytar/ray-*-slim.tar.xz /tmp/ray-stage/ && ls -la /tmp/ray-stage || exit 1
    ;;
  train-tiny|tiny-final)
    # $OUT brings back at most 8 files: each model's DiT and loss log (its autoencoder and, frozen, its text
    # encoders are the shipped ones), the held-out scores, the grid and the training logs
    if [ "$phase" = tiny-final ]; then secs=${2:-300}; batch=128; fg=4; text=frozen; else secs=${2:-360}; batch=${3:-128}; fg=${4:-0}; text=${5:-frozen}; fi
    seed=${6:-0}
    freeze=$([ "$text" = train ] && echo "" || echo --freeze-text)  # TEXT=train: the text encoders train with the DiT
    for fam in flux1 flux2; do
      name=$([ $fam = flux1 ] && echo tiny || echo tiny-flux2)
      timeout $((secs + 150)) python3 scripts/train_tiny.py --family $fam --out "/tmp/train/$name" \
        --resume "flux_runtime/assets/models/$name" --vae-steps 0 $freeze --dit-steps 100000 --dit-seconds "$secs" --dit-batch "$batch" --fg-weight "$fg" --seed "$seed" ${TRAIN_ARGS:-} \
        > "$OUT/train_$name.log" 2>&1 &
    done
    wait
    for name in tiny tiny-flux2; do
      tail -n 3 "$OUT/train_$name.log"
      dit=$([ $name = tiny ] && echo flux1-tiny || echo flux2-tiny).safetensors
      if [ -f "/tmp/train/$name/loss.json" ]; then
        if [ "$text" = train ]; then  # the DiT, the loss log and the text encoders, one file (8 come back at most)
          tar -C "/tmp/train/$name" -cf "$OUT/$name.tar" "$dit" loss.json $(cd "/tmp/train/$name" && ls -d text_encoder*)
          cp -r "/tmp/train/$name"/text_encoder* "flux_runtime/assets/models/$name/"
        else
          cp "/tmp/train/$name/$dit" "$OUT/$name.safetensors"; cp "/tmp/train/$name/loss.json" "$OUT/${name}_loss.json"
        fi
        cp "/tmp/train/$name/$dit" "flux_runtime/assets/models/$name/$dit"  # scored below in place of the shipped DiT
      else
        echo "$name: training wrote no weights"; status=1
      fi
    done
    timeout 160 python3 scripts/eval_tiny.py --device cuda --seen --sweeps 4 --json "$OUT/eval_after.json" --grid "$OUT/tiny_grid.png" 2>&1 | tail -6 || status=1
    if [ "$phase" = tiny-final ]; then
      timeout 80 python3 scripts/eval_tiny.py --device cuda --variants --json "$OUT/eval_variants.json" 2>&1 | grep -v "^\[" | tail -12 || status=1
      timeout 90 python3 -m pytest -q -m gpu tests/pipeline/test_flux1_pipeline.py tests/pipeline/test_flux2_pipeline.py tests/pipeline/test_tiny_models.py tests/lora/test_fp8_lora.py -p no:cacheprovider 2>&1 | tail -4 || status=1
    fi
    ;;
  tiny-fresh)
    secs=${2:-290}
    for fam in flux1 flux2; do
      name=$([ $fam = flux1 ] && echo tiny || echo tiny-flux2)
      timeout $((secs + 260)) python3 scripts/train_tiny.py --family $fam --out "/tmp/train/$name" --vae-rgb 0.5 \
        --vae-seconds 100 --dit-steps 100000 --dit-seconds "$secs" --fg-weight 4 > "$OUT/train_$name.log" 2>&1 &
    done
    wait
    for name in tiny tiny-flux2; do
      grep "round trip\|latent statistics\|budget reached" "$OUT/train_$name.log"
      if [ -f "/tmp/train/$name/loss.json" ]; then
        tar -C "/tmp/train/$name" -cf "$OUT/$name.tar" .
        cp /tmp/train/$name/*.safetensors "flux_runtime/assets/models/$name/"
        rm -rf flux_runtime/assets/models/$name/text_encoder*; cp -r /tmp/train/$name/text_encoder* "flux_runtime/assets/models/$name/"
      else
        echo "$name: training wrote no weights"; status=1
      fi
    done
    timeout 120 python3 scripts/eval_tiny.py --model tiny-flux2 --device cuda --seen --autoencoder --json "$OUT/eval_fresh.json" 2>&1 | tail -5 || status=1
    ;;
  tiny-decoder)
    secs=${2:-280}
    for name in tiny tiny-flux2; do
      fam=$([ $name = tiny ] && echo flux1 || echo flux2)
      timeout $((secs + 120)) python3 scripts/train_tiny.py --family $fam --resume "flux_runtime/assets/models/$name" \
        --decoder-only --vae-rgb 0.5 --vae-lr 3e-4 --vae-steps 100000 --vae-seconds "$secs" --out "/tmp/train/$name" \
        > "$OUT/train_$name.log" 2>&1 &
    done
    wait
    for name in tiny tiny-flux2; do
      grep "round trip\|budget reached\|Error" "$OUT/train_$name.log"
      if [ -f "/tmp/train/$name/loss.json" ]; then
        tar -C "/tmp/train/$name" -cf "$OUT/$name.tar" ae.safetensors loss.json loss.png
        cp "/tmp/train/$name/ae.safetensors" "flux_runtime/assets/models/$name/"
      else
        echo "$name: training wrote no weights"; status=1
      fi
    done
    timeout 150 python3 scripts/eval_tiny.py --device cuda --seen --autoencoder --json "$OUT/eval_decoder.json" --grid "$OUT/tiny_grid.png" 2>&1 | tail -8 || status=1
    ;;
  tiny-ae-ab|tiny-anchor)
    # anchored autoencoder fine-tunes side by side (--encoder-anchor 1 --vae-rgb 0.5 plus each run's options),
    # each scored with the shipped DiT in place (eval_tiny.py --seen --autoencoder); the shipped files stay.
    # tiny-anchor: both models once per anchor weight W [1 10], as runs labelled wW
    secs=${2:-230}
    if [ "$phase" = tiny-anchor ]; then
      shift $(( $# > 1 ? 2 : $# )); RUNS=""
      for name in tiny tiny-flux2; do for w in ${*:-1 10}; do RUNS+="$name w$w --encoder-anchor $w;"; done; done
    fi
    [ -n "${RUNS:-}" ] || { echo "tiny-ae-ab needs RUNS=\"NAME LABEL [OPTIONS];...\""; exit 2; }
    IFS=';' read -ra runs <<< "$RUNS"
    for run in "${runs[@]}"; do
      read -r name label opts <<< "$run"
      ae_tune "$name" "flux_runtime/assets/models/$name" "/tmp/train/${name}_$label" "$secs" $opts \
        > "/tmp/train_${name}_$label.log" 2>&1 &
    done
    wait
    for run in "${runs[@]}"; do
      read -r name label opts <<< "$run"; dir="/tmp/train/${name}_$label"; echo "== $name $label ($opts)"
      grep "round trip\|budget reached\|drift on\|Error" "/tmp/train_${name}_$label.log"
      if [ ! -f "$dir/loss.json" ]; then echo "$name $label: training wrote no weights"; status=1; continue; fi
      tar -C "$dir" -cf "$OUT/${name}_$label.tar" ae.safetensors loss.json loss.png
      swap_score "$name" "$dir" "eval_${name}_$label.json" --device cuda --autoencoder || status=1
    done
    ;;
  tiny-ae-dit)
    # tiny-ae-ab's anchored autoencoder fine-tunes, then each run's DiT + text encoders trained on from its new
    # autoencoder (as tiny-ab: fg 4, batch 128); each run's whole folder comes back as $OUT/<NAME>_<LABEL>.tar
    # (loss_ae.json: the autoencoder stage's log) and, while time is left, is scored in place of the shipped one
    ae_secs=${2:-150}; dit_secs=${3:-200}; seed=${4:-16}
    [ -n "${RUNS:-}" ] || { echo "tiny-ae-dit needs RUNS=\"NAME LABEL [AUTOENCODER OPTIONS];...\""; exit 2; }
    IFS=';' read -ra runs <<< "$RUNS"
    for run in "${runs[@]}"; do
      read -r name label opts <<< "$run"; dir="/tmp/train/${name}_$label"
      ( ae_tune "$name" "flux_runtime/assets/models/$name" "${dir}_ae" "$ae_secs" $opts > "/tmp/train_${name}_${label}_ae.log" 2>&1 &&
        dit_train "$name" "${dir}_ae" "$dir" "$dit_secs" "$seed" > "/tmp/train_${name}_$label.log" 2>&1 ) &
    done
    wait
    for run in "${runs[@]}"; do
      read -r name label opts <<< "$run"; dir="/tmp/train/${name}_$label"; echo "== $name $label ($opts)"
      grep -h "round trip\|budget reached\|drift on\|Error" "/tmp/train_${name}_${label}_ae.log" "/tmp/train_${name}_$label.log"
      if [ ! -f "$dir/loss.json" ]; then echo "$name $label: training wrote no weights"; status=1; continue; fi
      cp "${dir}_ae/loss.json" "$dir/loss_ae.json"; rm -f "$dir/loss.png"
      tar -C "$dir" -cf "$OUT/${name}_$label.tar" .
      [ $SECONDS -lt 520 ] || { echo "no time left to score $name $label"; continue; }
      swap_score "$name" "$dir" "eval_${name}_$label.json" --device cuda --autoencoder || status=1
    done
    ;;
  tiny-ab|tiny-drop)
    secs=${2:-300}; dev=${DEVICE:-cuda}
    if [ "$phase" = tiny-drop ]; then
      frac=${3:-0.3}; seed=${4:-15}; RUNS="tiny ctrl;tiny drop --caption-drop $frac;tiny-flux2 drop --caption-drop $frac"
    else
      seed=${3:-15}; [ -n "${RUNS:-}" ] || { echo "tiny-ab needs RUNS=\"NAME LABEL [OPTIONS];...\""; exit 2; }
    fi
    ab_start "$secs" "$seed" "$dev"; wait; ab_score "$dev" || status=1
    ;;
  splice-gelu)
    # tiny's --splice runs (0.5, 0.8) side by side; beside them, where only bits count, attention_act_fp8's GPU
    # tests (the GELU max shortcut), tiny-flux2's variants and the tiny models' GPU tests; then the runs' scores
    # and, on a quiet GPU, kernel_check's timing of the shortcut
    secs=${2:-200}; seed=${3:-15}
    for f in 0.5 0.8; do
      dit_train tiny flux_runtime/assets/models/tiny "/tmp/train/tiny_s$f" "$secs" "$seed" --splice "$f" \
        > "/tmp/train_tiny_s$f.log" 2>&1 &
    done
    timeout 150 python3 -m pytest -q -m gpu tests/kernels/test_attention_act_fp8.py -p no:cacheprovider 2>&1 | tail -3 || status=1
    timeout 80 python3 scripts/eval_tiny.py --model tiny-flux2 --device cuda --variants --json "$OUT/eval_variants_flux2.json" 2>&1 | grep -v "^\[" | tail -6 || status=1
    timeout 80 python3 -m pytest -q -m gpu tests/pipeline/test_tiny_models.py -p no:cacheprovider 2>&1 | tail -3 || status=1
    wait
    for f in 0.5 0.8; do echo "== tiny --splice $f"; score_run tiny "s$f" cuda || status=1; done
    left=$((570 - SECONDS)); [ $left -gt 30 ] || { echo "no time left for kernel_check"; exit 1; }
    timeout $left python3 scripts/kernel_check.py --op attention_act_fp8 2>&1 | tee "$OUT/kernel_check_attention_act.txt" | grep -v "^\[" | tail -16 || status=1
    ;;
  tiny-verify)
    timeout 160 python3 scripts/eval_tiny.py --device cuda --seen --sweeps 4 --autoencoder --json "$OUT/eval_final.json" --grid "$OUT/tiny_grid.png" 2>&1 | tail -6 || status=1
    timeout 80 python3 scripts/eval_tiny.py --device cuda --variants --json "$OUT/eval_variants.json" 2>&1 | grep -v "^\[" | tail -12 || status=1
    timeout 90 python3 -m pytest -q -m gpu tests/pipeline/test_flux1_pipeline.py tests/pipeline/test_flux2_pipeline.py tests/pipeline/test_tiny_models.py tests/lora/test_fp8_lora.py -p no:cacheprovider 2>&1 | tail -4 || status=1
    ;;
  fp8-single)
    timeout 200 python3 -m pytest -q -m gpu tests/kernels/test_attention_act_fp8.py tests/kernels/test_fp8.py tests/fp8/test_fp8_pipeline.py tests/fp8/test_fp8_loading.py -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests_fp8_single.txt" | tail -6 || status=1
    timeout 120 python3 scripts/kernel_check.py --op attention_act_fp8 2>&1 | tee "$OUT/kernel_check_attention_act.txt" | tail -12 || status=1
    timeout 300 python3 scripts/bench_fp8.py --json "$OUT/bench_fp8.json" 2>&1 | tee "$OUT/bench_fp8.txt" | grep "^|\|attention_act\|fallback\|relative" || status=1
    ;;
  memory-rerun)
    unset PYTORCH_CUDA_ALLOC_CONF
    timeout 120 python3 scripts/bench_memory.py --model flux1 --fp8-flux1 --no-diffusers --json "$OUT/bench_memory_flux1_fp8.json" 2>"$OUT/bench_memory_flux1_fp8.err" | tail -6 || status=1
    timeout 400 python3 scripts/bench_memory.py --model flux2 --json "$OUT/bench_memory_flux2.json" 2>"$OUT/bench_memory_flux2.err" | tail -8 || status=1
    ;;
  fp8-profile)
    timeout 120 python3 -m pytest -q -m gpu tests/kernels/test_attention_act_fp8.py -p no:cacheprovider 2>&1 | tail -3 || status=1
    timeout 120 python3 scripts/kernel_check.py --op attention_act_fp8 2>&1 | tee "$OUT/kernel_check_attention_act.txt" | head -24 || status=1
    timeout 300 python3 scripts/bench_fp8.py --models flux2-dev --profile --json "$OUT/bench_fp8_flux2_profile.json" 2>&1 | tee "$OUT/bench_fp8_flux2_profile.txt" | grep -v "^\[" | tail -70 || status=1
    ;;
  fp8-floor)
    timeout 540 python3 scripts/bench_fp8.py --profile --json "$OUT/bench_fp8.json" > "$OUT/bench_fp8.txt" 2>&1 || status=1
    grep "^|\|fallback\|relative\|Error" "$OUT/bench_fp8.txt" | grep -v "^| *\(aten\|void\|sm90\|cutlass\|Name\|-\)" || status=1
    ;;
  fp8-tests)
    # the GPU tests of every FP8 producer, the e4m3 conversion and the attention inputs' layout, with room to finish
    # (fp8-layout's 180 s stopped them at about 70 % in session 17); with RUNS, its tiny-ab trainings (SECONDS [270],
    # SEED [19]) run beside the tests and are scored after them
    secs=${2:-270}; seed=${3:-19}; tests_s=560
    [ -z "${RUNS:-}" ] || { ab_start "$secs" "$seed" cuda; tests_s=$((secs + 60)); }
    timeout $tests_s python3 -m pytest -q -m gpu $FP8_TESTS -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests_fp8_all.txt" | tail -6 || status=1
    wait
    [ -z "${RUNS:-}" ] || ab_score cuda || status=1
    ;;
  gpu-rest)
    # every GPU test outside FP8_TESTS (fp8-tests runs those), with RUNS's tiny-ab trainings (SECONDS [240], SEED
    # [22]) beside them if given, then the runs' scores
    secs=${2:-240}; seed=${3:-22}
    [ -z "${RUNS:-}" ] || ab_start "$secs" "$seed" cuda
    timeout 400 python3 -m pytest -q -m gpu tests $(printf -- '--ignore=%s ' $FP8_TESTS) -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests_rest.txt" | tail -8 || status=1
    wait
    [ -z "${RUNS:-}" ] || ab_score cuda || status=1
    ;;
  fp8-gelu)
    timeout 260 python3 scripts/bench_fp8.py --models "${MODELS:-flux1-dev,klein-4b}" --json "$OUT/bench_fp8_act.json" > "$OUT/bench_fp8_act.txt" 2>&1 || status=1
    grep "^|\|fallback\|relative\|Error" "$OUT/bench_fp8_act.txt" || status=1
    timeout 90 python3 scripts/kernel_check.py --op gelu_tanh_fp8 --op swiglu_fp8 2>&1 | tee "$OUT/kernel_check_act_fp8.txt" | grep -v "^\[" | tail -32 || status=1
    timeout 150 python3 -m pytest -q -m gpu tests/kernels/test_fp8.py tests/kernels/test_attention_act_fp8.py -p no:cacheprovider 2>&1 | tail -3 || status=1
    ;;
  fp8-layout)
    # on a quiet GPU: the FP8 bench (MODELS) with the attention inputs' layout A/B (--layout-ab), the per-row
    # producers' tile A/B and the e4m3 conversion's A/B; then, side by side, RUNS's tiny-ab trainings (if
    # given; SECONDS [200], SEED [15]) and the GPU tests of the layout and the FP8 producers, then the runs' scores
    secs=${2:-200}; seed=${3:-15}
    timeout 360 python3 scripts/bench_fp8.py --models "${MODELS:-flux1-dev,klein-4b}" --layout-ab --json "$OUT/bench_fp8_layout.json" > "$OUT/bench_fp8_layout.txt" 2>&1 || status=1
    grep "^|\|fallback\|relative\|A/B\|Error" "$OUT/bench_fp8_layout.txt" || status=1
    [ -z "${RUNS:-}" ] || ab_start "$secs" "$seed" cuda
    timeout 180 python3 -m pytest -q -m gpu tests/kernels/test_qk_norm_rope.py tests/kernels/test_qk_norm_rope_fp32.py tests/models/test_head_major.py tests/kernels/test_fp8.py tests/kernels/test_attention_act_fp8.py tests/kernels/test_token_layer_norm_modulate_fp8.py -p no:cacheprovider 2>&1 | tail -3 || status=1
    wait
    [ -z "${RUNS:-}" ] || ab_score cuda || status=1
    ;;
  memory-28)
    unset PYTORCH_CUDA_ALLOC_CONF
    timeout 120 python3 scripts/bench_memory.py --model flux1 --fp8-flux1 --no-diffusers --steps 28 --json "$OUT/bench_memory_flux1_fp8_28.json" 2>"$OUT/bench_memory_flux1_fp8_28.err" | tail -4 || status=1
    timeout 220 python3 scripts/bench_memory.py --model flux2 --steps 28 --json "$OUT/bench_memory_flux2_28.json" 2>"$OUT/bench_memory_flux2_28.err" | tail -6 || status=1
    ;;
  flux1-reach)
    unset PYTORCH_CUDA_ALLOC_CONF
    timeout 150 python3 scripts/bench_memory.py --model flux1 --no-diffusers --json "$OUT/bench_memory_flux1_bf16.json" 2>"$OUT/bench_memory_flux1_bf16.err" | tail -6 || status=1
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/serve/*.whl || exit 1
    timeout 250 python3 scripts/bench_serve.py --model flux1-dev --random-weights --requests 8 --json "$OUT/bench_serve_flux1.json" --log-dir "$OUT/serve_logs" 2>&1 | tail -12 || status=1
    left=$((420 - (SECONDS - start)))
    [ $left -gt 60 ] && { timeout $left python3 scripts/bench_memory.py --model flux1 --fp8-flux1 --no-diffusers --json "$OUT/bench_memory_flux1_fp8.json" 2>"$OUT/bench_memory_flux1_fp8.err" | tail -6 || status=1; }
    ;;
  cold-start)
    # issue 33's bench (scripts/bench_cold_start.py): the loader's and the page-cache / pinned-ring GPU tests, the
    # full-size random folders (MODELS [flux1-dev,klein-4b]), the read rates against this machine's limits (page
    # cache warm; with COLD=1 also dropped), then fresh processes: flux-gen against the diffusers script (carry
    # .whl: .whl/extra holds fastsafetensors and runai-model-streamer; READ=0 skips the read rates)
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/extra/*.whl || status=1
    models=${MODELS:-flux1-dev,klein-4b}
    timeout 150 python3 -m pytest -q -m gpu tests/weights/test_pinned_stream.py tests/text/test_flux1_text.py tests/text/test_flux2_text.py -p no:cacheprovider 2>&1 | tail -4 || status=1
    df -h /tmp | tail -1; free -g | head -2
    timeout 300 python3 scripts/bench_cold_start.py build /tmp/cold --models "$models" --out "$OUT/cold_start.jsonl" || status=1
    [ "${READ:-1}" = 0 ] || timeout 200 python3 scripts/bench_cold_start.py read /tmp/cold --out "$OUT/cold_start.jsonl" ${RING:+--ring $RING} || status=1
    [ -z "${COLD:-}" ] || timeout 200 python3 scripts/bench_cold_start.py read /tmp/cold --cold --ring 16x32x16 --out "$OUT/cold_start.jsonl" || status=1
    timeout 400 python3 scripts/bench_cold_start.py cold /tmp/cold --models "$models" --repeat "${REPEAT:-1}" --prompts "${PROMPTS:-8}" --out "$OUT/cold_start.jsonl" || status=1
    ;;
  close-33-35)
    # session 21's one call: every GPU test outside the kernels' (those passed after the refactor) and issue 33's
    # cold start of the transformers-free FLUX.1 path (FLUX.1-dev bf16 / --fp8 and klein-4B against the diffusers
    # scripts, --prompts 8), then the import table if time is left (carry .whl)
    timeout 200 python3 -m pytest -q -m gpu tests --ignore=tests/kernels -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests_nonkernel.txt" | tail -5 || status=1
    timeout 150 python3 scripts/bench_cold_start.py build /tmp/cold --models flux1-dev,klein-4b --out "$OUT/cold_start.jsonl" 2>&1 | grep '^{' || status=1
    timeout $((560 - (SECONDS - start))) python3 scripts/bench_cold_start.py cold /tmp/cold --models flux1-dev,klein-4b --prompts 8 --out "$OUT/cold_start.jsonl" 2>&1 | tail -3 || status=1
    left=$((570 - (SECONDS - start)))
    [ $left -gt 40 ] && { timeout $left python3 scripts/bench_cold_start.py imports /tmp/cold --out "$OUT/cold_start.jsonl" 2>&1 | tail -2 || status=1; }
    cat "$OUT/cold_start.jsonl"
    ;;
  final-21)
    # session 21's last call, most needed first: the new GPU tests (step caching, the native text encoders, klein's
    # memory plans), issue 33's cold start (FLUX.1-dev bf16 / --fp8 and klein-4B against the diffusers scripts)
    # with the first call's stages, then step caching at full size (scripts/bench_cache.py) and a tiny FLUX.2
    # sweep with what time is left (carry .whl)
    timeout 100 python3 -m pytest -q -m gpu tests/pipeline/test_step_cache.py tests/text tests/pipeline/test_memory.py tests/pipeline/test_flux2_pipeline.py -p no:cacheprovider 2>&1 | tail -4 || status=1
    timeout 100 python3 scripts/bench_cold_start.py build /tmp/cold --models flux1-dev,klein-4b --out "$OUT/cold_start.jsonl" 2>&1 | grep '^{' || status=1
    timeout 60 python3 scripts/bench_cold_start.py first-call /tmp/cold --models flux1-dev --out "$OUT/cold_start.jsonl" || status=1
    timeout $(left 400) python3 scripts/bench_cold_start.py cold /tmp/cold --models flux1-dev,klein-4b --prompts 0 --out "$OUT/cold_start.jsonl" 2>&1 | tail -2 || status=1
    cat "$OUT/cold_start.jsonl"
    [ $(left 470) -gt 30 ] && { timeout $(left 470) python3 scripts/bench_cache.py /tmp/cold/flux1-dev --json "$OUT/bench_cache.json" 2>&1 | grep -v "^\\[" | tail -12 || status=1; }
    [ $(left 500) -gt 15 ] && { timeout $(left 500) python3 scripts/eval_cache.py --model tiny-flux2 --device cuda --policy first-block:threshold=0.05 --policy first-block:threshold=0.1 --policy first-block:threshold=0.15 --policy taylor:order=1,refresh=2 --json "$OUT/eval_cache_flux2.json" 2>&1 | tail -6 || status=1; }
    ;;
  gpu-nonkernel)
    # every GPU test outside tests/kernels (the kernels' 1491 passed after the refactor), slowest listed
    timeout 570 python3 -m pytest -q -m gpu tests --ignore=tests/kernels -p no:cacheprovider --durations=15 2>&1 | tee "$OUT/gpu_tests_nonkernel.txt" | tail -30 || status=1
    ;;
  refactor)
    # one call after a refactor and the native text encoders: their GPU tests, FLUX.1-dev's cold start (flux-gen
    # bf16 and --fp8 against the diffusers script), then the FLUX.1-dev step bench of this tree and of BEFORE (a
    # dir holding an export of the older tree's flux_runtime and scripts)
    timeout 60 python3 -m pytest -q -x -m gpu tests/text/test_native_encoders.py tests/text/test_flux1_text.py tests/pipeline/test_text_device.py -p no:cacheprovider 2>&1 | tail -3 || status=1
    timeout 90 python3 scripts/bench_cold_start.py build /tmp/cold --models flux1-dev --out "$OUT/cold_start.jsonl" 2>&1 | grep '^{' || status=1
    timeout 150 python3 scripts/bench_cold_start.py cold /tmp/cold --models flux1-dev --prompts 0 --out "$OUT/cold_start.jsonl" 2>&1 | tail -3 || status=1
    timeout 75 python3 scripts/bench.py --dit --iters 5 --json "$OUT/bench_dit_after.json" 2>&1 | tail -12 || status=1
    if [ -n "${BEFORE:-}" ]; then
      (cd "$BEFORE" && PYTHONPATH=/tmp/site:$PWD timeout 75 python3 scripts/bench.py --dit --iters 5 --json "$OUT/bench_dit_before.json" 2>&1 | tail -12) || status=1
    fi
    ;;
  controlnet)
    # issue 38's ControlNets: their GPU tests (diffusers' bits with the fused kernels and CUDA graphs; high, FP8
    # and a step cache running), then one FLUX.1-dev step with an InstantX-shaped ControlNet against diffusers'
    # (scripts/bench_controlnet.py; carry .whl)
    timeout 200 python3 -m pytest -q -m gpu tests/controlnet -p no:cacheprovider 2>&1 | tail -4 || status=1
    timeout 300 python3 scripts/bench_controlnet.py --json "$OUT/bench_controlnet.json" 2>&1 | tail -12 || status=1
    ;;
  gguf)
    # GGUF checkpoints: the fused dequantization kernel's GPU tests (every type at FLUX.1-dev's projection shapes,
    # special fp16 scales, GgufLinear in a CUDA graph), the GGUF loaders' and pipeline's (diffusers' bits on the
    # GPU, lossless tier included), the dispatcher's all-ops check; then scripts/bench_gguf.py (carry .whl)
    timeout 240 python3 -m pytest -q -m gpu tests/kernels/test_gguf_dequant_kernel.py tests/gguf \
      tests/kernels/test_dispatch.py -p no:cacheprovider 2>&1 | tail -6 || status=1
    # (its step part as before: Q4_K and Q8_0 against the bf16 twin only; gguf-diffusers adds diffusers and memory)
    timeout 330 python3 scripts/bench_gguf.py --step-types Q4_K,Q8_0 --no-diffusers --json "$OUT/bench_gguf.json" 2>&1 \
      | tail -120 || status=1
    ;;
  gguf-diffusers)
    # issue 39: per type (Q8_0, Q5_K, Q4_K) our GGUF step (eager off / lossless, lossless + CUDA graph) against the
    # bf16 twin and against diffusers' from_single_file GGUF model on a file of the same blocks (BFL names, written
    # to /tmp and deleted once loaded: 12.7 / 8.2 / 6.7 GB), torch.equal checked, each model's resident weights and
    # peak during one eager step. Part 1 skipped (--types ''). Estimate: ~40-60 s per type (two builds of the
    # random model, the file written and read back through the page cache, 11 calls per variant at
    # 0.13-0.5 s) plus the Triton kernels' first compile and diffusers' import, about 4-5 min in all (carry .whl)
    timeout 540 python3 scripts/bench_gguf.py --types '' --step-types Q8_0,Q5_K,Q4_K --iters 5 \
      --json "$OUT/bench_gguf_steps.json" 2>&1 | tail -100 || status=1
    ;;
  next-22)
    # the first call of the session after 2026-12-04 (no GPU was lent that day), most needed first: every GPU
    # test written that day and never run (ControlNets, IP-Adapter and Redux on CUDA with graphs, the GGUF
    # kernel and loaders, the dispatcher's all-ops list), then one FLUX.1-dev + ControlNet step against
    # diffusers', Redux's image encoding beside diffusers' (carry .whl; issue 33's re-time is `READ=0 MODELS=flux1-dev,klein-4b PROMPTS=0 ... cold-start`)
    timeout 300 python3 -m pytest -q -m gpu tests/controlnet tests/ip_adapter/test_ip_adapter_gpu.py \
      tests/pipeline/test_redux_gpu.py tests/gguf tests/kernels/test_gguf_dequant_kernel.py \
      tests/kernels/test_dispatch.py -p no:cacheprovider --durations=8 2>&1 | tee "$OUT/gpu_tests_22.txt" | tail -30 || status=1
    timeout $(left 420) python3 scripts/bench_controlnet.py --json "$OUT/bench_controlnet.json" 2>&1 | tail -10 || status=1
    [ $(left 540) -gt 30 ] && { timeout $(left 540) python3 scripts/bench_redux.py --json "$OUT/bench_redux.json" 2>&1 | tail -6 || status=1; }
    ;;
  next-23a)
    # the first call of a session after 2026-12-05 (no GPU was lent on 2026-12-04 or -05), most needed first:
    # every GPU test written those days and never run (ControlNets, IP-Adapter, Redux, GGUF with its memory plans
    # and kernel, the dispatcher, step caching under split CUDA graphs), then the ControlNet step against
    # diffusers' and Redux's encoding beside diffusers' (carry .whl's top-level wheels)
    timeout 300 python3 -m pytest -q -m gpu tests/controlnet tests/ip_adapter/test_ip_adapter_gpu.py \
      tests/pipeline/test_redux_gpu.py tests/gguf tests/kernels/test_gguf_dequant_kernel.py \
      tests/kernels/test_dispatch.py tests/pipeline/test_step_cache.py -p no:cacheprovider --durations=8 2>&1 \
      | tee "$OUT/gpu_tests_23.txt" | tail -30 || status=1
    [ $(left 420) -gt 60 ] && { timeout $(left 420) python3 scripts/bench_controlnet.py --json "$OUT/bench_controlnet.json" 2>&1 | tail -10 || status=1; }
    [ $(left 560) -gt 30 ] && { timeout $(left 560) python3 scripts/bench_redux.py --json "$OUT/bench_redux.json" 2>&1 | tail -6 || status=1; }
    ;;
  next-23b)
    # the second call: issue 33's cold start re-timed (FLUX.1-dev bf16 and --fp8 against the diffusers script, in
    # fresh processes; no read-rate table, no prompts file), then issue 37's bench_cache.py on the same folder:
    # every row eagerly and under split CUDA graphs (carry .whl's top-level wheels)
    timeout 150 python3 scripts/bench_cold_start.py build /tmp/cold --models flux1-dev --out "$OUT/cold_start.jsonl" 2>&1 | grep '^{' || status=1
    timeout $(left 300) python3 scripts/bench_cold_start.py cold /tmp/cold --models flux1-dev --prompts 0 --out "$OUT/cold_start.jsonl" 2>&1 | tail -4 || status=1
    cat "$OUT/cold_start.jsonl"
    [ $(left 510) -gt 60 ] && { timeout $(left 510) python3 scripts/bench_cache.py /tmp/cold/flux1-dev --json "$OUT/bench_cache.json" 2>&1 | grep -v "^\\[" | tail -24 || status=1; }
    # what a fresh process's first call spends beyond the second's (cProfile's table into $OUT), with the time left
    [ $(left 580) -gt 40 ] && { timeout $(left 580) python3 scripts/bench_cold_start.py first-call /tmp/cold --models flux1-dev --profile "$OUT" --out "$OUT/cold_start.jsonl" 2>&1 | tail -4 || status=1; tail -1 "$OUT/cold_start.jsonl"; }
    ;;
  next-24a)
    # the session's first call: issue 33's cold start after the side-thread start-up work (Triton's key during the
    # load, the CUDA context during torch's import): FLUX.1-dev flux-gen bf16 and --fp8 against the diffusers
    # script, FP8 high with and without the default step cache, each eager and with --cuda-graphs on one image;
    # the first call's stages (cProfile); then issue 37's eager FP8 high rows interleaved, with the host's time to
    # issue a step (bench_cache.py --diagnose). Carry .whl's top-level wheels
    timeout 120 python3 -m pytest -q -m gpu tests/cli/test_early_cuda.py tests/kernels/test_warmup.py tests/weights/test_pinned_stream.py -p no:cacheprovider 2>&1 | tail -3 || status=1
    timeout 120 python3 -m pytest -q tests/cli/test_early_cuda.py tests/kernels/test_warmup.py -p no:cacheprovider 2>&1 | tail -2 || status=1
    cold_folder flux1-dev 150 || status=1
    # the transformer's read rates: the ring's limit, ours with back-to-back tensors sharing buffers and without
    timeout 120 python3 scripts/bench_cold_start.py read /tmp/cold --ring 16x32x16 --out "$OUT/cold_start.jsonl" 2>&1 | tail -14 || status=1
    timeout $(left 400) python3 scripts/bench_cold_start.py cold /tmp/cold --models flux1-dev --prompts 0 \
      --variant "--fp8 --quality high" --variant "--fp8 --quality high --cuda-graphs" \
      --variant "--fp8 --quality high --cache first-block" --variant "--fp8 --quality high --cache first-block --cuda-graphs" \
      --out "$OUT/cold_start.jsonl" 2>&1 | tail -4 || status=1
    cat "$OUT/cold_start.jsonl"
    [ $(left 450) -gt 30 ] && { timeout $(left 450) python3 scripts/bench_cold_start.py first-call /tmp/cold --models flux1-dev --profile "$OUT" --out "$OUT/cold_start.jsonl" 2>&1 | tail -4 || status=1; tail -1 "$OUT/cold_start.jsonl"; }
    [ $(left 480) -gt 60 ] && { timeout $(left 480) python3 scripts/bench_cache.py /tmp/cold/flux1-dev --diagnose 3 --json "$OUT/bench_cache_diagnose.json" 2>&1 | grep -v "^\\[" | tail -12 || status=1; }
    # klein-4B (its Qwen3-4B ours since 2026-12-04) against its diffusers script, with the time left
    if [ $(left 570) -gt 80 ]; then
      klein_cold "$(left 570)" || status=1
    fi
    ;;
  next-24b)
    # the session's second call: issue 36's FLUX.1-dev step with and without FP8 attention at 1024² and 2048² (fa3-fwd
    # from .whl/fp8attn), then issue 39's GGUF steps against diffusers' and their memory with the time left (carry
    # .whl's top-level wheels and .whl/fp8attn)
    install_fp8_attention || status=1
    timeout 240 python3 scripts/bench_fp8_attention.py --steps --models flux1-dev --sizes 1024,2048 --iters 10 \
      --json "$OUT/bench_fp8_attention_steps.json" 2>&1 | tail -16 || status=1
    timeout $(left 585) python3 scripts/bench_gguf.py --types '' --step-types Q8_0,Q5_K,Q4_K --iters 5 \
      --json "$OUT/bench_gguf_steps.json" 2>&1 | tail -60 || status=1
    ;;
  next-25a)
    # what the 2026-12-05 session left to measure, most needed first (carry .whl's top-level wheels and .whl/fp8attn):
    # issue 36's whole image (eval_high_image.py: high and FP8 high, FP8 attention or SDPA, FP8 with static input
    # scales, PSNR against lossless, the image's time) and FLUX.2-dev's FP8-attention step (static arms too); issue
    # 33's read-rate A/B (ring buffers shared by back-to-back tensors or not)
    install_fp8_attention || status=1
    cold_folder flux1-dev 150 || status=1
    timeout $(left 330) python3 scripts/eval_high_image.py /tmp/cold/flux1-dev --json "$OUT/eval_high_image.json" 2>&1 | grep -v "^\\[" | tail -10 || status=1
    timeout $(left 430) python3 scripts/bench_cold_start.py read /tmp/cold --ring 16x32x16 --out "$OUT/cold_start.jsonl" 2>&1 | tail -14 || status=1
    [ $(left 520) -gt 60 ] && { timeout $(left 520) python3 scripts/bench_fp8_attention.py --steps --models flux2-dev --sizes 1024 --iters 10 --json "$OUT/bench_fp8_attention_flux2.json" 2>&1 | tail -11 || status=1; }
    ;;
  next-25b)
    # issue 33 after session 25's start-up work (best after next-25a, on the same warm machine): its GPU tests
    # (verification record, text warm-up), then FLUX.1-dev's cold flux-gen against the diffusers
    # script as it is now (the second run takes the kernels the first verified), and with each piece switched off
    # (FLUX_VERIFY_CACHE=0, FLUX_TEXT_WARMUP=0), then the first call's stages; first,
    # issue 36's FLUX.1-dev step with static input scales (bench_fp8_attention.py's static arms: lossless, high +
    # FP8 attention, per-tensor weights). Carry .whl's top-level wheels and .whl/fp8attn
    install_fp8_attention || status=1
    timeout 150 python3 -m pytest -q -m gpu tests/kernels/test_verified.py tests/pipeline/test_text_warmup.py \
      tests/weights/test_pinned_stream.py -p no:cacheprovider 2>&1 | tail -4 || status=1
    timeout 150 python3 scripts/bench_fp8_attention.py --steps --models flux1-dev --sizes 1024 --iters 10 \
      --json "$OUT/bench_fp8_attention_static.json" 2>&1 | tail -12 || status=1
    # what `import torch` costs here, and whether its bytecode is cached (a read-only install recompiles every time)
    python3 -c "import os, sys, torch; d = os.path.dirname(torch.__file__); print('torch', torch.__version__, d, 'writable', os.access(d, os.W_OK), 'pycache', os.path.isdir(os.path.join(d, '__pycache__')), 'dont_write_bytecode', sys.flags.dont_write_bytecode)" || status=1
    for i in 1 2; do (TIMEFORMAT="import torch: %R s wall, %U s user, %S s sys"; time python3 -c "import torch") 2>&1 || status=1; done
    python3 -X importtime -c "import torch" 2>&1 | sort -t'|' -k2 -n | tail -12
    cold_folder flux1-dev 150 || status=1
    timeout $(left 470) python3 scripts/bench_cold_start.py cold /tmp/cold --models flux1-dev --prompts 0 \
      --variant "FLUX_VERIFY_CACHE=0" --variant "FLUX_TEXT_WARMUP=0" \
      --out "$OUT/cold_start.jsonl" 2>&1 | tail -4 || status=1
    cat "$OUT/cold_start.jsonl"
    [ $(left 570) -gt 30 ] && { timeout $(left 570) python3 scripts/bench_cold_start.py first-call /tmp/cold --models flux1-dev --profile "$OUT" --out "$OUT/cold_start.jsonl" 2>&1 | tail -4 || status=1; tail -1 "$OUT/cold_start.jsonl"; }
    ;;
  next-25c)
    # a third call (after next-25a/b on the same machine): issue 36's bf16 high on the models not measured yet
    # (FLUX.3 Klein base with its new FP8 attention, klein-4B: target at most 0.94x lossless), then issue 33 from
    # disk: the transformer's read rates with the page cache dropped before each row, against dd in the same run;
    # then klein-4B's cold flux-gen after session 25's start-up work. Carry .whl's top-level wheels and .whl/fp8attn
    install_fp8_attention || status=1
    timeout 150 python3 -m pytest -q -m gpu tests/models/test_fp8_attention.py -p no:cacheprovider 2>&1 | tail -3 || status=1
    timeout 150 python3 scripts/bench_flux3.py --models base --cases t2i --high --iters 10 --json "$OUT/bench_flux3_high.json" 2>&1 | grep -E "high|floor|equal" | tail -8 || status=1
    timeout $(left 330) python3 scripts/bench_fp8_attention.py --steps --models flux2-klein-4b --sizes 1024 --iters 10 --no-static --json "$OUT/bench_fp8_attention_klein.json" 2>&1 | tail -6 || status=1
    cold_folder flux1-dev 150 || status=1
    timeout $(left 480) python3 scripts/bench_cold_start.py read /tmp/cold --cold --ring 16x32x16 --out "$OUT/cold_start.jsonl" 2>&1 | tail -16 || status=1
    if [ $(left 570) -gt 90 ]; then
      klein_cold "$(left 570)" || status=1
    fi
    ;;
  next-26a)
    # issue 33's targets where they were set (H200), in a user's setting: Python keeps bytecode (the device's
    # environment says PYTHONDONTWRITEBYTECODE=1 and torch's install has no __pycache__, so there every process
    # compiles torch again: import torch 3.5 s against 1.9-2.3 s with the bytecode kept, run P on an H100)
    unset PYTHONDONTWRITEBYTECODE
    export PYTHONPYCACHEPREFIX=/tmp/pyc
    cold_folder flux1-dev 150 || status=1
    cold_folder klein-4b 100 || status=1
    (TIMEFORMAT="bytecode warm-up imports: %R s"; time python3 -c "import torch, diffusers, transformers, transformers.models.qwen3.modeling_qwen3; from diffusers import FluxPipeline, Flux2KleinPipeline; import flux_runtime.cli.gen, flux_runtime.pipeline") 2>&1 | tail -1
    for i in 1 2; do (TIMEFORMAT="import torch, bytecode kept: %R s"; time python3 -c "import torch") 2>&1; done
    # the PNG writer on this machine's cores against PIL (a 1024² noisy image, level 4, best of 7)
    python3 -c "
import io, time, numpy as np, torch  # torch, as in flux-gen: numpy's temporaries are served faster after it
from PIL import Image
from flux_runtime.pipeline.png_encode import encode_png
im = Image.fromarray(np.random.default_rng(0).integers(0, 256, (1024, 1024, 3), dtype=np.uint8))
def best(f):
    return min((lambda t: (f(), time.perf_counter() - t)[1])(time.perf_counter()) for _ in range(7))
print('PNG 1024² noisy, level 4: PIL %.4f s, banded %.4f s' % (best(lambda: im.save(io.BytesIO(), 'PNG', compress_level=4)), best(lambda: encode_png(im, [], 4))))
" || status=1
    timeout $(left 330) python3 scripts/bench_cold_start.py cold /tmp/cold --models flux1-dev,klein-4b --prompts 0 --repeat 2 \
      --out "$OUT/cold_start.jsonl" 2>&1 | tail -2 || status=1
    [ $(left 560) -gt 60 ] && { timeout $(left 560) python3 scripts/bench_cold_start.py read /tmp/cold --ring 16x32x16 --out "$OUT/cold_start.jsonl" 2>&1 | tail -24 || status=1; }
    cat "$OUT/cold_start.jsonl"
    ;;
  next-26b)
    # issue 36 where its targets were set (H200): the whole image (static arms calibrated eagerly now), FLUX.2-dev's
    # FP8-attention step (80 GB did not hold it), FLUX.3 Klein's and klein-4B's bf16 high (carry .whl's top-level
    # wheels and .whl/fp8attn)
    install_fp8_attention || status=1
    cold_folder flux1-dev 150 || status=1
    timeout $(left 330) python3 scripts/eval_high_image.py /tmp/cold/flux1-dev --json "$OUT/eval_high_image.json" 2>&1 | grep -v "^\\[" | tail -10 || status=1
    [ $(left 430) -gt 60 ] && { timeout $(left 430) python3 scripts/bench_fp8_attention.py --steps --models flux2-dev --sizes 1024 --iters 10 --no-static --json "$OUT/bench_fp8_attention_flux2.json" 2>&1 | tail -8 || status=1; }
    [ $(left 500) -gt 40 ] && { timeout $(left 500) python3 scripts/bench_flux3.py --models base --cases t2i --high --iters 10 --json "$OUT/bench_flux3_high.json" 2>&1 | grep -E "high|floor|equal" | tail -8 || status=1; }
    [ $(left 570) -gt 40 ] && { timeout $(left 570) python3 scripts/bench_fp8_attention.py --steps --models flux2-klein-4b --sizes 1024 --iters 10 --no-static --json "$OUT/bench_fp8_attention_klein.json" 2>&1 | tail -6 || status=1; }
    ;;
  cache-graphs)
    # issue 37: step-cached calls under split CUDA graphs (probe / reuse / rest). The GPU tests (the graphed cached
    # latents against the eager cached ones, bf16 / high / FP8), then bench_cache.py at full size (FLUX.1-dev
    # random weights, built here): every row eagerly and under graphs (carry .whl)
    timeout 120 python3 -m pytest -q -m gpu tests/pipeline/test_step_cache.py -p no:cacheprovider 2>&1 | tail -6 || status=1
    timeout 120 python3 -m pytest -q tests/pipeline/test_cached_graphs.py -p no:cacheprovider 2>&1 | tail -3 || status=1
    cold_folder flux1-dev 100 || status=1
    [ $(left 560) -gt 30 ] && { timeout $(left 560) python3 scripts/bench_cache.py /tmp/cold/flux1-dev --json "$OUT/bench_cache.json" 2>&1 | grep -v "^\\[" | tail -24 || status=1; }
    ;;
  fp8-attention|fp8-attention-step)
    # issue 36: FP8 attention for `high` on Hopper. fa3-fwd (and einops, which it imports) from .whl/fp8attn into
    # /tmp/site (already on PYTHONPATH); FlashInfer's FP8 prefill is compared where `flashinfer` imports.
    # fp8-attention: the GPU tests, then one attention call at FLUX shapes; fp8-attention-step: the FLUX.1-dev step
    # in high with and without FP8 attention (MODELS=flux1-dev,flux2-dev adds FLUX.2-dev, if the call has time)
    install_fp8_attention || status=1
    python3 -c "import fa3_fwd_interface, torch; print('fa3-fwd imports; torch', torch.__version__)" 2>&1 | tail -2 || status=1
    if [ "$phase" = fp8-attention ]; then
      timeout 240 python3 -m pytest -q -m gpu tests/kernels/test_heads_fp8.py tests/kernels/test_attention_quant.py \
        tests/models/test_fp8_attention.py -p no:cacheprovider 2>&1 | tail -8 || status=1
      timeout 240 python3 scripts/bench_fp8_attention.py --ops --json "$OUT/bench_fp8_attention_ops.json" 2>&1 | tail -60 || status=1
    else
      timeout 500 python3 scripts/bench_fp8_attention.py --steps --models "${MODELS:-flux1-dev}" --sizes "${SIZES:-1024,2048}" --iters 10 \
        --json "$OUT/bench_fp8_attention_steps.json" 2>&1 | tail -12 || status=1
    fi
    ;;
  *) echo "unknown phase $phase"; exit 2 ;;
esac
exit $status
