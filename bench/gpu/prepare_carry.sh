#!/bin/bash
# Run here (the CPU machine, network to PyPI) before the first device call:
# fills the two ignored folders that bench/gpu/device_setup.sh and
# device_nccl.sh read on the device machine, which has no network.
#   .whl/   mpich, mpi4py and nccl4py wheels for the image's Python 3.12
#   .nccl/  libnccl.so.2.xz: NCCL with sm_90 device code only (slim_nccl.py),
#           because the image's NCCL 2.28.9 predates NCCL_MULTI_RANK_GPU_ENABLE
# Then: run(command="bash bench/gpu/validate.sh SECTION...", carry=[".whl", ".nccl"]).
# A call carries 64 MiB in all (tree included); this prints what it adds.
set -euo pipefail
cd "$(dirname "$0")/../.."
MPICH=${MPICH:-5.0.2} MPI4PY=${MPI4PY:-4.1.2} NCCL4PY=${NCCL4PY:-0.6.0}
NCCL=${NCCL:-2.32.3}  # the version session 39 ran on the H100
for d in /.whl/ /.nccl/; do
  grep -qxF "$d" .git/info/exclude 2>/dev/null || echo "$d" >> .git/info/exclude
done
download() {  # wheels for CPython 3.12 on x86-64 manylinux, whatever runs this
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux_2_5_x86_64 \
    --platform manylinux1_x86_64 -d "$@"
}
rm -rf .whl && mkdir .whl
download .whl "mpich==$MPICH" "mpi4py==$MPI4PY" "nccl4py==$NCCL4PY"
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
download "$work" "nvidia-nccl-cu13==$NCCL"
(cd "$work" && python3 -m zipfile -e nvidia_nccl_cu13-*.whl unpacked)
mkdir -p .nccl
python3 bench/gpu/slim_nccl.py "$work/unpacked/nvidia/nccl/lib/libnccl.so.2" \
  "$work/libnccl.so.2" --arch 90
xz -T2 -6 -c "$work/libnccl.so.2" > .nccl/libnccl.so.2.xz
ls -l .whl .nccl
echo "carried: $(du -cb .whl .nccl | tail -1 | cut -f1) bytes;" \
  "tracked tree: $(git ls-files -z | xargs -0 du -cb | tail -1 | cut -f1) bytes (limit 67108864 together)"
