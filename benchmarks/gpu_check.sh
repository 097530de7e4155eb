#!/usr/bin/env bash
# The GPU check, one command: a GPU build of llama.cpp beside the CPU build, the gpu
# test set on it, and the device bench (the CPU build against the GPU build, the same
# model, lengths and threads), written to a page under docs/performance/.
#
#   bash benchmarks/gpu_check.sh        # (or make gpu-check) on a CUDA machine: nvcc, one GPU
#   GPU=vulkan GPU_CHECK_SIZES=1024,2048 bash benchmarks/gpu_check.sh   # Vulkan (lavapipe too)
#
# Settings (environment):
#   GPU                cuda (default) or vulkan
#   GPU_CHECK_SIZES    prompt lengths in tokens (default 2048,8192)
#   GPU_CHECK_REPEATS  verified restores per length and build (default 3)
#   GPU_CHECK_COLD_REPEATS  cold prefills per length and build (default 2)
#   GPU_CHECK_THREADS  CPU threads for both builds (default: every core)
#   GPU_CHECK_GEOMETRY instead of the default model, a synthetic one of this geometry
#                      (llama-3.1-8b, ...: localkv.bench.geometry; a slow device's choice)
#   GPU_CHECK_PAGE     the page (default docs/performance/device-$GPU.md; JSON beside it)
#   PYTEST_ARGS        passed to the gpu set (make gpu), e.g. "-x -q"
#
# On CUDA the build is for this machine's GPU only (CMAKE_CUDA_ARCHITECTURES=native) and
# uses every core (CMAKE_BUILD_PARALLEL_LEVEL): made to finish within 10 minutes on 16
# cores and one GPU. Each stage's time is printed and goes on the page. A failing gpu
# set does not stop the bench; the exit status is the first failure's.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2

GPU=${GPU:-cuda}
SIZES=${GPU_CHECK_SIZES:-2048,8192}
REPEATS=${GPU_CHECK_REPEATS:-3}
COLD_REPEATS=${GPU_CHECK_COLD_REPEATS:-2}
THREADS=${GPU_CHECK_THREADS:-$(nproc)}
PAGE=${GPU_CHECK_PAGE:-docs/performance/device-$GPU.md}
export CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}
LOG=build/gpu/check-$GPU.log
started=$SECONDS
status=0

stage() { echo ">> [$((SECONDS - started)) s] $*"; }
fail() { echo ">> $*" >&2; exit 2; }

build_args=(GPU="$GPU")
case $GPU in
cuda)
    if ! command -v nvcc >/dev/null && [ -x /usr/local/cuda/bin/nvcc ]; then
        export PATH=/usr/local/cuda/bin:$PATH
    fi
    command -v nvcc >/dev/null || fail "GPU=cuda needs nvcc (the CUDA toolkit) on PATH"
    command -v nvidia-smi >/dev/null || fail "GPU=cuda needs nvidia-smi (the NVIDIA driver)"
    card=$(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | head -1)
    stage "card: $card; $(nvcc --version | tail -1)"
    build_args+=(GPU_CMAKE_cuda="-DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=native")
    ;;
vulkan)
    export GGML_VK_VISIBLE_DEVICES=${GGML_VK_VISIBLE_DEVICES:-0}
    card=$(vulkaninfo --summary 2>/dev/null | sed -n 's/^[[:space:]]*deviceName[[:space:]]*=[[:space:]]*//p' | head -1)
    stage "Vulkan device: ${card:-unknown (no vulkaninfo)}"
    ;;
*) fail "GPU=$GPU: say GPU=cuda or GPU=vulkan" ;;
esac
mkdir -p build/gpu

stage "the CPU build and the GPU build ($GPU, $CMAKE_BUILD_PARALLEL_LEVEL jobs)"
t=$SECONDS
make .venv/.dev .venv/.bytecode || fail "the CPU build (make .venv/.dev) failed"
make gpu-build "${build_args[@]}" || fail "make gpu-build GPU=$GPU failed"
build_s=$((SECONDS - t))

stage "the gpu set (make gpu GPU=$GPU ${PYTEST_ARGS:-})"
t=$SECONDS
make gpu "${build_args[@]}" PYTEST_ARGS="${PYTEST_ARGS:-}" 2>&1 | tee "$LOG"
tests_rc=${PIPESTATUS[0]}
tests_s=$((SECONDS - t))
summary=$(grep -E '[0-9]+ (passed|failed|error)' "$LOG" | tail -1 | tr -d '=' | sed 's/^ *//;s/ *$//')
[ "$tests_rc" = 0 ] || status=1

# the lavapipe make gpu ran the set on (packaging/lavapipe.sh, Debian 12), for the bench too
if [ "$GPU" = vulkan ] && [ -e build/gpu/lavapipe/env ]; then
    export $(cat build/gpu/lavapipe/env)
    stage "lavapipe: $(vulkaninfo --summary 2>/dev/null | sed -n 's/^[[:space:]]*driverInfo[[:space:]]*=[[:space:]]*//p' | head -1)"
fi
stage "the device bench at $SIZES tokens"
t=$SECONDS
command="GPU=$GPU GPU_CHECK_SIZES=$SIZES GPU_CHECK_REPEATS=$REPEATS"
command+=" GPU_CHECK_COLD_REPEATS=$COLD_REPEATS GPU_CHECK_THREADS=$THREADS"
[ -n "${GPU_CHECK_PAGE:-}" ] && command+=" GPU_CHECK_PAGE=$PAGE"
model_args=()
if [ -n "${GPU_CHECK_GEOMETRY:-}" ]; then
    command+=" GPU_CHECK_GEOMETRY=$GPU_CHECK_GEOMETRY"
    model_args=(--geometry "$GPU_CHECK_GEOMETRY")
fi
[ -n "${PYTEST_ARGS:-}" ] && command+=" PYTEST_ARGS='$PYTEST_ARGS'"
command+=" bash benchmarks/gpu_check.sh"
.venv/bin/python -m localkv.bench.device \
    --gpu-lib "build/gpu/$GPU/lib" --sizes "$SIZES" --repeats "$REPEATS" \
    --cold-repeats "$COLD_REPEATS" --threads "$THREADS" "${model_args[@]}" \
    --write-docs "$PAGE" --command "$command" \
    --note "the gpu set on this build (make gpu GPU=$GPU${PYTEST_ARGS:+ PYTEST_ARGS='$PYTEST_ARGS'}): ${summary:-no summary} (exit status $tests_rc)" \
    --note "card: ${card:-unknown}" \
    --note "the check's stages before the bench: builds ${build_s} s, gpu set ${tests_s} s"
bench_rc=$?
[ "$status" = 0 ] && [ "$bench_rc" != 0 ] && status=$bench_rc
stage "done: builds ${build_s} s, gpu set ${tests_s} s, bench $((SECONDS - t)) s; page $PAGE (exit status $status)"
exit $status
