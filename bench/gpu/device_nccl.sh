# Source from the repository root on the device machine after device_setup.sh:
# replaces the image's libnccl.so.2 (2.28.9, older than NCCL_MULTI_RANK_GPU_ENABLE)
# with the carried one, made by bench/gpu/slim_nccl.py from the nvidia-nccl-cu13
# wheel and compressed with xz into .nccl/libnccl.so.2.xz.
NCCL_DIR=$(python3 -c "import nvidia.nccl as n, os; print(os.path.join(list(n.__path__)[0], 'lib'))") || return 1
xz -dc .nccl/libnccl.so.2.xz > "$NCCL_DIR/libnccl.so.2" || return 1
python3 -c "from nccl.bindings import nccl as nb; v = nb.get_version(); print('NCCL', v // 10000, v // 100 % 100, v % 100)"
