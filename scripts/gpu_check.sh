#!/usr/bin/env bash
# The one prepared accelerator check: on a machine with one NVIDIA GPU whose image has
# JAX with CUDA, nvcc, nanobind and scikit-build-core but no network, build ftjax
# against the JAX found there, run the `gpu`-marked tests, run the GPU benchmark, and
# print one table. Target: under 8 minutes.
#
#   scripts/gpu_check.sh            # on the GPU machine
#   scripts/gpu_check.sh --dry-run  # anywhere: the same steps on the CPU backend
#                                   # (no build, FTJAX_GPU_DRY_RUN=1, a short benchmark)
#
# Packages the image lacks (flax, safetensors, tokenizers, ...) install from wheels
# carried in $WHEELS (default: ./wheels) with --no-index; JAX itself is never installed
# here (its CUDA plugin is the image's). Results: $OUT (default /tmp/ftjax-gpu-check).
set -euo pipefail
cd "$(dirname "$0")/.."
DRY=0
[[ "${1:-}" == "--dry-run" ]] && DRY=1
OUT=${OUT:-/tmp/ftjax-gpu-check}
WHEELS=${WHEELS:-wheels}
mkdir -p "$OUT"
start=$(date +%s)

if [[ $DRY == 1 ]]; then
  export JAX_PLATFORMS=cpu FTJAX_GPU_DRY_RUN=1
  echo "dry run: CPU backend"
else
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/card.txt"
  python -c "import jax; print('jax', jax.__version__, jax.devices())" | tee "$OUT/jax.txt"
  if [[ -d "$WHEELS" ]]; then
    pip install --no-index --find-links "$WHEELS" flax safetensors tokenizers jinja2 orbax-checkpoint \
      fastapi uvicorn pydantic gguf pytest ml_dtypes >"$OUT/pip-deps.log" 2>&1 || true
  fi
  # against the installed jaxlib's FFI headers; the CPU handlers build as on any machine,
  # the start / finish pair's CUDA handlers wherever CMake finds the CUDA toolkit
  pip install --no-deps --no-build-isolation -e . >"$OUT/build.log" 2>&1 \
    || { echo "build failed: $OUT/build.log"; tail -30 "$OUT/build.log"; exit 1; }
fi
python -c "import ftjax.host as h; print('CUDA handlers of the start / finish pair built:', h.CUDA_PAIR)" \
  | tee "$OUT/cuda-handlers.txt"

python -m pytest -q -m gpu tests/test_gpu.py -p no:cacheprovider --junitxml "$OUT/gpu-tests.xml" \
  | tee "$OUT/gpu-tests.txt" || true
# a check, not a results run: the tree copied to the GPU machine is often not a git checkout,
# so its lines are recorded with --allow-dirty (they keep "dirty": true; docs/results takes
# GPU lines only from the runners started in a clean checkout without the flag)
if [[ $DRY == 1 ]]; then
  python scripts/gpu_bench.py --allow-dirty --tokens 16 --prompt 64 | tee "$OUT/bench.jsonl"
  python scripts/bench_qsweep.py --allow-dirty --misses 8 --repeats 3 | tee -a "$OUT/bench.jsonl"
  python scripts/bench_host_overlap.py --allow-dirty --repeats 5 | tee -a "$OUT/bench.jsonl"
  # several devices: forced host devices stand in for GPUs
  python scripts/bench_mesh.py --allow-dirty --devices 1 2 --repeats 1 --new-tokens 8 | tee -a "$OUT/bench.jsonl"
else
  python scripts/gpu_bench.py --allow-dirty | tee "$OUT/bench.jsonl"
  python scripts/bench_qsweep.py --allow-dirty --misses 8 16 --repeats 9 | tee -a "$OUT/bench.jsonl"
  # the start / finish pair on the GPU: step time against host alone and device alone
  python scripts/bench_host_overlap.py --allow-dirty --repeats 20 | tee -a "$OUT/bench.jsonl" || true
  # several GPUs: expert parallelism on the real devices, and its parity with one device
  gpus=$(nvidia-smi -L | wc -l)
  if (( gpus >= 2 )); then
    counts="1 2"; (( gpus >= 4 )) && counts="1 2 4"
    python scripts/bench_mesh.py --allow-dirty --real-devices --devices $counts | tee -a "$OUT/bench.jsonl" || true
    (cd tests && python mesh_check.py "$OUT/mesh.jsonl" --families qwen3_moe,deepseek_v3,qwen3_next \
      --policies device,lru --devices "$(echo ${counts#1 } | tr " " ",")" | tail -3) || true
  fi
fi

python - "$OUT" "$start" <<'PY'
import json, sys, time, xml.etree.ElementTree as ET
out, start = sys.argv[1], int(sys.argv[2])
root = ET.parse(f"{out}/gpu-tests.xml").getroot()
suite = root if root.tag == "testsuite" else root.find("testsuite")
rows = [("gpu tests", f"{suite.get('tests')} run, {suite.get('failures')} failed, {suite.get('errors')} errors, "
                      f"{suite.get('skipped')} skipped")]
for line in open(f"{out}/bench.jsonl"):
    r = json.loads(line)
    if r["bench"] == "gpu_decode":
        rows += [("backend", r["backend"]),
                 ("decode tok/s (cache = 25% of experts)", f"{r['tok_s']:.1f} (roofline {r['roofline_tok_s']:.1f}, "
                                                           f"miss rate {r['miss_rate']:.2f})"),
                 ("B_P / B_H profile GB/s", f"{r['B_P_gbps']:.2f} / {r['B_H_gbps']:.2f}"),
                 ("placement", json.dumps(r["placement"]))]
    elif r["bench"] == "q_sweep":
        c, q = r["calibrated"], r["q_star"]
        dev, hst = r["device_path_ms"][q], r["host_path_ms"][q]
        rows += [(f"q sweep m={r['m']}: best q / q* / calibrated q",
                  f"{r['best_q']} / {q} ({r['q_star_slowdown']:.2f}x) / {c['q']} "
                  f"({c['slowdown']:.2f}x, within 10%: {r['within_10pct']})"),
                 (f"layer at q*={q} ms: layer / max(device, host) / sum",
                  f"{r['measured_ms'][q]:.3f} / {max(dev, hst):.3f} / {dev + hst:.3f}")]
    elif r["bench"] == "host_overlap":
        rows.append(("host/device pair ms: host / device / pair / serial (pair / max)",
                     f"{r['host_ms']:.2f} / {r['device_ms']:.2f} / {r['pair_ms']:.2f} / {r['serial_ms']:.2f} "
                     f"({r['pair_over_max']:.2f})"))
    elif r["bench"] == "mesh":
        for run in r["runs"]:
            rates = " ".join(f"{d['hit_rate']:.2f}" for d in run["per_device"])
            rows.append((f"mesh {run['devices']} device(s): decode step ms, hit rate per device",
                         f"{run['decode_step_ms']:.2f}, {rates} (same tokens: {r['same_tokens']})"))
    elif r["bench"] == "gpu_prefill" and r.get("available", True):
        rows.append(("prefill s: pipelined / transfer / compute / max / sum",
                     f"{r['t_prefill_s']:.3f} / {r['t_transfer_s']:.3f} / {r['t_compute_s']:.3f} / "
                     f"{r['max_s']:.3f} / {r['sum_s']:.3f}"))
rows.append(("wall s", str(int(time.time()) - start)))
w = max(len(k) for k, _ in rows)
for k, v in rows:
    print(f"{k:<{w}}  {v}")
PY
