"""kvrunner-bench: one JSON object per repetition with the documented fields (prefill_flop as docs/perf.md counts
it), the --sgemm-ceiling object, and bad arguments refused with exit 2 and one line. Usage: runner_bench_smoke.py KVRUNNER_BENCH"""
import json
import subprocess
import sys

exe = sys.argv[1]
p = subprocess.run([exe, "--synthetic", "smollm2-135m", "--tokens", "70", "--decode", "2", "--repeat", "2",
                    "--threads", "2", "--warmup"], capture_output=True, text=True, timeout=600)
assert p.returncode == 0, p.stderr
rows = [json.loads(line) for line in p.stdout.splitlines()]
assert len(rows) == 2, p.stdout
for r in rows:
    assert r["tokens"] == 70 and r["decode_steps"] == 2 and r["threads"] == 2 and r["device"] == "cpu", r
    assert r["prefill_s"] > 0 and r["decode_s"] > 0 and abs(r["prefill_tok_s"] - 70 / r["prefill_s"]) < 1e-2 * r["prefill_tok_s"], r
    assert set(r["phases_s"]) == {"qkv", "attention", "mlp", "lm_head"}, r
    assert 0 <= r["next_token"] < 49152, r
    # 70 tokens: projections 212.3 MFLOP a token, causal attention 30 x 9 x 4 x 64 x 70 x 71 / 2, the logits
    want = 70 * 30 * 2 * 576 * (2 * 576 + 2 * 192 + 3 * 1536) + 30 * 9 * 4 * 64 * 70 * 71 / 2 + 2 * 576 * 49152
    assert abs(r["prefill_flop"] - want) < 1e-5 * want, (r["prefill_flop"], want)
assert rows[0]["next_token"] == rows[1]["next_token"], rows
p = subprocess.run([exe, "--sgemm-ceiling", "--threads", "1"], capture_output=True, text=True, timeout=600)
assert p.returncode == 0, p.stderr
c = json.loads(p.stdout)
assert c["sgemm_n"] == 2048 and c["threads"] == 1 and c["sgemm_flops_per_s"] > 1e8 and c["blas_core"], c
for bad in (["--sgemm-ceiling", "--model", "x"], ["--synthetic", "smollm2-135m"], ["--model", "x"], ["--synthetic", "other", "--tokens", "4"],
            ["--tokens", "x", "--synthetic", "smollm2-135m"], ["--frobnicate"],
            ["--device", "tpu", "--synthetic", "smollm2-135m", "--tokens", "4"]):
    p = subprocess.run([exe] + bad, capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and p.stdout == "" and len(p.stderr.strip().splitlines()) == 1, (bad, p)
    assert p.stderr.startswith("kvrunner-bench: "), (bad, p.stderr)
# --device cuda: runs on a GPU machine (no phases_s: the kernels are asynchronous), else one line and exit 2.
p = subprocess.run([exe, "--synthetic", "smollm2-135m", "--tokens", "8", "--decode", "1", "--device", "cuda"],
                   capture_output=True, text=True, timeout=600)
if p.returncode == 0:
    r = json.loads(p.stdout)
    assert r["device"] == "cuda" and "phases_s" not in r and r["prefill_s"] > 0, r
    print("kvrunner-bench smoke: --device cuda ran")
else:
    last = p.stderr.strip().splitlines()[-1]  # after the "random weights of ..." progress line
    assert p.returncode == 2 and p.stdout == "" and last.startswith("kvrunner-bench: --device cuda: "), p
    print("kvrunner-bench smoke: --device cuda without a GPU: " + last)
print("kvrunner-bench smoke: ok")
