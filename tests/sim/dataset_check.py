#!/usr/bin/env python3
"""Checks a dataset sweep's files (docs/results-format.md "Dataset sweeps") with h5py and pandas:
the tables' shapes, the mean points against the per-sample rows, the intervals against a reimplementation
of the documented bootstrap, and the CSVs against the HDF5 tables.

With ONE.csv and I (the CSV of `kvsim sweep --trace` of sample I with the dataset sweep's options), also
checks that sample I's rows of /sample_points are that CSV's rows: every metric, the proxies (1.5) and
the flags, as scripts/calibrate reads them.

usage: dataset_check.py RESULTS.h5 AGGREGATES.csv SAMPLES.csv MANIFEST.csv NUM_SAMPLES [ONE.csv I]"""
import sys

import h5py
import numpy as np
import pandas as pd

M64 = (1 << 64) - 1


def splitmix64(state):
    state = (state + 0x9E3779B97F4A7C15) & M64
    z = state
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return state, z ^ (z >> 31)


def fnv1a(s):
    h = 0xCBF29CE484222325
    for c in s.encode():
        h = ((h ^ c) * 0x100000001B3) & M64
    return h


def bootstrap(x, resamples, seed, by, group, confidence):
    state, seed2 = splitmix64(seed ^ fnv1a(by + "\x1f" + group))
    n, state, means = len(x), seed2, []
    for _ in range(resamples):
        idx = []
        for _ in range(n):
            state, r = splitmix64(state)
            idx.append(((r >> 32) * n) >> 32)
        means.append(np.mean(x[idx]))
    a = (1 - confidence) / 2
    return np.quantile(means, a), np.quantile(means, 1 - a)


def check(cond, msg):
    if not cond:
        sys.exit("FAIL: " + msg)


h5, agg_csv, samples_csv, manifest_csv, N = sys.argv[1:6]
N = int(N)
manifest = pd.read_csv(manifest_csv, dtype=str, keep_default_na=False)
check(len(manifest) == N and list(manifest.columns[:3]) == ["sample", "trace", "family"], "manifest columns")
check(set(manifest.family) <= {"fine-grained", "counting", "two-image", "text-only"}, "families")
with h5py.File(h5, "r") as f:
    check(f.attrs["version"] == "1.5" and f.attrs["num_samples"] == N, "root attributes")
    B, seed, conf = int(f.attrs["bootstrap_resamples"]), int(f.attrs["bootstrap_seed"]), float(f.attrs["confidence"])
    tables = {}
    for name in ("samples", "sample_points", "aggregate"):
        g = f[name]
        tables[name] = pd.DataFrame({k: (g[k].asstr()[:] if g[k].dtype.kind == "O" else g[k][:]) for k in g})
        check(g.attrs["num_rows"] == len(tables[name]), name + " num_rows")
    pts = pd.DataFrame({k: f["points"][k].asstr()[:] for k in ("policy", "budget", "kind")})
    pts["output_error"] = f["points/output_error"][:]
    pts["pareto"] = f["points/pareto"][:]
    pts["mode"] = f["points/mode"].asstr()[:]
    pts["topk_recall"] = f["points/topk_recall"][:]
    L = int(f.attrs["num_layers"])
samples, sp, agg = tables["samples"], tables["sample_points"], tables["aggregate"]
check(len(samples) == N and list(samples["sample"]) == list(manifest["sample"]), "/samples rows")
check(list(samples["family"]) == list(manifest["family"]), "/samples keeps the manifest's family")
P, M = len(pts), len(set(sp.modality))
check(len(sp) == N * P * (L + 1) * M, f"/sample_points has {len(sp)} rows, expected {N}x{P}x{L + 1}x{M}")
check(set(pts.kind[pts.pareto == 1]) == {"policy"}, "Pareto front outside the policies")
# Mean points are the means of the per-sample rows (layer all, modality all).
tot = sp[(sp.layer == -1) & (sp.modality == "all")]
mean_err = tot.groupby("point").output_error.mean()
check(np.allclose(mean_err.sort_index().values, pts.output_error.values, rtol=1e-12, atol=1e-15), "mean points")
# The mean points' proxies (1.5) are the means of the samples' too.
mean_topk = tot.groupby("point").topk_recall.mean()
check(np.allclose(mean_topk.sort_index().values, pts.topk_recall.values, rtol=1e-12, atol=1e-15, equal_nan=True),
      "mean points' proxies")
a_all = agg[(agg.by == "all") & (agg.layer == -1) & (agg.modality == "all")].set_index("point").sort_index()
check(np.allclose(a_all.output_error_mean.values, pts.output_error.values, rtol=1e-12, atol=1e-15), "aggregate means")
check(set(a_all.n) == {N}, "n of the grouping all")
fin = agg[np.isfinite(agg.output_error_mean)]
check(((fin.output_error_lo <= fin.output_error_mean + 1e-15) & (fin.output_error_mean <= fin.output_error_hi + 1e-15)).all(),
      "mean outside its interval")
