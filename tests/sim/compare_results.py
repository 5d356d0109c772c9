#!/usr/bin/env python3
"""Compares two kvscope results files (HDF5) object by object: every group, dataset (shape, dtype and
values, NaN equal to NaN) and attribute must be equal, except the wall-clock ones (root attribute
`created`, `/points/seconds`). Exit 0 when equal, 1 with one line per difference (at most 20).

usage: compare_results.py A.h5 B.h5"""
import sys

import h5py
import numpy as np

SKIP_ATTRS = {"/": {"created"}}
SKIP_DATASETS = {"/points/seconds"}


def values_equal(a, b):
    a, b = np.asarray(a), np.asarray(b)
    if a.shape != b.shape or a.dtype.kind != b.dtype.kind:
        return False
    if a.dtype.kind == "f":
        return bool(np.array_equal(a, b, equal_nan=True))
    return bool(np.array_equal(a, b))


def main():
    a_path, b_path = sys.argv[1:3]
    diffs = []
    with h5py.File(a_path, "r") as a, h5py.File(b_path, "r") as b:
        names_a, names_b = set(), set()
        a.visit(names_a.add)
        b.visit(names_b.add)
        for n in sorted(names_a ^ names_b):
            diffs.append(f"/{n}: only in {'A' if n in names_a else 'B'}")
        for obj_name in ["/"] + ["/" + n for n in sorted(names_a & names_b)]:
            oa, ob = a[obj_name], b[obj_name]
            skip = SKIP_ATTRS.get(obj_name, set())
            for k in sorted(set(oa.attrs) | set(ob.attrs)):
                if k in skip:
                    continue
                if k not in oa.attrs or k not in ob.attrs:
                    diffs.append(f"{obj_name}@{k}: only in one file")
                elif not values_equal(oa.attrs[k], ob.attrs[k]):
                    diffs.append(f"{obj_name}@{k}: {oa.attrs[k]!r} != {ob.attrs[k]!r}")
            if isinstance(oa, h5py.Dataset) and obj_name not in SKIP_DATASETS:
                va, vb = oa[()], ob[()]
                if oa.dtype.kind == "O":
                    va, vb = oa.asstr()[()], ob.asstr()[()]
                if not values_equal(va, vb):
                    diffs.append(f"{obj_name}: values differ")
    for d in diffs[:20]:
        print(f"{a_path} vs {b_path}: {d}")
    return 1 if diffs else 0


if __name__ == "__main__":
    sys.exit(main())
