"""Accuracy of the uncompressed model on kvscope's long-context tasks, with Hugging Face transformers.

Reads the JSON lines of `kvcap tasks` (docs/tasks.md), renders each sample as the model's chat prompt
(tokenizer.apply_chat_template, generation prompt, then the answer prefix pre-filled in the assistant turn),
greedy-decodes --max-new tokens and scores exact match as kvscope does (leading whitespace skipped, the
answer, then the end or a character that is neither a letter nor a digit).

    scripts/py -m kvscope.task_accuracy --model DIR --jsonl passkey-1024.jsonl [--threads 1]

Prints one line per file: task, length, samples, accuracy, mean prompt tokens (chat template included),
mean user-message tokens, seconds.
"""

import argparse
import json
import sys
import time


def matches(generated: str, answer: str) -> bool:
    g = generated.lstrip()
    if not g.startswith(answer):
        return False
    rest = g[len(answer):]
    return rest == "" or not rest[0].isalnum()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--jsonl", required=True, nargs="+")
    ap.add_argument("--max-new", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--offset", type=int, default=0, help="skip the first N samples of each file")
    ap.add_argument("--limit", type=int, default=0, help="then at most N samples of each file (0: all)")
    ap.add_argument("--answers", help="write per-sample results (JSON lines) here")
    args = ap.parse_args(argv)

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(args.threads)
    tok = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.float32)
    model.eval()
    out = open(args.answers, "a" if args.offset else "w") if args.answers else None
    for path in args.jsonl:
        samples = [json.loads(line) for line in open(path)]
        samples = samples[args.offset:]
        if args.limit:
            samples = samples[: args.limit]
        if not samples:
            continue
        hits, ptoks, utoks = 0, 0, 0
        t0 = time.time()
        for s in samples:
            text = tok.apply_chat_template([{"role": "user", "content": s["user"]}], tokenize=False,
                                           add_generation_prompt=True) + s["answer_prefix"]
            ids = tok(text, return_tensors="pt", add_special_tokens=False).input_ids
            ptoks += ids.shape[1]
            utoks += len(tok(s["user"], add_special_tokens=False).input_ids)
            with torch.no_grad():
                gen = model.generate(ids, max_new_tokens=args.max_new, do_sample=False,
                                     attention_mask=torch.ones_like(ids), pad_token_id=tok.eos_token_id)
            g = tok.decode(gen[0, ids.shape[1]:], skip_special_tokens=False)
            ok = matches(g, s["answer"])
            hits += ok
            if out:
                out.write(json.dumps({"task": s["task"], "length": s["length"], "index": s["index"],
                                      "depth": s["depth"], "answer": s["answer"], "generated": g,
                                      "correct": ok}) + "\n")
                out.flush()
        n = max(1, len(samples))
        print(f"{samples[0]['task']} length {samples[0]['length']}: {len(samples)} samples, accuracy "
              f"{hits / n:.3f}, prompt tokens {ptoks / n:.0f}, user tokens {utoks / n:.0f}, "
              f"{time.time() - t0:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
