"""A replay of kvsim's default sweep written the way a competent PyTorch user would write it.

Eager PyTorch, float32, batched matmuls over the kv heads (and the decode steps: one causal mask per
point instead of one call per step), one layer of the trace in memory at a time, the per-layer
statistics (prefill attention, full attention of the decode queries) computed once per layer and shared
by every point. It reproduces, for each point, the numbers `kvsim sweep` writes per layer: output error,
attention recall, KL on the survivors, entropy change and the kept tokens per modality
(docs/metrics.md, docs/policies.md), so that scripts/bench-vs-torch can check it against kvsim before
timing both.

Replayed presets (prefill mode, the default parameters of docs/policies.md): full, window, streamingllm,
h2o, snapkv, pyramidkv, tova, knorm, random, fastv, vision-stride, hybridkv, int8, int4, kivi2,
h2o+int8, snapkv+int4. Not replayed: look-m (merging into similar kept tokens), unicache and adaptive
(head merging, the UniCache score with key redundancy, density-driven modality budgets, alignment
protection, merging, int8 per head): a faithful replay of those is a re-implementation of most of kvsim.

    scripts/py scripts/lib/torch_replay.py TRACE --threads N [--policies a,b] [--budgets 0.1:0.9:0.1] -o OUT.json
"""

import argparse
import json
import math
import sys
import time

import h5py
import numpy as np
import torch

REPLAYED = ["full", "window", "streamingllm", "h2o", "snapkv", "pyramidkv", "tova", "knorm", "random", "fastv",
            "vision-stride", "hybridkv", "int8", "int4", "kivi2", "h2o+int8", "snapkv+int4"]
NOT_REPLAYED = ["look-m", "unicache", "adaptive"]
TOKEN_FREE = {"full", "int8", "int4", "kivi2"}  # ignore the budget: one point with budget '-'
VISION = 1
TEXT = 0


def lround(x):
    """C's lround for x >= 0 (half away from zero)."""
    return int(math.floor(x + 0.5))


# ---------------------------------------------------------------------------------------------- policies
def policy(name):
    base, _, quant = name.partition("+")
    p = dict(name=name, scorer=None, allocator="uniform", sinks=0, recent=0, recent_fraction=0.0,
             first_layer=0, quant=quant or None, compress=True)
    if base in ("full", "int8", "int4", "kivi2"):
        p["compress"] = False
        if base != "full":
            p["quant"] = base
    elif base == "window":
        p["scorer"] = "recency"
    elif base == "streamingllm":
        p.update(scorer="recency", sinks=4)
    elif base == "h2o":
        p.update(scorer="h2o", recent_fraction=0.5)
    elif base == "snapkv":
        p.update(scorer="snapkv", recent=32)
    elif base == "pyramidkv":
        p.update(scorer="snapkv", recent=32, allocator="pyramid")
    elif base == "tova":
        p["scorer"] = "tova"
    elif base == "knorm":
        p["scorer"] = "knorm"
    elif base == "random":
        p["scorer"] = "random"
    elif base == "fastv":
        p.update(scorer="tova", allocator="vision-only", first_layer=2)
    elif base == "vision-stride":
        p.update(scorer="stride", allocator="vision-only")
    elif base == "hybridkv":
        p.update(scorer="snapkv", allocator="hybrid", sinks=4)
    else:
        raise SystemExit(f"torch_replay: policy '{name}' is not replayed (replayed: {', '.join(REPLAYED)})")
    return p


def parse_budgets(text):
    out = []
    for item in text.split(","):
        if ":" in item:
            a, b, s = (float(x) for x in item.split(":"))
            i = 0
            while True:
                x = round(round((a + i * s) * 1e9) / 1e9, 9)
                if x > b + 1e-9:
                    break
                out.append(x)
                i += 1
        else:
            out.append(float(item))
    return out


def budget_text(x):
    return f"{x:g}"


