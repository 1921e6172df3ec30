#!/usr/bin/env bash
# One device call: the steps named on the command line, each under its own time limit, their
# output under $OUT (the device tool's folder), a summary line per step at the end.
#   bash scripts/device_run.sh smoke host bench ...
set -u
DEST=${OUT:-/tmp/device_out}  # the device tool brings back at most 8 files: one archive
OUT=/tmp/device_work
mkdir -p "$OUT" "$DEST"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
python3 -c "import torch, triton; print(torch.cuda.get_device_name(), torch.__version__, triton.__version__, torch.cuda.device_count())" | tee "$OUT/env.txt"
# Steps that time eager calls need the C++ fast path, which a fresh machine has not built: build
# it first (a minute) unless the call builds it itself (fpbuild, gputest) or runs without it.
for s in "$@"; do
  case $s in
    host|floor|bench|benchf|gpt|gptc|gptrep|profs|profl|prof|hf|hfc|hfex)
      python3 -m fused_norm.build > "$OUT/fpbuild-auto.log" 2>&1 \
        || echo "fused_norm: the C++ fast path did not build (see fpbuild-auto.log)"
      break ;;
  esac
done
summary=()
step() {  # name, seconds, command...
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  summary+=("$name rc=$rc $((SECONDS - t0))s")
  tail -n 25 "$OUT/$name.log"
}
for s in "$@"; do
  case $s in
    fpbuild) step fpbuild 240 python3 -m fused_norm.build ;;
    fptest) step fptest 300 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_gpu_fast_path.py ;;
    # the same steps with the C++ fast path off (FUSED_NORM_FAST_PATH=0): the Python path
    hostpy) FUSED_NORM_FAST_PATH=0 step hostpy 200 python3 bench/host_cost.py --out "$OUT/hostpy" ;;
    floorpy) FUSED_NORM_FAST_PATH=0 step floorpy 150 python3 -u bench/host_floor.py --out "$OUT/floorpy" ;;
    gptpy) FUSED_NORM_FAST_PATH=0 step gptpy 420 python3 examples/bench_gpt.py "$OUT/gptpy.md" ;;
    smoke) step smoke 240 python3 scripts/gpu_smoke.py ;;
    smokeq) step smoke 150 python3 scripts/gpu_smoke.py --quick ;;
    compile) step compile 170 python3 -m pytest -q -p no:cacheprovider -n 8 -m gpu --junitxml="$OUT/junit-compile.xml" \
               tests/gpu/test_gpu_compile.py tests/test_traced.py tests/test_hf.py::test_gpu_compile \
               tests/test_train_gpt.py::test_compile_smoke_cuda ;;
    floor) step floor 150 python3 -u bench/host_floor.py --out "$OUT/floor" ;;
    host) step host 200 python3 bench/host_cost.py --out "$OUT/host" ;;
    bench) step bench 420 python3 -u bench/bench.py --quick --out "$OUT/bench" ;;
    benchf) step bench 220 python3 -u bench/bench.py --quick --providers fused_norm --small-M "" --out "$OUT/bench" ;;
    tune) step tune 300 python3 -u bench/tune.py --out "$OUT/sm90.py" ;;
    tunex) step tunex 330 python3 -u bench/tune.py --explore --out "$OUT/sm90x.py" ;;
    gputest) step gputest 560 bash scripts/gpu_test.sh "$OUT/gputest" ;;
    # the tests that need two GPUs (kind nvidia-h200-x2): distributed, placement, DDP, fast path
    mgpu) step mgpu 420 env NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 \
            python3 -m pytest -q -rs -p no:cacheprovider -m multigpu --junitxml="$OUT/junit-mgpu.xml" tests ;;
    gpt) step gpt 590 python3 examples/bench_gpt.py "$OUT/gpt.md" --compile blocks ;;
    gptc) step gptc 560 python3 examples/bench_gpt.py "$OUT/gptc.md" --compile-only ;;
    profs) step profs 300 python3 -u bench/profile_gpt.py --out "$OUT/profs" --preset small \
             --variants torch:compile,fused:compile,torch:whole,fused:whole --rounds 7 ;;
    profl) step profl 300 python3 -u bench/profile_gpt.py --out "$OUT/profl" --preset llm \
             --variants torch:compile,fused:compile,torch:whole,fused:whole --rounds 7 ;;
    hfc) step hfc 300 python3 bench/bench_hf.py --modes compile --out "$OUT/hfc" ;;
    gptrep) step gptrep 420 python3 examples/bench_gpt.py "$OUT/gptrep.md" --presets medium --compile-only --repeats 5 ;;
    prof) step prof 300 python3 -u bench/profile_gpt.py --out "$OUT/prof" ;;
    hfex) step hfex 300 python3 examples/hf_llama.py --preset 1b --steps 300 --out "$OUT/hf_llama.json" ;;
    hf) step hf 420 python3 bench/bench_hf.py --out "$OUT/hf" ;;
    *) echo "unknown step $s" ;;
  esac
done
printf '%s\n' "${summary[@]}" | tee "$OUT/summary.txt"
cp "$OUT/summary.txt" "$DEST/"
tar czf "$DEST/results.tgz" -C "$OUT" .
