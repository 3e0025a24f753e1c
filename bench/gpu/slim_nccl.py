"""Make a copy of libnccl.so.2 that travels: device code of one architecture only.

Why: the device machine's image has NCCL 2.28.9, which predates
NCCL_MULTI_RANK_GPU_ENABLE (>= 2.30.3), and the nvidia-nccl-cu13 wheel's
library (344 MB) is far over what a call can carry (64 MiB). Most of it is
device code for eight architectures. This zeroes the payload of every fatbin
entry (cubin or PTX) that is not for ``--arch`` -- headers stay, so the CUDA
loader still finds the entry it uses -- and strips the debug sections; the
zeros then compress to nothing.

    python bench/gpu/slim_nccl.py libnccl.so.2 out/libnccl.so.2 --arch 90
    xz -T2 -6 out/libnccl.so.2            # ~1/10 of the original
"""

from __future__ import annotations

import argparse
import shutil
import struct
import subprocess

_FATBIN_MAGIC = 0xBA55ED50
_SECTIONS = (".nv_fatbin", "__nv_relfatbin")


def _sections(path: str) -> dict[str, tuple[int, int]]:
    """name -> (file offset, size) from readelf."""
    out = subprocess.run(["readelf", "-S", "-W", path], capture_output=True, text=True,
                         check=True).stdout
    found = {}
    for line in out.splitlines():
        fields = line.replace("[ ", "[").split()
        if len(fields) > 5 and fields[1] in _SECTIONS:
            found[fields[1]] = (int(fields[4], 16), int(fields[5], 16))
    return found


def slim(data: bytearray, offset: int, size: int, keep_arch: int) -> tuple[int, int]:
    """Zero the payload of every entry not for ``keep_arch``; (kept, zeroed) bytes."""
    kept = zeroed = 0
    pos, end = offset, offset + size
    while pos + 16 <= end:
        magic, _version, header, fat_size = struct.unpack_from("<IHHQ", data, pos)
        if magic != _FATBIN_MAGIC:
            pos += 8  # fatbins are 8-byte aligned, padding between them
            continue
        entry, stop = pos + header, pos + header + fat_size
        while entry < stop:
            _kind, _ver, entry_header, payload = struct.unpack_from("<HHIQ", data, entry)
            arch = struct.unpack_from("<I", data, entry + 28)[0]
            start = entry + entry_header
            if arch == keep_arch:
                kept += payload
            else:
                data[start:start + payload] = bytes(payload)
                zeroed += payload
            entry = start + payload
        pos = stop
    return kept, zeroed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("library")
    parser.add_argument("output")
    parser.add_argument("--arch", type=int, default=90, help="SM version to keep (90: Hopper)")
    args = parser.parse_args()
    shutil.copyfile(args.library, args.output)
    subprocess.run(["strip", "--strip-debug", args.output], check=True)
    sections = _sections(args.output)
    data = bytearray(open(args.output, "rb").read())
    for name, (offset, size) in sections.items():
        kept, zeroed = slim(data, offset, size, args.arch)
        print(f"{name}: kept {kept / 2**20:.1f} MiB of sm_{args.arch}, zeroed {zeroed / 2**20:.1f} MiB")
    with open(args.output, "wb") as out:
        out.write(data)


if __name__ == "__main__":
    main()