# ---------------------------------------------------------------------------------------------- quantizers
def _encode_decode(x, mn, mx, bits, symmetric):
    """Fake quantization of x with group minima/maxima mn, mx (broadcast), as kernels/quant_math."""
    if symmetric:
        qmax = float((1 << (bits - 1)) - 1)
        lo, hi = -qmax, qmax
        amax = torch.maximum(-mn, mx)
        scale = torch.where(mn == mx, amax, amax / qmax)
        zero = torch.zeros_like(scale)
    else:
        qmax = float((1 << bits) - 1)
        lo, hi = 0.0, qmax
        scale = (mx - mn) / qmax
        zero = mn
    div = torch.where(scale > 0, scale, torch.ones_like(scale))
    v = ((x - zero) / div).clamp(lo, hi)
    i = torch.trunc(v)
    frac = v - i
    code = i + (frac >= 0.5).float() - (frac <= -0.5).float()
    return zero + code * scale


def fake_quant(x, kind, is_key):
    """x: [H, K, D] float32 context slots of each head (one QuantShape{1, K, D} per head)."""
    H, K, D = x.shape
    if kind == "int8":  # symmetric, one scale per token
        return _encode_decode(x, x.amin(-1, keepdim=True), x.amax(-1, keepdim=True), 8, True)
    if kind == "int4":  # asymmetric, groups of 32 channels of a token
        g = x.view(H, K, D // 32, 32)
        return _encode_decode(g, g.amin(-1, keepdim=True), g.amax(-1, keepdim=True), 4, False).view(H, K, D)
    if kind == "kivi2":  # 2 bits, the last 128 tokens exact; keys per channel (groups of 32 tokens), values per token
        r = min(128, K)
        q = K - r
        out = x.clone()
        if q > 0:
            if is_key:
                for a in range(0, q, 32):
                    b = min(q, a + 32)
                    blk = x[:, a:b, :]
                    out[:, a:b, :] = _encode_decode(blk, blk.amin(1, keepdim=True), blk.amax(1, keepdim=True), 2,
                                                    False)
            else:
                g = x[:, :q, :].reshape(H, q, D // 32, 32)
                out[:, :q, :] = _encode_decode(g, g.amin(-1, keepdim=True), g.amax(-1, keepdim=True), 2,
                                               False).view(H, q, D)
        return out
    raise ValueError(kind)


# ---------------------------------------------------------------------------------------------- scorers
def random_scores(seed, layer, H, T):
    h = np.arange(H, dtype=np.uint64)[:, None]
    t = np.arange(T, dtype=np.uint64)[None, :]
    with np.errstate(over="ignore"):
        x = np.uint64(seed) * np.uint64(0x100000001B3) ^ (np.uint64(layer) << np.uint64(40)) ^ (h << np.uint64(24)) ^ t
        x = x + np.uint64(0x9E3779B97F4A7C15)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        x ^= x >> np.uint64(31)
    return torch.from_numpy(((x >> np.uint64(40)).astype(np.float32) / np.float32(16777216.0)))


def key_norms(k):
    """||k_t|| as kernels::cpu::key_norms computes it (the scorer ranks by it, so near-ties must break alike):
    8 float32 partial sums over the channels, each step a fused multiply-add (emulated: exact product and
    sum in float64, rounded to float32), combined pairwise, then the remainder, then sqrt."""
    H, T, D = k.shape
    n8 = D // 8 * 8
    kd = k.double()
    acc = torch.zeros(H, T, 8, dtype=torch.float32)
    for d in range(0, n8, 8):
        x = kd[:, :, d:d + 8]
        acc = (acc.double() + x * x).float()
    s = ((acc[..., 0] + acc[..., 1]) + (acc[..., 2] + acc[..., 3])) + ((acc[..., 4] + acc[..., 5]) + (acc[..., 6] + acc[..., 7]))
    for d in range(n8, D):
        s = (s.double() + kd[:, :, d] * kd[:, :, d]).float()
    return torch.sqrt(s)


def stride_levels(grid):
    out = np.zeros(len(grid), dtype=np.float32)
    for i, (r, c) in enumerate(grid):
        if r < 0 or c < 0:
            continue
        lvl, s = 0, 2
        while s <= 1 << 12 and r % s == 0 and c % s == 0:
            lvl += 1
            s <<= 1
        out[i] = lvl
    return torch.from_numpy(out)


# ---------------------------------------------------------------------------------------------- selection
def select(scores, k, forced, cls, quotas, redistribute=True):
    """Kept token indices [H, n] (ascending) per head, as kernels::cpu::select_topk: forced tokens first;
    each class fills its quota after its forced tokens with its best candidates (score descending, index
    ascending); forced tokens above their class quota push out the worst picks; an unfilled budget goes to
    the best of the rest. scores [H, T]; forced [T] bool; cls [T] class of each token; quotas per class."""
    H, T = scores.shape
    order = torch.sort(-scores, dim=1, stable=True).indices  # best first, ties: lower index first
    f = forced[order]
    c = cls[order]
    pick = torch.zeros_like(f)
    n_forced = int(forced.sum())
    for ci, quota in enumerate(quotas):
        fin = int((forced & (cls == ci)).sum())
        m = (c == ci) & ~f
        pick |= m & ((torch.cumsum(m, 1) - 1) < max(0, quota - fin))
    pick &= (torch.cumsum(pick, 1) - 1) < (k - n_forced)
    if redistribute:
        need = k - n_forced - pick.sum(1, keepdim=True)
        rest = ~f & ~pick
        pick |= rest & ((torch.cumsum(rest, 1) - 1) < need)
    keep = torch.zeros(H, T, dtype=torch.bool)
    keep.scatter_(1, order, pick | f)
    n = int(keep.sum(1)[0])
    assert bool((keep.sum(1) == n).all()), "heads kept different counts"
    # Margin of the selection: per head and class, the relative gap between the worst picked and the best
    # passed-over candidate; a float-rounding difference of the scores can swap tokens only below it.
    ss = torch.gather(scores, 1, order)
    margin = float("inf")
    for ci in range(len(quotas)):
        pk = pick & (c == ci)
        up = ~pick & ~f & (c == ci)
        if not bool(pk.any()) or not bool(up.any()):
            continue
        lo = torch.where(pk, ss, torch.full_like(ss, float("inf"))).amin(1)
        hi = torch.where(up, ss, torch.full_like(ss, float("-inf"))).amax(1)
        ok = torch.isfinite(lo) & torch.isfinite(hi)
        if bool(ok.any()):
            gap = ((lo - hi).abs() / torch.maximum(lo.abs(), hi.abs()).clamp_min(1e-30))[ok]
            margin = min(margin, float(gap.min()))
    return torch.nonzero(keep)[:, 1].view(H, n), margin


# ---------------------------------------------------------------------------------------------- one layer
class Layer:
    """One layer's tensors (float32) and the statistics every point shares."""

    def __init__(self, f, l, G):
        g = f[f"layers/{l:03d}"]
        d = f[f"decode/layers/{l:03d}"]
        self.q = torch.from_numpy(g["q"][()].astype(np.float32))  # [Hq, T, D]
        self.k = torch.from_numpy(g["k"][()].astype(np.float32))  # [H, T, D]
        self.v = torch.from_numpy(g["v"][()].astype(np.float32))  # [H, T, D]
        self.qd = torch.from_numpy(d["q"][()].astype(np.float32))  # [Hq, S, D]
        self.kd = torch.from_numpy(d["k"][()].astype(np.float32))  # [H, S, D]
        self.vd = torch.from_numpy(d["v"][()].astype(np.float32))  # [H, S, D]
        self.G = G
        self.Hq, self.T, self.D = self.q.shape
        self.H, self.S = self.kd.shape[0], self.kd.shape[1]
        self._prefill = None

    def kv_rep(self, x):  # [H, n, D] -> [Hq, n, D] (query head j reads kv head j // G)
        return x.repeat_interleave(self.G, 0) if self.G > 1 else x

    def prefill_probs(self):  # [Hq, T, T] causal softmax of the prefill
        if self._prefill is None:
            z = torch.matmul(self.q, self.kv_rep(self.k).transpose(1, 2)) / math.sqrt(self.D)
            z.masked_fill_(torch.ones(self.T, self.T, dtype=torch.bool).triu(1), float("-inf"))
            self._prefill = torch.softmax(z, -1)
        return self._prefill

    def reduce(self, per_q):  # [Hq, T] -> [H, T] summed over the GQA group
        return per_q.view(self.H, self.G, -1).sum(1)

    def scores(self, name, layer, grid):
        if name == "recency":
            return torch.arange(self.T, dtype=torch.float32).expand(self.H, self.T)
        if name == "h2o":
            return self.reduce(self.prefill_probs().sum(1))
        if name == "tova":
            return self.reduce(self.prefill_probs()[:, -1, :])
        if name == "snapkv":
            w = min(32, self.T)
            s = self.prefill_probs()[:, self.T - w:, :].sum(1)
            s = torch.nn.functional.max_pool1d(s[:, None, :], 7, stride=1, padding=3)[:, 0, :]
            return self.reduce(s)
        if name == "knorm":
            return -key_norms(self.k)
        if name == "random":
            return random_scores(0, layer, self.H, self.T)
        if name == "stride":
            return stride_levels(grid).expand(self.H, self.T)
        raise ValueError(name)

    def full(self):
        """Reference: full attention of the decode queries over context + decode tokens 0..s."""
        kall = torch.cat([self.k, self.kd], 1)
        vall = torch.cat([self.v, self.vd], 1)
        z = torch.matmul(self.qd, self.kv_rep(kall).transpose(1, 2)) / math.sqrt(self.D)  # [Hq, S, T + S]
        z = z + self.causal(self.T)
        p = torch.softmax(z, -1)
        o = torch.matmul(p, self.kv_rep(vall))
        ent = -(p * torch.log(p.clamp_min(1e-45))).sum(-1)
        self.p_full, self.o_full, self.h_full = p, o, ent

    def causal(self, n_ctx):  # [S, n_ctx + S] additive mask: step s sees the context and decode tokens 0..s
        m = torch.zeros(self.S, n_ctx + self.S)
        m[:, n_ctx:] = torch.full((self.S, self.S), float("-inf")).triu(1)
        return m

    def evaluate(self, kept, quant, mod):
        """Metrics of one compressed cache: kept [H, K] token indices (evict executor), quantizer or None.
        Returns mean output error, recall, KL, entropy change over heads x rows."""
        H, K = kept.shape
        idx = kept[:, :, None].expand(H, K, self.D)
        kc = torch.gather(self.k, 1, idx)
        vc = torch.gather(self.v, 1, idx)
        if quant:
            kc = fake_quant(kc, quant, True)
            vc = fake_quant(vc, quant, False)
        kc = torch.cat([kc, self.kd], 1)
        vc = torch.cat([vc, self.vd], 1)
        z = torch.matmul(self.qd, self.kv_rep(kc).transpose(1, 2)) / math.sqrt(self.D) + self.causal(K)
        pc = torch.softmax(z, -1)  # [Hq, S, K + S]
        oc = torch.matmul(pc, self.kv_rep(vc))
        err = (oc - self.o_full).norm(dim=-1) / self.o_full.norm(dim=-1)
        # full probabilities of the surviving tokens, in slot order
        surv_idx = torch.cat([kept, torch.arange(self.T, self.T + self.S).expand(H, self.S)], 1)
        ps = torch.gather(self.p_full, 2, self.kv_rep(surv_idx[:, None, :]).expand(self.Hq, self.S, K + self.S))
        ps = ps.double()
        surv = ps.sum(-1)
        recall = surv / self.p_full.double().sum(-1)
        pn = ps / surv[..., None]
        lpc = torch.log_softmax(z.double(), -1)
        kl = torch.where(pn > 0, pn * (torch.log(pn.clamp_min(1e-300)) - lpc), torch.zeros_like(pn)).sum(-1)
        pcd = pc.double()
        hc = -(torch.where(pcd > 0, pcd * lpc, torch.zeros_like(pcd))).sum(-1)
        dent = hc - self.h_full.double()
        return dict(output_error=float(err.double().mean()), attention_recall=float(recall.mean()),
                    kl=float(kl.mean()), entropy_delta=float(dent.mean()))


def kept_set(p, keep, layer, L, lay, modality, grid, n_mod):
    """Kept indices [H, K] of policy p at keep fraction `keep` in this layer, and the selection's margin."""
    T, H = lay.T, lay.H
    all_kept = torch.arange(T).expand(H, T)
    if not p["compress"] or keep >= 1.0:
        return all_kept, float("inf")
    vision_only = p["allocator"] == "vision-only"
    if vision_only and layer < p["first_layer"]:
        return all_kept, float("inf")
    frac = keep
    if p["allocator"] == "pyramid" and L > 1:
        frac = keep * (1.0 + 0.5 * (1.0 - 2.0 * layer / (L - 1)))
    frac = min(max(frac, 0.0), 1.0)
    k = min(max(lround(frac * T), 1), T)
    sinks, recent = min(p["sinks"], T), min(p["recent"], T)
    recent = max(recent, lround(p["recent_fraction"] * k))
    t = torch.arange(T)
    forced = (t < sinks) | (t >= T - recent)
    if vision_only:
        forced |= modality != VISION
    cls = torch.zeros(T, dtype=torch.long)
    quotas = [k]
    if p["allocator"] == "hybrid":
        cls = modality.long()
        k_text = min(n_mod[TEXT], lround(0.5 * k))
        rest = k - k_text
        others = sum(n_mod[m] for m in range(4) if m != TEXT)
        quotas = [0] * 4
        quotas[TEXT] = k_text
        given = 0
        for m in range(4):
            if m == TEXT:
                continue
            quotas[m] = int(math.floor(rest * n_mod[m] / others)) if others else 0
            given += quotas[m]
        quotas[VISION] += rest - given
    n_forced = int(forced.sum())
    if n_forced > k:
        if p["allocator"] == "hybrid":
            k = 0
            for m in range(4):
                quotas[m] = max(quotas[m], int((forced & (modality == m)).sum()))
                k += quotas[m]
        else:
            k = n_forced
            quotas = [k]
    if k >= T:
        return all_kept, float("inf")
    return select(lay.scores(p["scorer"], layer, grid), k, forced, cls, quotas)


def replay(trace, policies, budgets, threads, log=None):
    torch.set_num_threads(threads)
    with h5py.File(trace, "r") as f:
        L = int(f.attrs["num_layers"])
        Hq = int(f.attrs["num_q_heads"])
        H = int(f.attrs["num_kv_heads"])
        modality = torch.from_numpy(f["tokens/modality"][()].astype(np.int64)).to(torch.uint8)
        grid = f["tokens/grid"][()]
        pos = f["tokens/position"][()]
        if not np.array_equal(pos, np.arange(len(pos))):
            raise SystemExit(f"torch_replay: {trace}: positions are not 0..T-1 (the replay's causal mask is by index)")
        n_mod = [int((modality == m).sum()) for m in range(4)]
        points = []
        for name in policies:
            p = policy(name)
            if name in TOKEN_FREE:
                points.append((p, "-", 1.0))
            else:
                points += [(p, budget_text(b), b) for b in budgets]
        res = {f"{p['name']}@{bt}": [] for p, bt, _ in points}
        for l in range(L):
            lay = Layer(f, l, Hq // H)
            lay.full()
            for p, bt, keep in points:
                kept, margin = kept_set(p, keep, l, L, lay, modality, grid, n_mod)
                m = lay.evaluate(kept, p["quant"], modality)
                m["margin"] = margin if math.isfinite(margin) else 1.0
                km = modality[kept]
                m["kept"] = [int((km == c).sum()) for c in range(4)]
                res[f"{p['name']}@{bt}"].append(m)
            if log:
                log(f"layer {l + 1}/{L}")
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--policies", default=",".join(REPLAYED))
    ap.add_argument("--budgets", default="0.1:0.9:0.1")
    ap.add_argument("-o", "--output", required=True, help="JSON: {point: [per-layer metrics]} and the timing")
    a = ap.parse_args()
    t0 = time.perf_counter()
    c0 = time.process_time()
    res = replay(a.trace, a.policies.split(","), parse_budgets(a.budgets), a.threads)
    out = dict(points=res, wall_s=time.perf_counter() - t0, cpu_s=time.process_time() - c0, threads=a.threads)
    with open(a.output, "w") as fo:
        json.dump(out, fo)


if __name__ == "__main__":
    sys.exit(main())
