#!/usr/bin/env bash
# The engine/trainer mismatch of bench/mismatch_gpu.yaml in bf16 and in float32, trainer and
# torch engine sharing the GPU (asyncrl run --devices auto): per step, the mean and largest
# |Δ log-prob| over the trained tokens, k3 and the share of ratios outside [0.5, 2].
set -euo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/mismatch-gpu}; mkdir -p "$out"
python3 - "$out" "${JOB:-bench/mismatch_gpu.yaml}" <<'PY'
import sys, yaml
out = sys.argv[1]
job = yaml.safe_load(open(sys.argv[2]))
open(f"{out}/bf16.yaml", "w").write(yaml.safe_dump(job))
job["spec"]["model"]["dtype"] = "float32"
job["spec"]["trainer"]["computeDtype"] = "float32"
open(f"{out}/fp32.yaml", "w").write(yaml.safe_dump(job))
PY
for precision in bf16 fp32; do
  rm -rf "$out/run-$precision"
  asyncrl run "$out/$precision.yaml" --run-dir "$out/run-$precision" > "$out/$precision.log" 2>&1 \
    || { echo "$precision run failed:"; tail -20 "$out/$precision.log"; continue; }
  python3 - "$out/run-$precision/metrics.jsonl" "$precision" <<'PY'
import json, sys
records = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
for r in records:
    if r.get("kind", "train") != "train":
        continue
    print(f"{sys.argv[2]} step {r['step']}: tokens {r['mismatch_tokens']}, |Δ| mean "
          f"{r['mismatch_abs_mean']:.2e} max {r['mismatch_abs_max']:.2e}, k3 {r['mismatch_k3']:.2e}, "
          f"outside [0.5, 2] {r['mismatch_outside_fraction']:.2e}; entropy {r['entropy']:.2f}; "
          f"clip per minibatch {[round(c, 4) for c in r['clip_fraction_per_minibatch']]}; "
          f"IcePop masked {r['correction_masked_fraction']:.2e}; step {r['step_seconds']:.2f} s")
PY
done
