#!/usr/bin/python3
"""Byte-level corruptions of a shipped trace that make Debian's libhdf5 1.10.8 itself misbehave.

Usage: corrupt_heap.py SRC.h5 OUTDIR   writes OUTDIR/heap-crash.h5 and OUTDIR/heap-hang.h5

The variable-length strings of a trace (/tokens/text, the string attributes) live in an HDF5
global heap collection ("GCOL" signature, version, 3 reserved bytes, the 8-byte size of the
collection, then objects: 2-byte index, 2-byte reference count, 4 reserved bytes, 8-byte size,
data padded to 8 bytes). Found by a scan of single-byte changes (docs/robustness.md):
- heap-crash.h5: the heap object holding the text of token 0 (found through the first
  variable-length reference of /tokens/text: 4-byte length, 8-byte collection address, 4-byte
  index) claims 0xff00 more bytes than it has: libhdf5 dies with SIGSEGV reading /tokens/text.
- heap-hang.h5: byte 9 of the collection header (bits 8-15 of its size) set to 0xff: libhdf5
  loops forever reading the first string attribute (/@format).
- first_object_crash(): the first object of the first collection (a results file's /@format
  string) claims 0xff00 more bytes: libhdf5 dies with SIGSEGV reading it.
h5py only locates /tokens/text's data; the corruption is written byte for byte.
"""
import os
import struct
import sys


def heap_object(data, collection, index):
    """Offset of object `index` in the global heap collection at `collection`."""
    (size,) = struct.unpack("<Q", data[collection + 8:collection + 16])
    off = collection + 16
    while off + 16 <= collection + size:
        idx = struct.unpack("<H", data[off:off + 2])[0]
        (osize,) = struct.unpack("<Q", data[off + 8:off + 16])
        if idx == index:
            return off
        if idx == 0:
            break
        off += 16 + (osize + 7) // 8 * 8
    raise SystemExit(f"no heap object {index} in the collection at {collection}")


def corruptions(src):
    import h5py

    with h5py.File(src, "r") as f:
        text_at = f["tokens/text"].id.get_offset()
    data = open(src, "rb").read()
    at = data.find(b"GCOL")
    if at < 0 or text_at is None:
        raise SystemExit(f"{src}: no global heap collection or no contiguous /tokens/text")
    _, collection, index = struct.unpack("<IQI", data[text_at:text_at + 16])
    crash = bytearray(data)
    crash[heap_object(data, collection, index) + 9] = 0xFF
    hang = bytearray(data)
    hang[at + 9] = 0xFF
    return {"heap-crash.h5": bytes(crash), "heap-hang.h5": bytes(hang)}


def first_object_crash(src, dst):
    data = bytearray(open(src, "rb").read())
    at = data.find(b"GCOL")
    if at < 0:
        raise SystemExit(f"{src}: no global heap collection")
    data[at + 16 + 9] = 0xFF
    with open(dst, "wb") as f:
        f.write(data)
    return dst


def write_corruptions(src, outdir):
    os.makedirs(outdir, exist_ok=True)
    paths = {}
    for name, blob in corruptions(src).items():
        p = os.path.join(outdir, name)
        with open(p, "wb") as f:
            f.write(blob)
        paths[name] = p
    return paths


if __name__ == "__main__":
    for p in write_corruptions(sys.argv[1], sys.argv[2]).values():
        print(p)
