"""Checks a kvcap export-chrome file: json.load parses it, every record is a complete ("X")
event with numeric ts/dur in microseconds, pid/tid and args, and the named ranges exist.
Usage: check_chrome_json.py FILE NAME..."""
import json
import sys


def main():
    path, names = sys.argv[1], sys.argv[2:]
    with open(path, encoding="utf-8") as f:
        doc = json.load(f)
    events = doc["traceEvents"]
    xs = [e for e in events if e["ph"] == "X"]
    for e in xs:
        for key in ("name", "ts", "dur", "pid", "tid", "args"):
            assert key in e, f"event without {key}: {e}"
        assert isinstance(e["ts"], (int, float)) and isinstance(e["dur"], (int, float)), e
        assert e["dur"] >= 0, e
    present = {e["name"] for e in xs}
    missing = [n for n in names if n not in present]
    assert not missing, f"missing events {missing}; have {sorted(present)}"
    by_name = {e["name"]: e for e in xs}
    outer, inner = by_name.get("prefill"), by_name.get("layer 0")
    if outer and inner:  # nesting survives the conversion to microseconds
        assert outer["ts"] <= inner["ts"] and inner["ts"] + inner["dur"] <= outer["ts"] + outer["dur"] + 1e-3
        assert inner["args"]["depth"] == 1 and outer["args"]["depth"] == 0
    meta = [e for e in events if e["ph"] == "M"]
    assert any(e["name"] == "process_name" for e in meta), "no process_name metadata"
    print(f"ok: {len(xs)} X events")


if __name__ == "__main__":
    main()
