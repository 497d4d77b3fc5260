#!/usr/bin/env bash
# The GPU checks, as one prepared run on a lent GPU machine (no network, minutes of time):
#
#     bash scripts/device_kit.sh --cuda        # here, once: packs .devkit/ (see that script)
#     device run, carry [".devkit/wheels", ".devkit/cuda"], timeout 600:  bash scripts/device_check.sh
#
# Phases, each under its own time limit, each writing its log under $OUT (or /tmp/kafila-device):
#   1. install the kit's wheels into /tmp/site, and llama-cpp-python: the kit's CUDA build, or
#      else (.devkit/source carried instead) a build of the slimmed source there (all cores);
#   2. refuse to go on unless llama.cpp offloads to the GPU;
#   3. the split-correctness tests: every split's greedy tokens equal the unsplit model's, now
#      with the blocks on the GPU (hidden states are read out of device memory by the graph
#      callback);
#   3b. scripts/backend_agreement.py: a 2-stage ring with one CPU stage and one GPU stage (both
#      orders) against the unsplit model on the CPU, by kafila.runtime.engine.agreement's tolerance
#      (relative error at the cut and of the logits, teacher-forced top tokens, where free-running
#      greedy parts): gemma-3-270m where a GGUF travelled in .devkit/models/, and always a tiny
#      llama written on the spot; then the same ring with one norm weight scaled, which must fail;
#   3c. scripts/gpu_stage_check.py admission: the planner's figure for one stage at a session of
#      4096 x 4, a device offered exactly that admitted and one byte less refused, then the model
#      loaded with every layer on the GPU: llama.cpp's buffers and nvidia-smi's figure beside it;
#   3d. scripts/gpu_stage_check.py rate: greedy tokens/s of a 2-stage split against the model alone;
#   4. scripts/bench_concurrency.py: 4 users against 1 on a 2-stage ring, the target's regime.
# The whole run keeps to DEADLINE (470 s, KAFILA_DEVICE_DEADLINE): each phase's limit is cut to
# what is left of it (a build from source, when no CUDA build travelled, is not: it alone may take
# longer, so carry .devkit/cuda).
# KAFILA_DEVICE_SKIP="3 4" leaves out those phases (of 3, 3b, 3c, 3d, 4): to try the others here.
# KAFILA_DEVICE_BENCH_ARGS replaces the benchmark's arguments. The default is
# --rounds 3 --no-pinned --tokens 128: on a GPU a step takes milliseconds, so longer answers keep
# each request's fixed costs from weighing on one user more than on four.
# KAFILA_DEVICE_CPU_OK=1 goes on without a GPU: for trying this script on a machine without one.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/kafila-device}
mkdir -p "$OUT"
KIT=.devkit
SITE=/tmp/site
export PYTHONUNBUFFERED=1 KAFILA_CACHE=/tmp/kafila-cache
started=$SECONDS
DEADLINE=${KAFILA_DEVICE_DEADLINE:-470}
say() { echo "[$((SECONDS - started)) s] $*" | tee -a "$OUT/summary.txt"; }
# A phase's time limit: its own, or what is left before DEADLINE if less (at least 10 s).
skip() { [[ " ${KAFILA_DEVICE_SKIP:-} " == *" $1 "* ]]; }
limit() { local left=$((DEADLINE - (SECONDS - started))); [ "$left" -lt "$1" ] && echo $((left > 10 ? left : 10)) || echo "$1"; }

say "machine: $(nproc) cores; $(python3 --version 2>&1); $(nvidia-smi -L 2>&1 | head -1)"
[ -d "$KIT/wheels" ] || { say "no $KIT/wheels: run scripts/device_kit.sh here and carry what it says"; exit 1; }

say "1. installing the kit's wheels"
timeout "$(limit 120)" python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target "$SITE" "$KIT"/wheels/*.whl > "$OUT/install.log" 2>&1 || { say "wheels failed (install.log)"; exit 1; }
export PYTHONPATH="$SITE:$PWD/src"
# CUDA's runtime and cuBLAS: the toolkit's, and the copies PyTorch's pip packages carry.
LIBRARIES=$(python3 - <<'EOF'
import glob, os, site
roots = site.getsitepackages() + ["/usr/local/cuda"]
folders = {os.path.dirname(p) for root in roots for pattern in ("nvidia/*/lib/libcu*.so*", "nvidia/*/*/lib/libcu*.so*", "lib64/libcudart.so*") for p in glob.glob(os.path.join(root, pattern))}
print(":".join(sorted(folders)))
EOF
)
export LD_LIBRARY_PATH="$LIBRARIES${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
say "library path for CUDA: $LD_LIBRARY_PATH"
if [ -e "$KIT/cuda/llama_cpp-cuda.tar.xz" ]; then
  say "llama-cpp-python from the kit's CUDA build"
  tar xJf "$KIT/cuda/llama_cpp-cuda.tar.xz" -C "$SITE" || say "the kit's CUDA build did not unpack"
