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
# the working tree, under the 64 MiB a call may carry (the script prints which folders to carry):
#   - .devkit/wheels: Kafila's dependencies and the openai client, for Python 3.12 (about
#     16 MB; the packages the GPU image already holds, numpy and jinja2 among them, are left out);
#   - .devkit/source/llama_cpp_python-<version>-slim.tar.gz: the pinned llama-cpp-python source
#     with llama.cpp's model vocabularies, docs, benches, git history and other accelerators'
#     backends removed (77 MB -> about 10 MB), to build there when no CUDA build travels;
#   - with --cuda, .devkit/cuda/llama_cpp-cuda.tar.xz: that source built here for sm_90 (Hopper:
#     H100, H200), which saves the GPU machine a long compile (about 30 minutes on 2 cores here).
#     It needs CUDA's nvcc (13, as on the GPU machine) and cuBLAS, which comes from PyPI's
#     nvidia-cublas wheel into a merged copy of the toolkit's layout in a temporary folder. The
#     wheel pip makes holds every library three times over (no symlinks in wheels: 263 MB), so
#     the package is repacked with one copy of each and its symlinks (about 40 MB). llama-cpp-
#     python loads its libraries with ctypes, so what is built under this Python runs under 3.12.
#     KAFILA_KIT_CUDA_WHEEL=path repacks a CUDA wheel built before instead of building one.
set -euo pipefail
cd "$(dirname "$0")/.."
KIT=.devkit
PYTHON_VERSION=3.12
LLAMA=$(sed -n 's/.*"llama-cpp-python==\([0-9.]*\)".*/\1/p' pyproject.toml)
[ -n "$LLAMA" ] || { echo "pyproject.toml pins no llama-cpp-python version" >&2; exit 1; }
mkdir -p "$KIT"
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
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

SLIM="$KIT/source/llama_cpp_python-$LLAMA-slim.tar.gz"
echo "2. llama-cpp-python $LLAMA source, slimmed -> $SLIM"
mkdir -p "$KIT/source"
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
  WHEEL=${KAFILA_KIT_CUDA_WHEEL:-}
  if [ -z "$WHEEL" ]; then
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
    echo "   compiling (progress: the [n/total] lines of $KIT/cuda-build.log)"
    # No VMM: that would link libcuda.so, which a machine without a GPU driver lacks. AVX2 and
    # FMA, not -march=native: the CPU part must run on the GPU machine's processor.
    CUDAToolkit_ROOT="$MERGED" PATH="$MERGED/bin:$PATH" CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" \
    CMAKE_ARGS="-DGGML_CUDA=on -DGGML_CUDA_NO_VMM=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DCUDAToolkit_ROOT=$MERGED \
-DLLAVA_BUILD=OFF -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON" \
      python3 -m pip wheel -v --disable-pip-version-check --no-deps -w "$WORK/wheel" "$SLIM" > "$KIT/cuda-build.log" 2>&1 \
      || { tail -30 "$KIT/cuda-build.log" >&2; echo "the CUDA build failed: $KIT/cuda-build.log" >&2; exit 1; }
    WHEEL=$(ls "$WORK"/wheel/llama_cpp_python-*.whl)
  fi
  # The package alone, each library once: the real file plus its soname and linker-name links.
  mkdir -p "$WORK/package"
  (cd "$WORK/package" && python3 -m zipfile -e "$(readlink -f "$WHEEL")" . && rm -rf lib include bin ./*.dist-info)
  LIBRARIES="$WORK/package/llama_cpp/lib"
  for real in "$LIBRARIES"/*.so.*.*; do
    soname=$(readelf -d "$real" | sed -n 's/.*(SONAME).*\[\(.*\)\]/\1/p')
    linker=$(basename "$real" | sed 's/\.so\..*/.so/')
    for name in "$soname" "$linker"; do
      [ -n "$name" ] && [ "$name" != "$(basename "$real")" ] && ln -sf "$(basename "$real")" "$LIBRARIES/$name"
    done
  done
  rm -rf "$KIT/cuda" && mkdir -p "$KIT/cuda"
  tar cJf "$KIT/cuda/llama_cpp-cuda.tar.xz" -C "$WORK/package" llama_cpp
  ls -la "$KIT/cuda"
fi
du -sh "$KIT"
if [ -e "$KIT/cuda/llama_cpp-cuda.tar.xz" ]; then
  echo "carry [\"$KIT/wheels\", \"$KIT/cuda\"] and run: bash scripts/device_check.sh"
else
  echo "carry [\"$KIT/wheels\", \"$KIT/source\"] and run: bash scripts/device_check.sh (it builds llama.cpp there)"
fi
