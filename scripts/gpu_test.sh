#!/usr/bin/env bash
# The GPU suite in one command (`make gpu-test`): every test marked `gpu` (the `multigpu` ones
# skip with a reason on one GPU), then a quick benchmark, then a summary.
#
#   scripts/gpu_test.sh [RESULTS_DIR]        # default ./gpu-results
#
# RESULTS_DIR receives junit.xml, pytest.log, bench.log, bench/ (the benchmark's CSV/plots) and
# summary.txt. The whole run is budgeted to fit one 8-minute device call on one H100:
#   GPU_TEST_TIMEOUT     seconds for pytest (default 330)
#   GPU_TEST_BUDGET      seconds for everything; the benchmark gets what pytest left (default 450)
#   GPU_TEST_BENCH_ARGS  extra benchmark arguments (default trims --quick to two hidden sizes)
#   PYTHON               interpreter (default python3)
# Exit status: 0 when every selected test passed (or skipped) and the benchmark did not fail.
set -uo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${1:-./gpu-results}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
cd "$REPO"

PYTHON="${PYTHON:-python3}"
TEST_TIMEOUT="${GPU_TEST_TIMEOUT:-330}"
BUDGET="${GPU_TEST_BUDGET:-450}"
BENCH_ARGS="${GPU_TEST_BENCH_ARGS:---Ns 4096,65536 --budget-s 45 --first-call drop_add_ln:4096}"
# NVLink multicast is unavailable on the GPU machines; NCCL and torch must not try it.
export NCCL_NVLS_ENABLE="${NCCL_NVLS_ENABLE:-0}"
export TORCH_SYMM_MEM_DISABLE_MULTICAST="${TORCH_SYMM_MEM_DISABLE_MULTICAST:-1}"

start=$(date +%s)
"$PYTHON" - <<'EOF' | tee "$OUT/environment.txt"
import torch, triton
n = torch.cuda.device_count() if torch.cuda.is_available() else 0
gpus = ", ".join(torch.cuda.get_device_name(i) for i in range(n)) or "none"
print(f"torch {torch.__version__}, triton {triton.__version__}, {n} GPU(s): {gpus}")
EOF

rm -f "$OUT/junit.xml" "$OUT/summary.txt"
echo "== pytest -m gpu (timeout ${TEST_TIMEOUT}s)"
timeout --kill-after=20 "$TEST_TIMEOUT" "$PYTHON" -m pytest -m gpu -q -rs tests \
    --junitxml="$OUT/junit.xml" 2>&1 | tee "$OUT/pytest.log"
test_rc=${PIPESTATUS[0]}

bench_status="not run"
bench_rc=0
if [ ! -f bench/bench.py ]; then
    bench_status="skipped (bench/bench.py not found)"
elif ! "$PYTHON" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    bench_status="skipped (no CUDA device)"
else
    left=$(( BUDGET - ($(date +%s) - start) ))
    [ "$left" -lt 60 ] && left=60
    echo "== bench/bench.py --quick $BENCH_ARGS (timeout ${left}s)"
    # shellcheck disable=SC2086  # BENCH_ARGS is a list of words
    timeout --kill-after=10 "$left" "$PYTHON" -u bench/bench.py --quick --out "$OUT/bench" \
        $BENCH_ARGS 2>&1 | tee "$OUT/bench.log"
    bench_rc=${PIPESTATUS[0]}
    case "$bench_rc" in
        0) bench_status="ok ($OUT/bench)" ;;
        124|137) bench_status="stopped at the ${left}s budget (partial output in $OUT/bench.log)"
                 bench_rc=0 ;;
        *) bench_status="FAILED (exit $bench_rc, see $OUT/bench.log)" ;;
    esac
fi

elapsed=$(( $(date +%s) - start ))
"$PYTHON" - "$OUT" "$test_rc" "$bench_status" "$elapsed" <<'EOF' | tee "$OUT/summary.txt"
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

out, test_rc, bench_status, elapsed = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
print("=" * 72)
print("GPU suite summary:", (out / "environment.txt").read_text().strip())
junit = out / "junit.xml"
if junit.exists():
    root = ET.parse(junit).getroot()
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    n = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    passed = n["tests"] - n["failures"] - n["errors"] - n["skipped"]
    print(f"tests: {passed} passed, {n['failures']} failed, {n['errors']} errors, "
          f"{n['skipped']} skipped of {n['tests']} in {float(suite.get('time', 0)):.0f}s")
    skips = {}
    for case in suite.iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        for tag, label in (("failure", "FAILED"), ("error", "ERROR")):
            el = case.find(tag)
            if el is not None:
                msg = (el.get("message") or "").splitlines()
                print(f"  {label} {name}: {msg[0][:160] if msg else ''}")
        el = case.find("skipped")
        if el is not None:
            reason = (el.get("message") or "").splitlines()[:1] or [""]
            skips[reason[0][:160]] = skips.get(reason[0][:160], 0) + 1
    for reason, count in sorted(skips.items(), key=lambda kv: -kv[1]):
        print(f"  skipped x{count}: {reason}")
else:
    why = "timed out" if test_rc in (124, 137) else f"exit {test_rc}"
    print(f"tests: no junit report ({why}); see {out / 'pytest.log'}")
print(f"pytest exit code: {test_rc}")
print(f"benchmark: {bench_status}")
print(f"wall time: {elapsed}s; results in {out}")
EOF

if [ "$test_rc" -ne 0 ]; then
    exit "$test_rc"
fi
exit "$bench_rc"
