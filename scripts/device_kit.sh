#!/usr/bin/env bash
# Packs .devkit/: what scripts/device_check.sh needs on a GPU machine that reaches no network.
#
#     bash scripts/device_kit.sh            # wheels and the slimmed llama-cpp-python source
#     bash scripts/device_kit.sh --cuda     # also a CUDA build of llama-cpp-python, made here
#
# Why a kit: the concurrency target (4 users at 3x one user) rests on a batch row being nearly
# free, which holds on a GPU and not on this project's 2-vCPU machines. The GPU machines this
# project is sometimes lent have Python 3.12, CUDA 13 and PyTorch, but none of Kafila's
# dependencies and no network, and their time is short (minutes). So everything travels with
# the working tree, under the 64 MiB a call may carry:
#   - .devkit/wheels: Kafila's dependencies and the openai client, for Python 3.12 (about
#     15 MB; the packages the GPU image already holds, numpy and jinja2 among them, are left out);
#   - .devkit/llama_cpp_python-<version>-slim.tar.gz: the pinned llama-cpp-python source with
#     llama.cpp's model vocabularies, docs, benches, git history and non-CUDA accelerator
#     backends removed (77 MB -> about 10 MB), for building there when no wheel travels;
#   - with --cuda, .devkit/cuda/llama_cpp_python-*.whl: the same source built here for sm_90
#     (Hopper: H100, H200), which saves the GPU machine several minutes of compiling. It needs
#     CUDA's nvcc (13, as on the GPU machine) and cuBLAS; cuBLAS comes from PyPI's nvidia-cublas
#     wheel and is put beside a copy of the toolkit's layout in a temporary folder. Expect about
#     an hour on 2 cores. llama-cpp-python loads its libraries with ctypes, so a wheel built
#     with this machine's Python runs under the GPU machine's.
set -euo pipefail
cd "$(dirname "$0")/.."
KIT=.devkit
PYTHON_VERSION=3.12
LLAMA=$(sed -n 's/.*"llama-cpp-python==\([0-9.]*\)".*/\1/p' pyproject.toml)
[ -n "$LLAMA" ] || { echo "pyproject.toml pins no llama-cpp-python version" >&2; exit 1; }
mkdir -p "$KIT"
PLATFORMS=()
for tag in manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux_2_27_x86_64 manylinux_2_28_x86_64 \
  manylinux_2_34_x86_64 manylinux1_x86_64 manylinux_2_5_x86_64; do
  PLATFORMS+=(--platform "$tag")
done

echo "1. wheels for Python $PYTHON_VERSION -> $KIT/wheels"
mapfile -t REQUIREMENTS < <(python3 - <<'EOF'
import tomllib
project = tomllib.load(open("pyproject.toml", "rb"))["project"]
for requirement in project["dependencies"]:
    if not requirement.startswith("llama-cpp-python"):
        print(requirement)
print(next(r for r in project["optional-dependencies"]["test"] if r.startswith("openai")))
EOF
)
rm -rf "$KIT/wheels"
python3 -m pip download -q --disable-pip-version-check --only-binary=:all: --python-version "$PYTHON_VERSION" \
  --implementation cp "${PLATFORMS[@]}" -d "$KIT/wheels" "${REQUIREMENTS[@]}" "diskcache>=5.6"
# Already in the GPU image (KINDS.md's package list): leave them there, keep the kit small.
for present in numpy jinja2 markupsafe requests urllib3 idna certifi charset_normalizer; do
  rm -f "$KIT/wheels/$present"-*.whl
done
du -sh "$KIT/wheels"

SLIM="$KIT/llama_cpp_python-$LLAMA-slim.tar.gz"
echo "2. llama-cpp-python $LLAMA source, slimmed -> $SLIM"
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
python3 -m pip download -q --disable-pip-version-check --no-deps --no-binary=:all: -d "$WORK" "llama-cpp-python==$LLAMA"
tar xzf "$WORK/llama_cpp_python-$LLAMA.tar.gz" -C "$WORK"
SOURCE="$WORK/llama_cpp_python-$LLAMA"
rm -rf "$SOURCE/.git" "$SOURCE"/vendor/llama.cpp/{models,docs,benches}
for backend in openvino webgpu et metal hexagon sycl vulkan opencl cann musa kompute zdnn; do
  rm -rf "$SOURCE/vendor/llama.cpp/ggml/src/ggml-$backend"
done
tar czf "$SLIM" -C "$WORK" "llama_cpp_python-$LLAMA"
ls -la "$SLIM"

if [ "${1:-}" = "--cuda" ]; then
  echo "3. a CUDA (sm_90) build of llama-cpp-python $LLAMA -> $KIT/cuda"
  # The toolkit: $CUDA_HOME, else /usr/local/cuda, else the folder above nvcc's.
  TOOLKIT=${CUDA_HOME:-/usr/local/cuda}
  if [ ! -x "$TOOLKIT/bin/nvcc" ]; then
    NVCC=$(command -v nvcc || true)
    [ -n "$NVCC" ] || { echo "no CUDA toolkit: set CUDA_HOME, or leave out --cuda" >&2; exit 1; }
    TOOLKIT=$(dirname "$(dirname "$(readlink -f "$NVCC")")")
  fi
  TOOLKIT=$(readlink -f "$TOOLKIT")
  MERGED="$WORK/cuda"
  mkdir -p "$MERGED/include" "$MERGED/lib64"
  for entry in "$TOOLKIT"/*; do
    name=$(basename "$entry")
    [ "$name" = include ] || [ "$name" = lib64 ] || ln -s "$entry" "$MERGED/$name"
  done
  ln -s "$TOOLKIT"/include/* "$MERGED/include/"
  ln -s "$TOOLKIT"/lib64/* "$MERGED/lib64/"
  if [ ! -e "$MERGED/include/cublas_v2.h" ]; then
    python3 -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
      --python-version "$PYTHON_VERSION" "${PLATFORMS[@]}" -d "$WORK/cublas" "nvidia-cublas>=13,<14"
    (cd "$WORK/cublas" && python3 -m zipfile -e nvidia_cublas-*.whl unpacked)
    CUBLAS=$(dirname "$(find "$WORK/cublas/unpacked" -name cublas_v2.h | head -1)")/..
    ln -s "$CUBLAS"/include/* "$MERGED/include/"
    for library in "$CUBLAS"/lib/*.so.*; do
      ln -s "$library" "$MERGED/lib64/"
      ln -s "$library" "$MERGED/lib64/$(basename "$library" | sed 's/\.so\..*/.so/')"
    done
  fi
  rm -rf "$KIT/cuda"
  echo "   compiling (progress: the [n/total] lines of $KIT/cuda-build.log)"
  # No VMM: that would link libcuda.so, which a machine without a GPU driver lacks. AVX2 and
  # FMA, not -march=native: the CPU part must run on the GPU machine's processor.
  CUDAToolkit_ROOT="$MERGED" PATH="$MERGED/bin:$PATH" CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" \
  CMAKE_ARGS="-DGGML_CUDA=on -DGGML_CUDA_NO_VMM=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DCUDAToolkit_ROOT=$MERGED \
-DLLAVA_BUILD=OFF -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON" \
    python3 -m pip wheel -v --disable-pip-version-check --no-deps -w "$KIT/cuda" "$SLIM" > "$KIT/cuda-build.log" 2>&1 \
    || { tail -30 "$KIT/cuda-build.log" >&2; echo "the CUDA build failed: $KIT/cuda-build.log" >&2; exit 1; }
  ls -la "$KIT/cuda"
fi
du -sh "$KIT"
