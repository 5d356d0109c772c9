#!/usr/bin/env python3
"""Runs the pandas and h5py examples of docs/results-format.md verbatim on files kvscope
writes (write_sample_results), then checks what they read against each other and against
the sample's known values, and checks that the document lists every CSV column and every
HDF5 dataset and attribute in the file (the docs follow the code).

usage: results_interop.py DOC WRITE_SAMPLE_RESULTS WORKDIR"""
import os
import re
import subprocess
import sys

import h5py
import numpy as np
import pandas as pd

doc, writer, workdir = (os.path.abspath(a) for a in sys.argv[1:4])
os.makedirs(workdir, exist_ok=True)
os.chdir(workdir)
for name in ("results.csv", "results.h5"):
    if os.path.exists(name):
        os.remove(name)
r = subprocess.run([writer, workdir], capture_output=True, text=True)
if r.returncode != 0:
    sys.exit("write_sample_results failed: " + r.stderr)

text = open(doc).read()
blocks = re.findall(r"```python\n(.*?)```", text, re.S)
assert len(blocks) == 2, "expected the pandas and the h5py example in " + doc
csv_ns, h5_ns = {}, {}
exec(compile(blocks[0], doc + " (pandas example)", "exec"), csv_ns)
exec(compile(blocks[1], doc + " (h5py example)", "exec"), h5_ns)

# --- CSV, as the pandas example read it
df = csv_ns["df"]
P, L, M = 4, 3, 2  # sample: 4 points, 3 layers, text + vision
assert len(df) == P * (L + 1) * (M + 1), len(df)
assert list(df.columns[:12]) == ["policy", "budget", "layer", "modality", "bytes_full", "bytes_kept",
                                 "bytes_ratio", "output_error", "attention_recall", "kl", "entropy_delta",
                                 "flags"], list(df.columns)
assert list(df.columns[12:20]) == ["tokens", "kept", "merged", "evicted", "share_before", "share_after",
                                   "pareto", "budget_value"], list(df.columns)
points = csv_ns["points"]
assert list(points.policy) == ["h2o", "h2o", "random", "random"]
assert list(points.budget) == ["0.3", "0.6", "0.3", "0.6"]
assert list(csv_ns["front"].policy + "@" + csv_ns["front"].budget) == ["h2o@0.3", "h2o@0.6", "random@0.6"]
assert csv_ns["error_by_layer"].shape == (L, P), csv_ns["error_by_layer"].shape
assert csv_ns["vision_recall"].shape == (L, P)
assert set(df["flags"]) == {"", "visual_blindness", "visual_blindness;over_compression"}

# A plain read_csv (no options) must give numeric dtypes to every numeric column.
plain = pd.read_csv("results.csv")
for col in ["bytes_full", "bytes_kept", "tokens", "kept", "merged", "evicted", "pareto"]:
    assert plain[col].dtype == np.int64, (col, plain[col].dtype)
for col in ["bytes_ratio", "output_error", "attention_recall", "kl", "entropy_delta", "share_before",
            "share_after", "budget_value"]:
    assert plain[col].dtype == np.float64, (col, plain[col].dtype)
rows = df[df.modality != "all"]
sums = rows.groupby(["policy", "budget", "layer"])[["tokens", "kept", "evicted", "bytes_full"]].sum()
alls = df[df.modality == "all"].set_index(["policy", "budget", "layer"])[["tokens", "kept", "evicted",
                                                                          "bytes_full"]]
assert (sums.sort_index() == alls.sort_index()).all().all(), "modality rows must add up to the all row"

# --- HDF5, as the h5py example read it; must agree with the CSV
hp = h5_ns["points"]
assert list(hp.policy) == list(points.policy) and list(hp.budget) == list(points.budget)
assert np.array_equal(hp.bytes_ratio.values, points.bytes_ratio.values)
assert np.array_equal(hp.output_error.values, points.output_error.values)
assert list(hp.pareto) == [True, True, False, True]
vis = df[(df.layer == "all") & (df.modality == "vision")]
assert np.array_equal(hp.vision_recall.values, vis.attention_recall.values)
layers = csv_ns["layers"]
assert h5_ns["layer_error"].shape == (P, L)
assert np.array_equal(h5_ns["layer_error"].ravel(), layers.output_error.values)
assert h5_ns["head_bytes"].shape == (P, L, 2)
assert np.array_equal(h5_ns["head_bytes"].sum(axis=2).ravel(), layers.bytes_kept.values)
assert np.array_equal(h5_ns["layer_vision_recall"].ravel(),
                      df[(df.layer != "all") & (df.modality == "vision")].attention_recall.values)
flags = h5_ns["flags"]
assert list(flags.point) == [0, 2, 2] and list(flags["mode"]) == ["visual_blindness", "visual_blindness",
                                                                  "over_compression"]

# --- the document names every column, dataset and attribute
documented = set(re.findall(r"`([A-Za-z_]+)`", text))
missing = [c for c in plain.columns if c not in documented]
with h5py.File("results.h5", "r") as f:
    missing += ["@" + a for a in f.attrs if a not in documented]
    def visit(name, obj):
        if isinstance(obj, h5py.Dataset):
            leaf = name.rsplit("/", 1)[-1]
            if leaf not in documented:
                missing.append(name)
            for a in obj.attrs:
                if a not in documented:
                    missing.append(name + "@" + a)
    f.visititems(visit)
    for g in f:
        if g not in documented and "/" + g not in text:
            missing.append(g)
assert not missing, "undocumented in " + doc + ": " + ", ".join(missing)
print("results interop ok:", len(df), "CSV rows;", len(hp), "points in HDF5")
