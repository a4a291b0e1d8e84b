#!/usr/bin/env bash
# One device call on the GPU machine (see ../shared/gpu/README.md): everything lands under $OUT.
#   run with carry [".gpu"]:   bash scripts/gpu-run.sh           # = all: the engine's CUDA tests, then the bench (<= 9 min)
#                              bash scripts/gpu-run.sh tests     # the suite on CUDA (~3 min)
#                              bash scripts/gpu-run.sh bench     # mmserve bench --params gpu (~6 min)
#                              bash scripts/gpu-run.sh probe     # which decode-graph captures fail, and when (~1 min)
#                              bash scripts/gpu-run.sh smoke     # a 4-token llava-7b bench: the machinery only
#                              bash scripts/gpu-run.sh check     # after runner changes, <= 4 min: capture tests, probe,
#                                                                # the multi-turn and absolute (prefill per token count) scenarios
# Try it here first with OUT=/tmp/out DEVICE=cpu (the tests part runs on the CPU then).
set -uo pipefail
OUT=${OUT:?set OUT (the device tool sets it)}
what=${1:-all}
[ -f .gpu/env.sh ] && source .gpu/env.sh
PY=${PY:-python3}
DEVICE=${DEVICE:-cuda}
mkdir -p "$OUT"
{ nvidia-smi || true; $PY -c "import torch, transformers; print(torch.__version__, torch.version.cuda, transformers.__version__, torch.cuda.is_available() and torch.cuda.get_device_name())"; } > "$OUT/machine.txt" 2>&1
case "$what" in
  tests)
    MMSERVE_TEST_DEVICE=$DEVICE timeout 540 $PY -m pytest -m "not slow" tests -q -p no:cacheprovider \
      --maxfail=40 > "$OUT/pytest-$DEVICE.txt" 2>&1
    tail -30 "$OUT/pytest-$DEVICE.txt" ;;
  all)
    # the engine's CUDA paths first (kernels compiled, decode graphs captured and replayed, the runtime
    # through them), then the bench: a failure of the first still leaves the figures of the second
    MMSERVE_TEST_DEVICE=$DEVICE timeout 150 $PY -m pytest tests/test_runner_capture.py tests/test_triton_attention.py \
      tests/test_paged_attention.py tests/test_runtime.py -q -p no:cacheprovider > "$OUT/pytest-engine-$DEVICE.txt" 2>&1
    tail -15 "$OUT/pytest-engine-$DEVICE.txt"
    timeout 60 $PY scripts/gpu_capture_probe.py > "$OUT/capture-probe.txt" 2>&1; tail -14 "$OUT/capture-probe.txt"
    timeout 380 $PY -m mmserve.cli bench --params gpu --device "$DEVICE" --out "$OUT/bench" > "$OUT/bench.log" 2>&1
    tail -5 "$OUT/bench.log"; cat "$OUT/bench/report.md" 2>/dev/null | head -60 ;;
  bench)
    timeout 570 $PY -m mmserve.cli bench --params gpu --device "$DEVICE" --out "$OUT/bench" > "$OUT/bench.log" 2>&1
    tail -5 "$OUT/bench.log"; cat "$OUT/bench/report.md" 2>/dev/null | head -60 ;;
  probe)
    timeout 120 $PY scripts/gpu_capture_probe.py 2>&1 | tee "$OUT/capture-probe.txt" | tail -20 ;;
  smoke)
    timeout 300 $PY -m mmserve.cli bench --params test --preset llava-7b --device "$DEVICE" --dtype bfloat16 \
      --scenarios decode,concurrency --out "$OUT/smoke" > "$OUT/smoke.log" 2>&1
    tail -20 "$OUT/smoke.log" ;;
  check)
    MMSERVE_TEST_DEVICE=$DEVICE timeout 70 $PY -m pytest tests/test_runner_capture.py -q -p no:cacheprovider \
      > "$OUT/pytest-capture-$DEVICE.txt" 2>&1
    tail -12 "$OUT/pytest-capture-$DEVICE.txt"
    timeout 40 $PY scripts/gpu_capture_probe.py > "$OUT/capture-probe.txt" 2>&1; tail -24 "$OUT/capture-probe.txt"
    timeout 120 $PY -m mmserve.cli bench --params gpu --device "$DEVICE" --scenarios multiturn,absolute \
      --out "$OUT/bench" > "$OUT/bench.log" 2>&1
    tail -3 "$OUT/bench.log"; grep -E "^\| (3|10) " "$OUT/bench/report.md" 2>/dev/null || tail -c 1500 "$OUT/bench/partial.json" ;;
  *) echo "usage: scripts/gpu-run.sh [all|tests|bench|probe|smoke|check]" >&2; exit 2 ;;
esac
