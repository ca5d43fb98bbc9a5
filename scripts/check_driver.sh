#!/usr/bin/env bash
# Check this host's NVIDIA driver against the CUDA a GPU lock needs, before anything installs
# it: MESH_ACCEL=gpu ./scripts/setup.sh and ./scripts/gpu_smoke.sh run it first.
#   The CUDA the lock needs: its cuda-toolkit pin (cuda-toolkit==13.0.3.0: 13.0), else its
#   nvidia-cuda-runtime pin, else the NN of its nvidia-*-cuNN pins (NN.0).
#   The driver that CUDA needs (NVIDIA's minor version compatibility: one driver branch runs
#   every CUDA release of its major version): CUDA 13.x 580.65.06 (R580), 12.x 525.60.13,
#   11.x 450.80.02.
#   The driver here: nvidia-smi --query-gpu=driver_version, else /proc/driver/nvidia/version.
#   CUDA's forward-compatibility package counts: a libcuda.so.VERSION at least as new, in a
#   folder of LD_LIBRARY_PATH (/usr/local/cuda-13.0/compat after `apt-get install
#   cuda-compat-13-0`), passes over an older kernel driver (data-center GPUs only).
# Prints one line and exits 0 when the driver is new enough; otherwise one line on stderr that
# names both fixes (a newer driver; CUDA's forward-compatibility package), exit 1; no driver
# at all (no nvidia-smi, no /proc/driver/nvidia/version) or an unreadable lock: exit 2.
# Usage: ./scripts/check_driver.sh [LOCK]     (default requirements-gpu.txt)
# Environment [default]: MESH_SKIP_DRIVER_CHECK [0; 1: say so and pass, for a host whose
# CUDA the check cannot see]; NVIDIA_VERSION_FILE [/proc/driver/nvidia/version].
set -euo pipefail
case "${1:-}" in -h|--help) awk 'NR > 1 && /^#/ {sub(/^# ?/, ""); print; next} NR > 1 {exit}' "$0"; exit 0;; esac
cd "$(dirname "$0")/.."
LOCK=${1:-requirements-gpu.txt}
ME=check_driver.sh

# min_driver CUDA_MAJOR: the oldest driver of NVIDIA's minor version compatibility for it.
min_driver() {
  case "$1" in
    13) echo 580.65.06;;
    12) echo 525.60.13;;
    11) echo 450.80.02;;
    *) echo "$ME: no known driver minimum for CUDA $1 ($LOCK): add it to scripts/check_driver.sh" >&2
       exit 2;;
  esac
}

# version_ge A B: A >= B, comparing dotted numbers (580.95.05 >= 580.65.06).
version_ge() { [ "$(printf '%s\n%s\n' "$2" "$1" | sort -V | head -n1)" = "$2" ]; }

# needed_cuda: "MAJOR.MINOR PIN" from the lock's pins, e.g. "13.0 cuda-toolkit==13.0.3.0".
needed_cuda() {
  local pin
  pin=$(grep -m1 -E '^(cuda-toolkit|nvidia-cuda-runtime(-cu[0-9]+)?)==[0-9]+\.[0-9]+' "$LOCK" \
        | cut -d' ' -f1) || true
  if [ -n "$pin" ]; then
    echo "$(sed -E 's/^[^=]+==([0-9]+)\.([0-9]+).*/\1.\2/' <<<"$pin") $pin"
    return
  fi
  pin=$(grep -m1 -E '^nvidia-[a-z0-9-]+-cu[0-9]+==' "$LOCK" | cut -d' ' -f1) || true
  [ -n "$pin" ] && echo "$(sed -E 's/^.*-cu([0-9]+)==.*/\1/' <<<"$pin").0 $pin"
}

# driver_here: sets have (the kernel driver's version) or, when none is found, why.
have='' why=''
driver_here() {
  local v proc=${NVIDIA_VERSION_FILE:-/proc/driver/nvidia/version}
  if command -v nvidia-smi >/dev/null; then
    if v=$(nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>&1); then
      v=$(head -n1 <<<"$v" | tr -d '[:space:]')
      if [[ $v =~ ^[0-9]+(\.[0-9]+)+$ ]]; then have=$v; return; fi
    fi
    why="nvidia-smi failed: $(head -n1 <<<"$v")"
  else
    why="no nvidia-smi on PATH"
  fi
  if [ -r "$proc" ]; then
    v=$(grep -m1 -oE 'Kernel Module( for [a-z0-9_]+)? +[0-9]+(\.[0-9]+)+' "$proc" \
        | grep -oE '[0-9]+(\.[0-9]+)+$') || true
    if [ -n "$v" ]; then have=$v; return; fi
    why="$why; $proc names no version"
  else
    why="$why, no $proc"
  fi
}

# compat_driver MIN: "VERSION PATH" of the first libcuda.so.VERSION >= MIN on LD_LIBRARY_PATH.
compat_driver() {
  local dir lib v
  local IFS=:
  for dir in ${LD_LIBRARY_PATH:-}; do
    [ -n "$dir" ] || continue
    for lib in "$dir"/libcuda.so.*.*; do
      [ -e "$lib" ] || continue
      v=${lib##*/libcuda.so.}
      [[ $v =~ ^[0-9]+(\.[0-9]+)+$ ]] && version_ge "$v" "$1" && { echo "$v $lib"; return; }
    done
  done
  return 0
}

[ -r "$LOCK" ] || { echo "$ME: no lock file $LOCK (run from the repository, or name the lock)" >&2; exit 2; }
read -r cuda pin <<<"$(needed_cuda)" || true
if [ -z "${cuda:-}" ]; then
  echo "[driver] $LOCK pins no CUDA packages (cuda-toolkit, nvidia-cuda-runtime, nvidia-*-cuNN): no driver to check"
  exit 0
fi
major=${cuda%%.*}
need=$(min_driver "$major")
if [ "${MESH_SKIP_DRIVER_CHECK:-0}" = 1 ]; then
  echo "[driver] not checked (MESH_SKIP_DRIVER_CHECK=1): $LOCK needs CUDA $cuda ($pin), driver $need or newer, or CUDA's forward-compatibility package"
  exit 0
fi
driver_here
if [ -z "$have" ]; then
  echo "$ME: no NVIDIA driver found ($why): not a GPU host, or the driver is not loaded; $LOCK needs driver $need or newer (CUDA $cuda, $pin); on a CPU host use the default MESH_ACCEL=cpu" >&2
  exit 2
fi
if version_ge "$have" "$need"; then
  echo "[driver] NVIDIA driver $have: CUDA $cuda ($pin, $LOCK) needs $need or newer: ok"
  exit 0
fi
read -r compat lib <<<"$(compat_driver "$need")" || true
if [ -n "${compat:-}" ]; then
  echo "[driver] NVIDIA driver $have, with CUDA's forward-compatibility driver $compat ($lib on LD_LIBRARY_PATH): CUDA $cuda ($pin, $LOCK) needs $need or newer: ok (data-center GPUs only)"
  exit 0
fi
pkg="cuda-compat-$major-${cuda#*.}"
echo "$ME: NVIDIA driver $have is older than $need, which CUDA $cuda needs ($pin in $LOCK): install driver R${need%%.*} or newer, or on a data-center GPU CUDA's forward-compatibility package (from NVIDIA's CUDA repository: apt-get install $pkg, or dnf install $pkg; then export LD_LIBRARY_PATH=/usr/local/cuda-$cuda/compat:\$LD_LIBRARY_PATH) and run again (MESH_SKIP_DRIVER_CHECK=1 skips this check)" >&2
exit 1
