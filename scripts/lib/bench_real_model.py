"""Runner vs Hugging Face on the real model: prefill and decode tokens/s, side by side (scripts/bench-real-model).

For each prompt length the two implementations run in turn (ours, HF, ours, HF, ...) at the same thread
count: ours as a `kvrunner-bench` process (--threads N; the weights load before the timed part), HF
transformers in this process (torch.set_num_threads(N), float32, the model's default attention). Both time
one prefill over the prompt that computes the last token's logits only, then greedy decode steps that feed
the argmax back (EOS not special). The prompt is real prose: the license texts of /usr/share/common-licenses
(Debian's base-files), concatenated in name order, tokenized with the model's tokenizer.json, the first N
tokens. Both run with OMP_WAIT_POLICY=PASSIVE unless it is set (kvscope's tools default to it; with spinning
waits on a loaded machine every parallel region of a decode step waits for a descheduled thread);
--hf-default-omp-wait leaves it unset for torch.
In-run ceiling: before each pair of runs, the machine's sgemm rate at the same thread count, measured twice
in the same run: through the OpenBLAS the runner links (`kvrunner-bench --sgemm-ceiling`, 2048^3) and
through torch (`torch.mm`, 2048^3, the BLAS HF's linear layers use); the ceiling of a repetition is the
larger. Each prefill's rate is its FLOP (`prefill_flop` of kvrunner-bench: projections of every token,
causal attention over the lower triangle, the last token's logits) over its time, shown as a fraction of
that repetition's ceiling. A prefill that ran at the ceiling would be 1/f times faster than one at fraction
f of it ("most possible over HF"): 2x HF's prefill needs HF below 50 % of the ceiling.
Medians over the repetitions go to stdout as a Markdown table; progress goes to stderr.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time


def log(msg):
    print(f"bench-real-model: {msg}", file=sys.stderr, flush=True)


def prose_ids(tokenizer, n_max):
    ids = []
    lic = "/usr/share/common-licenses"
    for name in sorted(os.listdir(lic)):
        path = os.path.join(lic, name)
        if os.path.isfile(path) and not os.path.islink(path):
            with open(path, encoding="utf-8", errors="replace") as f:
                ids += tokenizer.encode(f.read()).ids
        if len(ids) >= n_max:
            break
    return ids


def hf_run(model, torch, ids, decode):
    x = torch.tensor([ids])
    with torch.inference_mode():
        t0 = time.perf_counter()
        out = model(input_ids=x, use_cache=True, logits_to_keep=1)
        prefill_s = time.perf_counter() - t0
        past = out.past_key_values
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        first = int(nxt[0, 0])
        t1 = time.perf_counter()
        for _ in range(decode):
            out = model(input_ids=nxt, past_key_values=past, use_cache=True)
            past = out.past_key_values
            nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        decode_s = time.perf_counter() - t1
    return {"prefill_s": prefill_s, "decode_s": decode_s, "next_token": first}


def torch_sgemm_ceiling(torch, n=2048, reps=3):
    a = torch.rand(n, n, dtype=torch.float32) - 0.5
    b = torch.rand(n, n, dtype=torch.float32) - 0.5
    best = 0.0
    with torch.inference_mode():
        for rep in range(reps + 1):  # rep 0 is the untimed warm-up
            t0 = time.perf_counter()
            torch.mm(a, b)
            dt = time.perf_counter() - t0
            if rep > 0:
                best = max(best, 2.0 * n ** 3 / dt)
    return best


def openblas_sgemm_ceiling(runner, threads):
    cmd = [runner, "--sgemm-ceiling", "--threads", str(threads)]
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if p.returncode != 0:
        sys.exit(f"bench-real-model: {' '.join(cmd)} failed ({p.returncode}): {p.stderr.strip()}")
    return json.loads(p.stdout.strip().splitlines()[-1])["sgemm_flops_per_s"]


def ours_run(runner, model_dir, ids_file, n, decode, threads):
    cmd = [runner, "--model", model_dir, "--ids", ids_file, "--tokens", str(n), "--decode", str(decode),
           "--threads", str(threads), "--warmup"]
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if p.returncode != 0:
        sys.exit(f"bench-real-model: {' '.join(cmd)} failed ({p.returncode}): {p.stderr.strip()}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser(prog="scripts/bench-real-model", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="the imported model folder (default: the kvscope cache's smollm2-135m-instruct)")
    ap.add_argument("--runner", help="the kvrunner-bench binary (default: build/bin/kvrunner-bench)")
    ap.add_argument("--threads", type=int, default=os.cpu_count(), help="threads for both (default: all cores)")
    ap.add_argument("--lengths", default="1024,4096", help="prompt lengths in tokens (default 1024,4096)")
    ap.add_argument("--repeat", type=int, default=3, help="runs of each per length (default 3); medians shown")
    ap.add_argument("--decode", type=int, default=32, help="decode steps after each prefill (default 32)")
    ap.add_argument("--json", help="also write every run's numbers to this file")
    ap.add_argument("--hf-default-omp-wait", action="store_true",
                    help="leave OMP_WAIT_POLICY unset for torch (libgomp's spinning default); ours stays passive")
    ap.add_argument("--default-model", help=argparse.SUPPRESS)
    ap.add_argument("--default-runner", help=argparse.SUPPRESS)
    a = ap.parse_args()
    model_dir = a.model or a.default_model
    runner = a.runner or a.default_runner
    if not model_dir or not os.path.isfile(os.path.join(model_dir, "config.json")):
        sys.exit(f"bench-real-model: {model_dir}: no imported model (run scripts/setup)")
    if not runner or not os.access(runner, os.X_OK):
        sys.exit(f"bench-real-model: {runner}: not built (cmake --build build --target kvrunner-bench)")
    lengths = [int(s) for s in a.lengths.split(",")]
    if a.threads < 1 or a.repeat < 1 or a.decode < 0 or min(lengths) < 1:
        sys.exit("bench-real-model: --threads, --repeat and the lengths must be >= 1, --decode >= 0")

    # The same OpenMP runtime setting for both: kvrunner-bench (like every kvscope tool) runs with
    # OMP_WAIT_POLICY=PASSIVE unless the user set it; torch's libgomp reads it when torch loads.
    if not a.hf_default_omp_wait:
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    import torch
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(a.threads)
    tok = Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json"))
    ids = prose_ids(tok, max(lengths))
    if len(ids) < max(lengths):
        sys.exit(f"bench-real-model: the license texts give {len(ids)} tokens, fewer than {max(lengths)}")
    log(f"{len(ids)} prose tokens; loading HF {model_dir} (float32), {a.threads} threads")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        ids_file = os.path.join(tmp, "ids.txt")
        with open(ids_file, "w") as f:
            f.write(" ".join(map(str, ids)) + "\n")
        for n in lengths:
            log(f"T = {n}: untimed HF warm-up at this length")
            hf_run(model, torch, ids[:n], 2)  # ours warms up the same way in each process (--warmup)
            for r in range(a.repeat):
                log(f"T = {n}, run {r + 1}/{a.repeat}: sgemm ceilings")
                ceil = {"openblas": openblas_sgemm_ceiling(runner, a.threads), "torch": torch_sgemm_ceiling(torch)}
                log(f"  sgemm 2048^3: OpenBLAS {ceil['openblas'] / 1e9:.1f} GFLOP/s, torch {ceil['torch'] / 1e9:.1f}"
                    f" GFLOP/s; ours")
                o = ours_run(runner, model_dir, ids_file, n, a.decode, a.threads)
                log(f"  ours: prefill {n / o['prefill_s']:.1f} tok/s, decode {o['decode_tok_s']:.2f} tok/s;"
                    f" HF")
                h = hf_run(model, torch, ids[:n], a.decode)
                log(f"  HF:   prefill {n / h['prefill_s']:.1f} tok/s, decode {a.decode / h['decode_s']:.2f} tok/s")
                runs.append({"tokens": n, "run": r, "ours": o, "hf": h, "sgemm_flops_per_s": ceil,
                             "load_1min": os.getloadavg()[0]})
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"threads": a.threads, "decode": a.decode, "runs": runs}, f, indent=1)

    core = runs[0]["ours"].get("blas_core", "?")
    loads = [r["load_1min"] for r in runs]
    print(f"threads {a.threads}, decode steps {a.decode}, {a.repeat} runs each (medians), "
          f"torch {torch.__version__}, OpenBLAS core {core}, OMP_WAIT_POLICY for HF: {os.environ.get('OMP_WAIT_POLICY', 'unset')}, "
          f"1-minute load average {min(loads):.1f}-{max(loads):.1f} after each pair\n")
    print("| prompt | ours prefill tok/s | HF prefill tok/s | ratio | ours decode tok/s | HF decode tok/s | ratio "
          "| same next token |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
    for n in lengths:
        rs = [r for r in runs if r["tokens"] == n]
        op = statistics.median(n / r["ours"]["prefill_s"] for r in rs)
        hp = statistics.median(n / r["hf"]["prefill_s"] for r in rs)
        od = statistics.median(a.decode / r["ours"]["decode_s"] for r in rs) if a.decode else 0
        hd = statistics.median(a.decode / r["hf"]["decode_s"] for r in rs) if a.decode else 0
        same = all(r["ours"]["next_token"] == r["hf"]["next_token"] for r in rs)
        # Pairwise ratios (run r of ours against run r of HF) are robust to the machine's drift.
        pr = statistics.median(r["hf"]["prefill_s"] / r["ours"]["prefill_s"] for r in rs)
        dr = statistics.median(r["hf"]["decode_s"] / r["ours"]["decode_s"] for r in rs) if a.decode else 0
        print(f"| {n} | {op:.1f} | {hp:.1f} | {pr:.2f}x | {od:.2f} | {hd:.2f} | {dr:.2f}x | {'yes' if same else 'NO'} |")
    print("\nprefill against the in-run sgemm ceiling (2048^3 at the same threads, the larger of OpenBLAS and torch;"
          " medians; FLOP per prefill from kvrunner-bench):\n")
    print("| prompt | GFLOP | OpenBLAS sgemm GFLOP/s | torch sgemm GFLOP/s | ours GFLOP/s | HF GFLOP/s "
          "| ours / ceiling | HF / ceiling | most possible over HF |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for n in lengths:
        rs = [r for r in runs if r["tokens"] == n]
        flop = rs[0]["ours"]["prefill_flop"]
        cb = statistics.median(r["sgemm_flops_per_s"]["openblas"] for r in rs)
        ct = statistics.median(r["sgemm_flops_per_s"]["torch"] for r in rs)
        ceil = [max(r["sgemm_flops_per_s"].values()) for r in rs]
        fo = statistics.median(flop / r["ours"]["prefill_s"] / c for r, c in zip(rs, ceil))
        fh = statistics.median(flop / r["hf"]["prefill_s"] / c for r, c in zip(rs, ceil))
        go = statistics.median(flop / r["ours"]["prefill_s"] for r in rs)
        gh = statistics.median(flop / r["hf"]["prefill_s"] for r in rs)
        print(f"| {n} | {flop / 1e9:.1f} | {cb / 1e9:.1f} | {ct / 1e9:.1f} | {go / 1e9:.1f} | {gh / 1e9:.1f} "
              f"| {100 * fo:.0f} % | {100 * fh:.0f} % | {1 / fh:.2f}x |")
    print("\nour prefill phases (median seconds over the runs; qkv = norm + q/k/v + RoPE, attention = KV append"
          " + attention + o_proj, mlp = norm + gate/up/down, lm_head = final norm + last-token logits):\n")
    names = ["qkv", "attention", "mlp", "lm_head"]
    print("| prompt | " + " | ".join(names) + " | total |")
    print("| ---: |" + " ---: |" * (len(names) + 1))
    for n in lengths:
        rs = [r for r in runs if r["tokens"] == n]
        cells = []
        for k in names:
            cells.append(f"{statistics.median(r['ours']['phases_s'].get(k, 0) for r in rs):.3f}")
        total = statistics.median(r["ours"]["prefill_s"] for r in rs)
        print(f"| {n} | " + " | ".join(cells) + f" | {total:.3f} |")


if __name__ == "__main__":
    main()