fi
offload() { python3 -c "import llama_cpp, sys; sys.exit(0 if llama_cpp.llama_supports_gpu_offload() else 1)" 2>> "$OUT/install.log"; }
if ! offload && [ -z "${KAFILA_DEVICE_CPU_OK:-}" ]; then
  SLIM=$(ls "$KIT"/source/llama_cpp_python-*-slim.tar.gz 2>/dev/null | head -1)
  if [ -z "$SLIM" ]; then
    say "no CUDA build offloads here and no source travelled (carry .devkit/source to build one)"
  else
    say "building llama-cpp-python from $SLIM with CUDA (sm_90) on $(nproc) cores"
    rm -rf "$SITE/llama_cpp"
    CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) \
    CMAKE_ARGS="-DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=90 -DLLAVA_BUILD=OFF -DGGML_NATIVE=ON" \
      timeout 480 python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir --upgrade \
      --target "$SITE" "$SLIM" > "$OUT/build.log" 2>&1 || say "the build failed or ran out of time (build.log)"
  fi
fi
if [ -n "${KAFILA_DEVICE_CPU_OK:-}" ]; then
  say "2. KAFILA_DEVICE_CPU_OK: going on whether llama.cpp offloads or not"
elif ! offload; then
  say "2. llama.cpp does not offload to the GPU here: stopping (install.log, build.log)"
  ldd "$SITE"/llama_cpp/lib/libggml-cuda.so 2>&1 | grep -i "not found" | tee -a "$OUT/summary.txt"
  tail -5 "$OUT/install.log" | tee -a "$OUT/summary.txt"
  exit 1
else
  say "2. llama.cpp offloads to the GPU"
fi

say "2b. what llama.cpp reports of this CPU, and the AMX rule's choice (runtime.md, \"Every common CPU\")"
grep -m1 "model name" /proc/cpuinfo | tee -a "$OUT/summary.txt"
timeout 60 python3 -c "from kafila.runtime.llama.loading import system_info, repack_choice; print(system_info()); print(repack_choice())" 2>&1 | tee -a "$OUT/summary.txt"

if ! skip 3; then
  say "3. split correctness on the GPU"
  # the real gemma-3-270m is not in the kit (an optional extra of 250 MB): its test is left to CI
  timeout "$(limit 180)" python3 -m pytest -q -x -p no:cacheprovider tests/test_split_correctness.py -k "not real_model" > "$OUT/tests.log" 2>&1
  say "tests: rc $? — $(tail -1 "$OUT/tests.log")"
fi

if ! skip 3b; then
  say "3b. a CPU stage and a GPU stage against the unsplit model, by tolerance (agreement-*.log)"
  AGREE_MODELS=("")  # "": the tiny llama the script writes
  for carried in "$KIT"/models/*.gguf; do [ -e "$carried" ] && AGREE_MODELS=("$carried" "${AGREE_MODELS[@]}"); done
  for model in "${AGREE_MODELS[@]}"; do
    for order in cpu,gpu gpu,cpu; do
      tag="$(basename "${model:-tiny-llama}" .gguf)-${order/,/-}"
      if [ -n "$model" ]; then which=(--model "$model"); else which=(--tiny); fi
      timeout "$(limit 60)" python3 scripts/backend_agreement.py "${which[@]}" --backends "$order" --steps 64 \
        --json "$OUT/agreement-$tag.json" > "$OUT/agreement-$tag.log" 2>&1
      say "agreement $tag: rc $? — $(grep -E "tolerance" "$OUT/agreement-$tag.log" | tail -1)"
    done
  done
  timeout "$(limit 60)" python3 scripts/backend_agreement.py --tiny --backends cpu,gpu --steps 16 \
    --perturb blk.1.attn_norm.weight=1.1 > "$OUT/agreement-control.log" 2>&1
  rc=$?
  say "negative control (a norm weight scaled by 1.1): rc $rc, $([ $rc = 1 ] && echo flagged as it must be || echo NOT flagged)"
fi

if ! skip 3c; then
  say "3c. admission at the planner's limit, every layer on the GPU (admission.log)"
  timeout "$(limit 60)" python3 scripts/gpu_stage_check.py admission > "$OUT/admission.log" 2>&1
  say "admission: rc $?"
  grep -E "^(planner|whole|first)" "$OUT/admission.log" | tee -a "$OUT/summary.txt"
fi

if ! skip 3d; then
  say "3d. tokens/s of a 2-stage split against the model alone on the GPU (rate.log)"
  timeout "$(limit 90)" python3 scripts/gpu_stage_check.py rate --tokens 128 --rounds 3 > "$OUT/rate.log" 2>&1
  say "rate: rc $?"
  grep -E "tokens/s" "$OUT/rate.log" | tee -a "$OUT/summary.txt"
fi

if ! skip 4; then
  read -r -a BENCH_ARGS <<< "${KAFILA_DEVICE_BENCH_ARGS:---rounds 3 --no-pinned --tokens 128}"
  say "4. python scripts/bench_concurrency.py ${BENCH_ARGS[*]}"
  timeout "$(limit 420)" python3 scripts/bench_concurrency.py "${BENCH_ARGS[@]}" > "$OUT/bench_concurrency.txt" 2>&1
  say "bench: rc $?"
  grep -E "^(target|one row|\|)" "$OUT/bench_concurrency.txt" | tee -a "$OUT/summary.txt"
fi
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv >> "$OUT/summary.txt" 2>&1
say "done"
