#!/usr/bin/env bash
# One-command environment for plait: system Open MPI, .venv with torch (CPU),
# TensorFlow (Keras 3), mpi4py, plait itself, and Horovod 0.28.1 built from its
# PyPI sdist with the C++17 / CPU-XLA fix (see ../shared/DESIGN.md, section 5).
#
# Idempotent: a stamp in .venv records the inputs; when they are unchanged this
# returns at once. The Horovod wheel is cached outside the checkout, keyed by
# Horovod, torch, TensorFlow and Python versions, so it is built once per machine.
set -euo pipefail

cd "$(dirname "$0")/.."
ROOT=$(pwd)
VENV="$ROOT/.venv"
PY_BOOT=${PYTHON:-python3}
TORCH_VERSION=2.13.0
TF_VERSION=2.21.0
MPI4PY_VERSION=4.1.2
HOROVOD_VERSION=0.28.1
CACHE_DIR=${PLAIT_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/plait}

step_name=""
step() { step_name="$1"; echo "==> setup: $1"; }
trap 'rc=$?; if [ $rc -ne 0 ]; then echo "setup failed at step: ${step_name} (exit $rc); see the output above" >&2; fi' EXIT

inputs_hash() {
  cat tools/setup.sh pyproject.toml | sha256sum | cut -c1-16
}
STAMP="$VENV/.plait-setup-$(inputs_hash)"
if [ -f "$STAMP" ] && [ -x "$VENV/bin/python" ] && command -v mpirun >/dev/null 2>&1; then
  exit 0
fi

step "system packages (Open MPI, iproute2)"
need_apt=()
command -v mpirun >/dev/null 2>&1 || need_apt+=(openmpi-bin libopenmpi-dev)
[ -f /usr/include/x86_64-linux-gnu/openmpi/mpi.h ] || [ -f /usr/lib/x86_64-linux-gnu/openmpi/include/mpi.h ] \
  || need_apt+=(libopenmpi-dev)
command -v ip >/dev/null 2>&1 || need_apt+=(iproute2)
command -v tc >/dev/null 2>&1 || need_apt+=(iproute2)
if [ ${#need_apt[@]} -gt 0 ]; then
  SUDO=""
  [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${need_apt[@]}"
fi

step "virtual environment (.venv)"
[ -x "$VENV/bin/python" ] || "$PY_BOOT" -m venv "$VENV"
PY="$VENV/bin/python"
PIP=("$PY" -m pip install -q --disable-pip-version-check)
PYVER=$("$PY" -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')

step "frameworks (torch $TORCH_VERSION CPU, tensorflow-cpu $TF_VERSION, mpi4py $MPI4PY_VERSION)"
"${PIP[@]}" --upgrade pip setuptools wheel
"${PIP[@]}" "torch==$TORCH_VERSION" "tensorflow-cpu==$TF_VERSION" "mpi4py==$MPI4PY_VERSION"

step "plait and its test tools (pip install -e .[dev])"
"${PIP[@]}" -e ".[dev]"

step "Horovod $HOROVOD_VERSION (built once, cached in $CACHE_DIR)"
HVD_KEY="horovod-$HOROVOD_VERSION-torch$TORCH_VERSION-tf$TF_VERSION-$PYVER"
HVD_DIR="$CACHE_DIR/$HVD_KEY"
if ! ls "$HVD_DIR"/horovod-*.whl >/dev/null 2>&1; then
  build=$(mktemp -d)
  "$PY" -m pip download -q --no-deps --no-binary :all: -d "$build" "horovod==$HOROVOD_VERSION"
  tar -xzf "$build/horovod-$HOROVOD_VERSION.tar.gz" -C "$build"
  src="$build/horovod-$HOROVOD_VERSION"
  # torch >= 2.1 and TensorFlow 2.21 need C++17; CMake appends -std=c++14 after CXXFLAGS.
  sed -i 's/set(CMAKE_CXX_STANDARD 14)/set(CMAKE_CXX_STANDARD 17)/' \
    "$src/CMakeLists.txt" "$src/horovod/torch/CMakeLists.txt"
  # The XLA ops include GPU-only headers before their HAVE_GPU guard.
  sed -i 's/^#if TENSORFLOW_VERSION >= 2006000000$/#if TENSORFLOW_VERSION >= 2006000000 \&\& HAVE_GPU/' \
    "$src/horovod/tensorflow/xla_mpi_ops.cc"
  grep -q 'CMAKE_CXX_STANDARD 17' "$src/horovod/torch/CMakeLists.txt"
  grep -q '2006000000 && HAVE_GPU' "$src/horovod/tensorflow/xla_mpi_ops.cc"
  "${PIP[@]}" cloudpickle psutil pyyaml packaging cffi
  (
    cd "$src"
    export HOROVOD_WITH_MPI=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITH_PYTORCH=1 \
      HOROVOD_WITH_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1 \
      MAKEFLAGS="-j$(nproc)"
    "$PY" -m pip wheel -q --no-deps --no-build-isolation -w "$build/wheel" .
  )
  mkdir -p "$HVD_DIR"
  cp "$build"/wheel/horovod-*.whl "$HVD_DIR/"
  rm -rf "$build"
fi
"${PIP[@]}" --no-deps --force-reinstall "$HVD_DIR"/horovod-*.whl
"${PIP[@]}" cloudpickle psutil pyyaml packaging cffi

step "check: import torch, tensorflow, mpi4py, horovod"
"$PY" - <<'EOF'
import horovod.tensorflow, horovod.torch, mpi4py, tensorflow, torch  # noqa: F401
import horovod.torch as hvd
if not (hvd.mpi_built() and hvd.gloo_built()):
    raise SystemExit("horovod was built without MPI or Gloo")
EOF

rm -f "$VENV"/.plait-setup-*
touch "$STAMP"
echo "==> setup: done ($VENV)"
