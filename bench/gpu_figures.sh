#!/bin/bash
# The GPU figures of docs/performance.md in one run, from the project's root on a machine with
# a CUDA GPU and the project installed (on a lent machine without a registry, after
# `. .device/setup.sh`). Each bench has its own time limit inside LIMIT seconds (default 540);
# logs go to $OUT (default /tmp/gpu-figures). SECTIONS picks a subset of "checks engine trainer
# async" (checks: bench/gpu_checks.py, the GPU kernels against their references),
# or "lora" (not in the default set: LoRA's trainer step for 0.5B and 7B against full
# fine-tuning, then a Qwen2.5-7B LoRA job through `asyncrl run` on this one GPU; give it a run
# of its own: SECTIONS=lora LIMIT=580).
set -u
OUT=${OUT:-/tmp/gpu-figures}; mkdir -p "$OUT"
LIMIT=${LIMIT:-540}; SECTIONS=${SECTIONS:-checks engine trainer async}
T0=$(date +%s)
stamp() { echo "[$(( $(date +%s) - T0 ))s] $*"; }
# budget N: N seconds, or what is left of LIMIT
budget() { local left=$(( LIMIT - ($(date +%s) - T0) )); [ "$left" -lt "$1" ] && echo "$left" || echo "$1"; }
want() { [[ " $SECTIONS " == *" $1 "* ]]; }
python3 -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name(0))"
if want checks; then
  stamp checks
  timeout "$(budget 90)" python3 bench/gpu_checks.py > "$OUT/checks.log" 2>&1; echo "rc=$?"
  tail -12 "$OUT/checks.log"
fi
if want engine; then
  stamp engine
  timeout "$(budget 180)" python3 bench/rollout_engine.py --device cuda --shape qwen2.5-0.5b \
    --requests 64 --responses-per-prompt 8 --profile > "$OUT/engine.log" 2>&1; echo "rc=$?"
  grep -v "^RESULT" "$OUT/engine.log" | tail -36
fi
if want trainer; then
  stamp trainer
  timeout "$(budget 150)" python3 bench/trainer_step.py --device cuda --shape qwen2.5-0.5b \
    --sequences 64 --group-size 8 --prompt 256 --response 512 --bf16 --profile > "$OUT/trainer.log" 2>&1
  echo "rc=$?"; tail -40 "$OUT/trainer.log"
fi
if want async; then
  stamp "async vs sync"
  timeout "$(budget 300)" python3 bench/async_vs_sync.py --device cuda --steps 12 \
    > "$OUT/async.log" 2>&1; echo "rc=$?"; tail -8 "$OUT/async.log"
fi
if want lora; then
  for shape in qwen2.5-0.5b qwen2.5-7b; do
    stamp "lora trainer $shape"
    timeout "$(budget 120)" python3 bench/trainer_step.py --device cuda --shape "$shape" \
      --sequences 64 --group-size 8 --prompt 256 --response 512 --bf16 --lora 16 \
      > "$OUT/lora-trainer-$shape.log" 2>&1; echo "rc=$?"; grep RESULT "$OUT/lora-trainer-$shape.log"
  done
  stamp "lora job qwen2.5-7b"
  nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -l 2 > "$OUT/gpu-memory.log" &
  sampler=$!
  timeout "$(budget 400)" python3 bench/lora_job.py --shape qwen2.5-7b --steps 4 \
    --out "$OUT/lora-job" > "$OUT/lora-job.log" 2>&1; echo "rc=$?"
  kill "$sampler" 2>/dev/null
  grep RESULT "$OUT/lora-job.log"; tail -5 "$OUT/lora-job/run/logs/trainer.log" 2>/dev/null
  echo "peak GPU memory used during the job: $(sort -n "$OUT/gpu-memory.log" | tail -1) MiB"
fi
stamp done
