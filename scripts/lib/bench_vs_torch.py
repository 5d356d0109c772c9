"""kvsim sweep against a PyTorch replay of the same policies, side by side in one run (scripts/bench-vs-torch).

1. Check: kvsim's CSV and the replay (scripts/lib/torch_replay.py) must give the same numbers for every
   replayed point and layer: output error, attention recall, KL, entropy change within the tolerances
   below, and the same kept tokens per modality. Any other difference fails the run (exit 1) before
   timing, except a (point, layer) whose kept counts agree and whose selection had a near-tie (reported).
   A perturbed replay must fail the check (the check checks itself).
2. Time: REPEAT rounds, each running, in turn, `kvsim sweep` (the default 20 policies, and the replayed
   subset alone), the replay with 1 thread and with 2 threads (torch.set_num_threads), each as its own
   process; wall time and CPU seconds (user + system of the child) of each; medians. The ratio is
   kvsim's wall time against the replay's best thread count on the same replayed points.
3. Floor and ceiling: the FLOP floor of the sweep (the q.k and p.v products of the evaluation at each
   point's kept sizes, the full-cache reference and the prefill statistics, per layer and head) against
   a float32 GEMM rate measured in the same run (torch.matmul 2048^3, 1 and 2 threads, best of 3).

Every process runs with OMP_WAIT_POLICY=PASSIVE unless it is set. Markdown table on stdout, progress on
stderr.
"""

import argparse
import csv
import json
import math
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import torch_replay  # noqa: E402

# Tolerances of the check (float32 evaluation in both, different summation orders, different exp):
# relative 1e-4 on output error (|a - b| <= 1e-4 * max(|a|, |b|) + 1e-6), absolute 1e-5 on recall, KL and
# entropy change (KL of an eviction is 0 up to rounding, ~1e-9 in kvsim).
TOL_REL_ERR, TOL_ABS_ERR, TOL_ABS = 1e-4, 1e-6, 1e-5
TIE_MARGIN = 1e-5
MODS = ["text", "vision", "audio", "special"]


def log(msg):
    print(f"bench-vs-torch: {msg}", file=sys.stderr, flush=True)


def read_kvsim_csv(path):
    """{point: {layer: {metric...}}} from a kvsim sweep CSV (per-layer rows; the layer's metrics sit on
    every modality row, the kept tokens per modality on its own row)."""
    out = {}
    with open(path, newline="") as f:
        for r in csv.DictReader(f):
            if r["layer"] == "all":
                continue
            pt = out.setdefault(f"{r['policy']}@{r['budget']}", {})
            lay = pt.setdefault(int(r["layer"]), {"kept": [0, 0, 0, 0]})
            if r["modality"] == "all":
                for m in ("output_error", "attention_recall", "kl", "entropy_delta"):
                    lay[m] = float(r[m])
            else:
                lay["kept"][MODS.index(r["modality"])] = int(r["kept"])
    return out


def compare(kvsim, replay, ties=None):
    """Worst differences and the list of failures. A (point, layer) whose metrics differ beyond the tolerance
    while its kept counts agree and the replay's selection had a near-tie (relative score margin below
    TIE_MARGIN: kvsim's and torch's float32 scores may order such tokens differently) is listed in `ties`
    instead of failing."""
    worst = {"output_error": 0.0, "attention_recall": 0.0, "kl": 0.0, "entropy_delta": 0.0}
    fails = []
    for name, layers in replay.items():
        if name not in kvsim:
            fails.append(f"{name}: not in kvsim's output")
            continue
        for l, r in enumerate(layers):
            k = kvsim[name][l]
            if k["kept"] != r["kept"]:
                fails.append(f"{name} layer {l}: kept tokens per modality kvsim {k['kept']} replay {r['kept']}")
            out = []
            for m in worst:
                d = abs(k[m] - r[m])
                lim = TOL_REL_ERR * max(abs(k[m]), abs(r[m])) + TOL_ABS_ERR if m == "output_error" else TOL_ABS
                if d > lim:
                    out.append(f"{name} layer {l}: {m} kvsim {k[m]:.9g} replay {r[m]:.9g}")
                else:
                    worst[m] = max(worst[m], d)
            if out and ties is not None and k["kept"] == r["kept"] and r.get("margin", 1.0) < TIE_MARGIN:
                ties.append(f"{name} layer {l} (selection margin {r['margin']:.2g})")
            else:
                fails += out
    return worst, fails


