#!/usr/bin/env bash
# The GPU suite in one command (`make gpu-test`): every test marked `gpu` or `multigpu` (on one
# GPU tests/conftest.py deselects the two-GPU ones and says so), then a quick benchmark, then a
# summary.
#
#   scripts/gpu_test.sh [RESULTS_DIR]        # default ./gpu-results
#
# The suite is bound by compiles on the host (Triton's and Inductor's), not by the GPU: run one
# process at a time it took 416-487 s on an H200 (2026-11-26), so where pytest-xdist is
# importable the tests run in GPU_TEST_WORKERS processes sharing the GPU(s). The tests marked
# `solo` run afterwards in one process alone: the huge-tensor test (about 48 GB of one card)
# and those that watch a process's first compiles (tests/gpu/test_gpu_first_call.py says why).
#
# RESULTS_DIR receives junit-*.xml, pytest-*.log, bench.log, bench/ (the benchmark's CSV/plots)
# and summary.txt. The whole run is budgeted to fit one 10-minute device call:
#   GPU_TEST_WORKERS     pytest-xdist processes (default: min(8, CPUs / 2); 0 runs serially)
#   GPU_TEST_TIMEOUT     seconds for both pytest phases together (default 420; 900 serially)
#   GPU_TEST_BUDGET      seconds for everything; the benchmark gets what pytest left
#                        (default GPU_TEST_TIMEOUT + 120)
#   GPU_TEST_BENCH_ARGS  extra benchmark arguments (default trims --quick to two hidden sizes)
#   GPU_TEST_BENCH       0 skips the benchmark (default 1)
#   PYTHON               interpreter (default python3)
# Exit status: 0 when every selected test passed (or skipped) and the benchmark did not fail.
set -uo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${1:-./gpu-results}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
cd "$REPO"

PYTHON="${PYTHON:-python3}"
# The C++ fast path is built ahead (once per source and torch version; about a minute); where
# that fails, tests/gpu/test_gpu_fast_path.py fails and says why, the other tests run.
PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}" "$PYTHON" -m fused_norm.build \
  || echo "fused_norm: the C++ fast path did not build (its GPU tests will fail)"
BENCH_ARGS="${GPU_TEST_BENCH_ARGS:---Ns 4096,65536 --budget-s 45 --first-call drop_add_ln:4096}"
cpus=$(nproc 2>/dev/null || echo 2)
default_workers=$(( cpus / 2 < 8 ? cpus / 2 : 8 ))
WORKERS="${GPU_TEST_WORKERS:-$default_workers}"
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

parallel=()
if [ "$WORKERS" -gt 1 ] && "$PYTHON" -c "import xdist" 2>/dev/null; then
    # loadgroup: the files whose module-scoped fixture starts a two-process run stay on one worker.
    parallel=(-n "$WORKERS" --dist loadgroup)
fi
TEST_TIMEOUT="${GPU_TEST_TIMEOUT:-$([ ${#parallel[@]} -gt 0 ] && echo 420 || echo 900)}"
BUDGET="${GPU_TEST_BUDGET:-$(( TEST_TIMEOUT + 120 ))}"

rm -f "$OUT"/junit-*.xml "$OUT/summary.txt"
test_rc=0
run_phase() {  # name, seconds, pytest arguments...
    local name=$1 seconds=$2
    shift 2
    echo "== pytest $* (timeout ${seconds}s)"
    timeout --kill-after=20 "$seconds" "$PYTHON" -m pytest -q -rs -p no:cacheprovider \
        --durations=25 --junitxml="$OUT/junit-$name.xml" "$@" 2>&1 | tee "$OUT/pytest-$name.log"
    local rc=${PIPESTATUS[0]}
    # 5: nothing selected (e.g. no test marked solo) is not a failure of the suite.
    if [ "$rc" -ne 0 ] && [ "$rc" -ne 5 ] && [ "$test_rc" -eq 0 ]; then test_rc=$rc; fi
}
run_phase main "$TEST_TIMEOUT" -m "(gpu or multigpu) and not solo" \
    ${parallel[@]+"${parallel[@]}"} tests
left=$(( TEST_TIMEOUT - ($(date +%s) - start) ))
[ "$left" -lt 60 ] && left=60
run_phase solo "$left" -m "(gpu or multigpu) and solo" tests

bench_status="not run"
bench_rc=0
if [ "${GPU_TEST_BENCH:-1}" = "0" ]; then
    bench_status="skipped (GPU_TEST_BENCH=0)"
elif [ ! -f bench/bench.py ]; then
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
"$PYTHON" - "$OUT" "$test_rc" "$bench_status" "$elapsed" "${WORKERS}" "${#parallel[@]}" <<'EOF' | tee "$OUT/summary.txt"
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

out, test_rc, bench_status, elapsed = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
workers = sys.argv[5] if sys.argv[6] != "0" else "1 (pytest-xdist not used)"
print("=" * 72)
print("GPU suite summary:", (out / "environment.txt").read_text().strip())
print(f"pytest processes in the main phase: {workers}")
reports = sorted(out.glob("junit-*.xml"))
total = {k: 0 for k in ("tests", "failures", "errors", "skipped")}
seconds = 0.0
skips = {}
peaks = []
for junit in reports:
    root = ET.parse(junit).getroot()
    for suite in [root] if root.tag == "testsuite" else root.findall("testsuite"):
        for k in total:
            total[k] += int(suite.get(k, 0))
        seconds += float(suite.get("time", 0))
        for case in suite.iter("testcase"):
            name = f"{case.get('classname')}::{case.get('name')}"
            for tag, label in (("failure", "FAILED"), ("error", "ERROR")):
                el = case.find(tag)
                if el is not None:
                    msg = (el.get("message") or "").splitlines()
                    print(f"  {label} {name}: {msg[0][:160] if msg else ''}")
            el = case.find("skipped")
            if el is not None:
                reason = ((el.get("message") or "").splitlines() or [""])[0][:160]
                skips[reason] = skips.get(reason, 0) + 1
            for prop in case.iter("property"):  # tests/conftest.py's _cuda_memory
                if prop.get("name") == "cuda_peak_gib":
                    peaks.append((float(prop.get("value")), name))
if reports:
    passed = total["tests"] - total["failures"] - total["errors"] - total["skipped"]
    print(f"tests: {passed} passed, {total['failures']} failed, {total['errors']} errors, "
          f"{total['skipped']} skipped of {total['tests']} in {seconds:.0f}s "
          f"({', '.join(p.stem for p in reports)})")
    for reason, count in sorted(skips.items(), key=lambda kv: -kv[1]):
        print(f"  skipped x{count}: {reason}")
    if peaks:
        top = ", ".join(f"{gib:.1f} {name.split('::')[-1]}" for gib, name in sorted(peaks)[-5:][::-1])
        print(f"  largest peak CUDA allocations (GiB): {top}")
else:
    why = "timed out" if test_rc in (124, 137) else f"exit {test_rc}"
    print(f"tests: no junit report ({why}); see {out}/pytest-*.log")
# tests/conftest.py's line on tests deselected for want of GPUs (not in the junit reports)
for log in sorted(out.glob("pytest-*.log")):
    for line in log.read_text(errors="replace").splitlines():
        if line.startswith("fused_norm: ") and "deselected" in line:
            print(f"  {log.stem}: {line[len('fused_norm: '):]}")
print(f"pytest exit code: {test_rc}")
print(f"benchmark: {bench_status}")
print(f"wall time: {elapsed}s; results in {out}")
EOF

if [ "$test_rc" -ne 0 ]; then
    exit "$test_rc"
fi
exit "$bench_rc"