for by in ("family", "length"):
    sub = agg[(agg.by == by) & (agg.layer == -1) & (agg.modality == "all") & (agg.point == 0)]
    check(sub.n.sum() == N, f"groups of --by {by} do not partition the samples")
# The documented bootstrap, reimplemented: one policy point at one budget, all samples and one family.
p = int(pts.index[(pts.policy == "h2o") & (pts.budget == "0.25")][0])
x = tot[tot.point == p].sort_values("sample").output_error.values
lo, hi = bootstrap(x, B, seed, "all", "all", conf)
check(abs(a_all.loc[p, "output_error_lo"] - lo) < 1e-12 and abs(a_all.loc[p, "output_error_hi"] - hi) < 1e-12,
      f"interval ({a_all.loc[p, 'output_error_lo']}, {a_all.loc[p, 'output_error_hi']}) != ({lo}, {hi})")
fam = manifest.family[0]
xs = tot[(tot.point == p) & tot["sample"].isin(np.where(manifest.family == fam)[0])].sort_values("sample").output_error.values
row = agg[(agg.by == "family") & (agg.group == fam) & (agg.layer == -1) & (agg.modality == "all") & (agg.point == p)].iloc[0]
if len(xs) > 1:
    lo, hi = bootstrap(xs, B, seed, "family", fam, conf)
    check(abs(row.output_error_lo - lo) < 1e-12 and abs(row.output_error_hi - hi) < 1e-12, "family interval")
# The CSVs hold the HDF5 tables.
c = pd.read_csv(agg_csv, dtype={"budget": str, "group": str}, keep_default_na=False, na_values=["nan"],
                float_precision="round_trip")
check(len(c) == len(agg) and np.array_equal(c.output_error_hi.values, agg.output_error_hi.values, equal_nan=True),
      "aggregate CSV")
s = pd.read_csv(samples_csv, keep_default_na=False, na_values=["nan"], float_precision="round_trip")
check(len(s) == len(sp) and np.array_equal(s.kl.values, sp.kl.values, equal_nan=True), "per-sample CSV")
if len(sys.argv) > 7:  # sample I's rows against its single-trace CSV
    one = pd.read_csv(sys.argv[6], dtype={"budget": str, "layer": str, "flags": str}, keep_default_na=False,
                      na_values=["nan"], float_precision="round_trip")
    i = int(sys.argv[7])
    mine = sp[sp["sample"] == i].merge(pts[["policy", "budget", "kind", "mode"]], left_on="point", right_index=True)
    mine["layer"] = mine.layer.map(lambda v: "all" if v == -1 else str(v))
    key = ["policy", "budget", "kind", "mode", "layer", "modality"]
    both = one.merge(mine, on=key, suffixes=("_csv", "_h5"))
    check(len(both) == len(one) == len(mine), f"sample {i}: {len(one)} CSV rows, {len(mine)} rows, {len(both)} matched")
    proxies = ["error_worst_query", "error_worst_head", "error_retrieval", "concentration", "error_propagated",
               "topk_recall", "topk_recall_min", "topk_recall_retrieval", "topk_mass", "specific_recall",
               "specific_recall_min"]
    cols = [c for c in one.columns if c + "_h5" in both.columns and c not in key]
    check(set(proxies) <= set(cols) and {"output_error", "flags", "bytes_kept"} <= set(cols), f"columns {cols}")
    for c in cols:
        a, b = both[c + "_csv"].values, both[c + "_h5"].values
        same = np.array_equal(a, b) if a.dtype.kind in "OU" else np.array_equal(a.astype(float), b.astype(float), equal_nan=True)
        check(same, f"sample {i}: /sample_points {c} differs from the single-trace CSV")
    # scripts/calibrate's open-loop side reads the same proxies from the dataset's rows as from the CSV.
    import importlib.machinery, importlib.util, os
    here = os.path.dirname(os.path.abspath(__file__))
    loader = importlib.machinery.SourceFileLoader("calibrate", os.path.join(here, "..", "..", "scripts", "calibrate"))
    spec = importlib.util.spec_from_loader("calibrate", loader)
    calibrate = importlib.util.module_from_spec(spec)
    loader.exec_module(calibrate)
    rows_csv = os.path.join(os.path.dirname(os.path.abspath(sys.argv[6])), f"sample_points_{i}.csv")
    mine[[c for c in one.columns if c in mine.columns]].to_csv(rows_csv, index=False)
    a, b = calibrate.read_sweep(sys.argv[6], i), calibrate.read_sweep(rows_csv, i)
    check(len(a) > 0 and a.equals(b), f"sample {i}: scripts/calibrate's read_sweep differs on /sample_points")
    print(f"ok   sample {i}: {len(both)} rows of /sample_points equal its single-trace CSV in {len(cols)} columns; "
          f"calibrate's read_sweep gives the same {a.shape[1]} columns for {len(a)} points")
print(f"ok   {h5}: {N} samples, {P} points, {len(sp)} per-sample rows, {len(agg)} aggregate rows")