def run_timed(cmd, env=None):
    r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    p = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wall = time.perf_counter() - t0
    r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    if p.returncode != 0:
        raise SystemExit(f"bench-vs-torch: {' '.join(cmd)} failed ({p.returncode}): {p.stderr.strip()[-2000:]}")
    cpu = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
    return wall, cpu


def gemm_rate(threads, n=2048):
    import torch
    torch.set_num_threads(threads)
    a = torch.randn(n, n)
    b = torch.randn(n, n)
    torch.matmul(a, b)
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        torch.matmul(a, b)
        best = min(best, time.perf_counter() - t0)
    return 2.0 * n ** 3 / best


def flop_floor(kvsim_points, L, Hq, H, T, S, D):
    """FLOP floor of a sweep: per layer and query head, for each point the q.k and p.v products of its
    kept sizes (step s sees K + s + 1 slots: 2 * D FLOP per slot and product), once per layer the full
    reference (K = T) and the prefill statistics (causal T x T logits: 2 D T (T + 1) / 2)."""
    steps = lambda K: sum(K + s + 1 for s in range(S))  # noqa: E731
    per_point = 0.0
    for name, layers in kvsim_points.items():
        for l, lay in layers.items():
            K = sum(lay["kept"]) / H  # kept tokens of one kv head (every head keeps the same count here)
            per_point += 2 * 2.0 * D * steps(K) * Hq
    ref = L * 2 * 2.0 * D * steps(T) * Hq
    stats = L * 2.0 * D * T * (T + 1) / 2 * Hq
    return per_point, ref, stats


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kvsim", required=True, help="kvsim binary (the wrapper passes build/bin/kvsim or $KVSIM)")
    ap.add_argument("--kvcap", required=True, help="kvcap binary, to make the trace (build/bin/kvcap or $KVCAP)")
    ap.add_argument("--trace", help="trace to sweep (default: make the synthetic llava-1.5-7b trace in --work)")
    ap.add_argument("--work", default=None, help="folder for the trace and outputs (default: a temp dir)")
    ap.add_argument("--budgets", default="0.1:0.9:0.1", help="kvsim sweep --budgets of both sides")
    ap.add_argument("--repeat", type=int, default=3, help="timed rounds (medians)")
    ap.add_argument("--threads", default="1,2", help="replay thread counts")
    ap.add_argument("--kvsim-threads", type=int, default=0, help="kvsim sweep --threads (0 = all cores)")
    ap.add_argument("--check-only", action="store_true", help="only the check (step 1), e.g. on a tiny trace")
    a = ap.parse_args()
    # Passive OpenMP waits for torch too, as kvscope's tools set for themselves (with spinning waits on a
    # loaded machine each parallel region waits for a descheduled thread; docs/perf.md).
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    work = a.work or tempfile.mkdtemp(prefix="bench-vs-torch-")
    os.makedirs(work, exist_ok=True)
    trace = a.trace
    if not trace:
        trace = os.path.join(work, "llava32.h5")
        if not os.path.exists(trace):
            log(f"making {trace}")
            subprocess.run([a.kvcap, "synth", "--preset", "llava-1.5-7b", "--images", "1", "--text", "64",
                            "--decode", "32", "-o", trace], check=True, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL)
    replayed = ",".join(torch_replay.REPLAYED)
    kv_csv = os.path.join(work, "kvsim.csv")
    kv_all = [a.kvsim, "sweep", "--trace", trace, "-q", "--alloc-search", "none", "--no-bound", "-b", a.budgets,
              "--threads", str(a.kvsim_threads)]
    kv_sub = kv_all + ["-p", replayed]
    rp = lambda n, o: [sys.executable, os.path.join(HERE, "torch_replay.py"), trace, "--threads", str(n),  # noqa: E731
                       "--budgets", a.budgets, "-o", o]
    # 1. check
    log("check: kvsim sweep (replayed policies) and the replay (1 thread)")
    subprocess.run(kv_sub + ["--csv", kv_csv], check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    rj = os.path.join(work, "replay.json")
    run_timed(rp(1, rj))
    kv = read_kvsim_csv(kv_csv)
    with open(rj) as f:
        rep = json.load(f)["points"]
    ties = []
    worst, fails = compare(kv, rep, ties)
    log(f"check done: {len(fails)} mismatches, {len(ties)} near-ties")
    n_layers = sum(len(v) for v in rep.values())
    print(f"check: {len(rep)} points, {n_layers} (point, layer) pairs; worst |kvsim - replay| outside near-ties: " +
          ", ".join(f"{k} {v:.3g}" for k, v in worst.items()))
    if ties:
        print(f"check: {len(ties)} (point, layer) pairs differ by a near-tie of the selection (same kept counts,"
              f" relative score margin < {TIE_MARGIN:g}): " + "; ".join(ties))
    print(f"replayed: {replayed}; not replayed: {', '.join(torch_replay.NOT_REPLAYED)}")
    if fails:
        for x in fails[:20]:
            print("MISMATCH " + x)
        print(f"{len(fails)} mismatches")
        return 1
    print("check: kvsim and the PyTorch replay agree within the tolerances")
    # The check itself: a replay off by more than the tolerance in any metric, or one kept token, must fail.
    some = next(iter(rep))
    for metric, delta in (("output_error", 1e-3), ("attention_recall", 1e-4), ("kl", 1e-4), ("entropy_delta", 1e-4),
                          ("kept", None)):
        bad = {some: [dict(x) for x in rep[some]]}
        if delta is None:
            bad[some][0]["kept"] = [bad[some][0]["kept"][0] + 1] + bad[some][0]["kept"][1:]
        else:
            bad[some][0][metric] += delta * max(1.0, abs(bad[some][0][metric]))
        if not compare(kv, bad)[1]:
            print(f"check: a replay with {metric} perturbed was not flagged")
            return 1
    if a.check_only:
        return 0
    # 2. time
    threads = [int(x) for x in a.threads.split(",")]
    times = {"kvsim (20 policies)": [], "kvsim (replayed)": []}
    for n in threads:
        times[f"torch {n} thread(s)"] = []
    for rep_i in range(a.repeat):
        log(f"round {rep_i + 1}/{a.repeat}")
        runs = [("kvsim (20 policies)", kv_all), ("kvsim (replayed)", kv_sub)]
        runs += [(f"torch {n} thread(s)", rp(n, os.path.join(work, f"r{n}.json"))) for n in threads]
        for key, cmd in runs:
            times[key].append(run_timed(cmd))
            log(f"{key}: wall {times[key][-1][0]:.2f} s, CPU {times[key][-1][1]:.2f} s, load {os.getloadavg()[0]:.2f}")
    med = {k: (statistics.median(w for w, _ in v), statistics.median(c for _, c in v)) for k, v in times.items()}
    # 3. floor and ceiling
    import h5py
    with h5py.File(trace, "r") as f:
        L, Hq, H, D = (int(f.attrs[x]) for x in ("num_layers", "num_q_heads", "num_kv_heads", "head_dim"))
        T = f["tokens/modality"].shape[0]
        S = f["decode/tokens/token_id"].shape[0]
    pts, ref, stats = flop_floor(kv, L, Hq, H, T, S, D)
    rates = {n: gemm_rate(n) for n in threads}
    peak = max(rates.values())
    floor = pts + ref + stats
    best_torch = min(med[f"torch {n} thread(s)"][0] for n in threads)
    print()
    print(f"trace {trace}: L {L}, Hq {Hq}, H {H}, D {D}, T {T}, S {S}; budgets {a.budgets}; {a.repeat} rounds,"
          f" medians; load average before {os.getloadavg()[0]:.2f}")
    print()
    print("| run | wall s | CPU s | floor / (wall x GEMM rate) |")
    print("|---|---|---|---|")
    for k, (w, c) in med.items():
        frac = "-" if k == "kvsim (20 policies)" else f"{floor / (w * peak) * 100:.1f} %"  # floor of the replayed points
        print(f"| {k} | {w:.2f} | {c:.2f} | {frac} |")
    print()
    print(f"ratio: torch best ({best_torch:.2f} s) / kvsim replayed ({med['kvsim (replayed)'][0]:.2f} s) = "
          f"{best_torch / med['kvsim (replayed)'][0]:.2f}x")
    print(f"FLOP floor of the replayed sweep: {floor / 1e9:.1f} GFLOP (evaluation at kept sizes {pts / 1e9:.1f},"
          f" full reference {ref / 1e9:.1f}, prefill statistics {stats / 1e9:.1f}); GEMM rate " +
          ", ".join(f"{n} thread(s) {r / 1e9:.1f} GFLOP/s" for n, r in rates.items()) +
          f"; floor at the best rate: {floor / peak:.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
