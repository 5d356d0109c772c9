"""kvrunner-bench: one JSON object per repetition with the documented fields, and bad arguments refused with
exit 2 and one line. Usage: runner_bench_smoke.py KVRUNNER_BENCH"""
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
    assert r["tokens"] == 70 and r["decode_steps"] == 2 and r["threads"] == 2, r
    assert r["prefill_s"] > 0 and r["decode_s"] > 0 and abs(r["prefill_tok_s"] - 70 / r["prefill_s"]) < 1e-2 * r["prefill_tok_s"], r
    assert set(r["phases_s"]) == {"qkv", "attention", "mlp", "lm_head"}, r
    assert 0 <= r["next_token"] < 49152, r
assert rows[0]["next_token"] == rows[1]["next_token"], rows
for bad in (["--synthetic", "smollm2-135m"], ["--model", "x"], ["--synthetic", "other", "--tokens", "4"],
            ["--tokens", "x", "--synthetic", "smollm2-135m"], ["--frobnicate"]):
    p = subprocess.run([exe] + bad, capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and p.stdout == "" and len(p.stderr.strip().splitlines()) == 1, (bad, p)
    assert p.stderr.startswith("kvrunner-bench: "), (bad, p.stderr)
print("kvrunner-bench smoke: ok")
