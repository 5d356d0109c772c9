"""Our C++ BpeTokenizer and ChatTemplate against Hugging Face on the real model's files.

Usage (ctest bpe_vs_hf): scripts/py tests/runner/bpe_vs_hf.py BPE_TOKENIZE_TOOL REPO_ROOT WORK_DIR

Tokenizes a corpus (the repo's docs/*.md, every file of /usr/share/common-licenses, digits, whitespace
runs, unicode, contractions, the special tokens inline, every code point in context, seeded random
strings) with HF `tokenizers.Tokenizer.from_file(<model>/tokenizer.json)` and with
`transformers.AutoTokenizer` on the model folder, and with our tool; the ids must be identical and our
decode lossless. Then ChatTemplate.render against apply_chat_template(..., tokenize=False). Prints the
first mismatch with context. Exits 77 (skip) without the model (scripts/setup imports it).
"""
import json
import os
import random
import re
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "python"))
from real_model import model_dir  # noqa: E402  (tests/python/real_model.py: where scripts/setup imports it)




SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<repo_name>", "<reponame>", "<file_sep>",
            "<filename>", "<gh_stars>", "<issue_start>", "<issue_comment>", "<issue_closed>",
            "<jupyter_start>", "<jupyter_text>", "<jupyter_code>", "<jupyter_output>", "<jupyter_script>",
            "<empty_output>"]


CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi"}],
    [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hi! How can I help?"},
     {"role": "user", "content": "Tell me a joke\nabout cats 🐱."}],
    [{"role": "system", "content": "sys"}, {"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
     {"role": "user", "content": ""}],
    [{"role": "assistant", "content": "I start."}],
]

def corpus(root):
    """[(name, text)]"""
    items = []
    for p in sorted((root / "docs").glob("*.md")):
        items.append(("docs/" + p.name, p.read_text(encoding="utf-8")))
    lic = Path("/usr/share/common-licenses")
    for p in sorted(lic.iterdir()) if lic.is_dir() else []:
        if p.is_file():
            items.append((str(p), p.read_bytes().decode("utf-8")))
    rng = random.Random(14)
    digits = ["0", "7", "42", "123456789012345678901234567890", "3.14159", "1,000,000", "-12e-3", "x1y22z333",
              "2024-12-01T21:55:00Z", " 1 22  333\t4444\n55555", "٣٤٥ ۱۲ ߁ ²³ ½ Ⅻ ① 𝟘𝟙", "a1b2c3", "1'000"]
    digits += ["".join(rng.choice("0123456789") for _ in range(n)) for n in (1, 2, 3, 4, 5, 17, 64, 1000)]
    items += [("digits %d" % i, s) for i, s in enumerate(digits)]
    spaces = [" ", "  ", "   ", "\t", "\t\t", "\n", "\n\n", "\n\n\n", "\r\n", "\r\n\r\n", " \n ", "\t \n\r\n  ",
              "\u00a0", "\u3000", "\u2003\u2009", "\x0b\x0c", "\x85"]
    ws = []
    for s in spaces:
        ws += [s, "a" + s + "b", s + "word", "word" + s, "x" + s + s + "y", s + "1" + s, s + "!" + s, "'" + s + "s"]
    ws += ["".join(rng.choice([" ", "\t", "\n", "\r\n", "a", "1", ".", "é"]) for _ in range(200))
           for _ in range(40)]
    items += [("whitespace %d" % i, s) for i, s in enumerate(ws)]
    uni = ["café naïve résumé Ångström", "e\u0301 a\u0308\u0301 n\u0303", "漢字かなカナ한국어 中文，标点。",
           "👍 👨‍👩‍👧‍👦 🇫🇷🇩🇪 ❤️ 🏳️‍🌈", "שלום עולם مرحبا بالعالم ‏RTL‎", "zero\u200bwidth\u200c\u200d\ufeffjoin",
           "Ελληνικά Русский язык ქართული हिन्दी ไทย", "\U0001F600\U0001F64F \U00010348 \U0010FFFD", "ﬁ ﬂ ß ẞ İı",
           "math: ∑∫√∞ ≤≥ ≠ ±×÷", "quotes “double” ‘single’ «guillemets» — – …", "\x00\x01\x7f controls",
           "a\x04b\x06 \x13\x14\x16\x1d!"]  # characters SmolLM2 has no token for: dropped by HF and us
    items += [("unicode %d" % i, s) for i, s in enumerate(uni)]
    contr = ["it's we're they've I'm we'll he'd don't can't", "IT'S WE'RE 'S 'Re", "'s're've'm'll'd't",
             " 's ' s '' '''s", "rock'n'roll o'clock y'all", "'" * 10, "’s curly’re"]
    items += [("contractions %d" % i, s) for i, s in enumerate(contr)]
    sp = ["".join(SPECIALS), " ".join(SPECIALS), "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
          "x<|im_end|>y", " <|im_start|> ", "<|im_start|<|im_start|>>", "<|im_end|", "<|endoftext|><|endoftext|>",
          "\n".join("%s text %d %s" % (t, i, t) for i, t in enumerate(SPECIALS))]
    items += [("special %d" % i, s) for i, s in enumerate(sp)]
    # code points after a letter, a digit, a space and punctuation: both sides of every boundary of the
    # Unicode class tables (capture/runner/src/unicode_tables.inc, made per code point from HF by
    # scripts/gen-unicode-tables) and every 16th code point (every one with KVSCOPE_BPE_ALL_CODE_POINTS=1)
    tables = (root / "capture/runner/src/unicode_tables.inc").read_text()
    edges = set()
    for lo, hi in re.findall(r"\{0x([0-9A-F]+), 0x([0-9A-F]+)\}", tables):
        lo, hi = int(lo, 16), int(hi, 16)
        edges.update((lo - 1, lo, hi, hi + 1))
    stride = 1 if os.environ.get("KVSCOPE_BPE_ALL_CODE_POINTS") else 16  # 1: all of them (3 minutes)
    cps = sorted(c for c in edges | set(range(0, 0x110000, stride))
                 if 0 <= c < 0x110000 and not 0xD800 <= c <= 0xDFFF)
    for k in range(0, len(cps), 4096):
        items.append(("code points U+%04X.." % cps[k],
                      "".join("a%s1%s %s!%s\n" % ((chr(c),) * 4) for c in cps[k:k + 4096])))
    alphabet = [" ", "  ", "\t", "\n", "\r\n", "'", "s", "re", "a", "Z", "é", "1", "23", "٣", ".", "!", "-", "漢",
                "👍", "\u0301", "\u00a0", "_", "<|im_", "|>", "<|im_end|>", "<|im_start|>", "<", ">", "|"]
    for i in range(2000):
        items.append(("random %d" % i, "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 60)))))
    return items


def main():
    tool, root, work = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
    mdir = model_dir()
    if not (mdir / "tokenizer.json").is_file():
        print("bpe_vs_hf: skipped: no model at %s (run scripts/setup to import SmolLM2-135M-Instruct)" % mdir)
        return 77
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    hf = Tokenizer.from_file(str(mdir / "tokenizer.json"))
    auto = AutoTokenizer.from_pretrained(str(mdir))
    vocab = hf.get_vocab()
    items = corpus(root)
    # the prompts the runner will feed: HF's rendering of the test conversations
    for i, chat in enumerate(CHATS):
        for gen in (False, True):
            items.append(("chat %d%s" % (i, " +prompt" if gen else ""),
                          auto.apply_chat_template(chat, tokenize=False, add_generation_prompt=gen)))
    work.mkdir(parents=True, exist_ok=True)
    paths = []
    for i, (_, text) in enumerate(items):
        p = work / ("%05d.txt" % i)
        p.write_bytes(text.encode("utf-8"))
        paths.append(str(p))
    run = subprocess.run([tool, "encode", str(mdir / "tokenizer.json")] + paths, capture_output=True, text=True)
    if run.returncode != 0:
        print("bpe_vs_hf: the tool failed: " + run.stderr.strip())
        return 1
    ours = json.loads(run.stdout)
    # Bytes the vocabulary has no token for are dropped (by HF too): decode cannot give them back.
    byte_tokens = set()
    bs = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    mapping = dict(zip(bs, bs))
    n = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = 256 + n
            n += 1
    byte_tokens = {b for b in range(256) if chr(mapping[b]) in vocab}
    failures = 0
    total_bytes = total_ids = 0
    for (name, text), got in zip(items, ours):
        enc = hf.encode(text)
        want = enc.ids
        total_bytes += len(text.encode("utf-8"))
        total_ids += len(want)
        auto_ids = auto(text, add_special_tokens=True)["input_ids"]
        if auto_ids != want:
            print("%s: transformers AutoTokenizer differs from tokenizers (%d vs %d ids)" % (name, len(auto_ids),
                                                                                          len(want)))
            failures += 1
        if got["ids"] != want:
            k = next((i for i, (a, b) in enumerate(zip(got["ids"], want)) if a != b), min(len(got["ids"]), len(want)))
            start = enc.offsets[k][0] if k < len(enc.offsets) else len(text)
            print("%s: ids differ at %d of %d/%d (text %r): HF %s, ours %s" % (
                name, k, len(want), len(got["ids"]), text[max(0, start - 20):start + 20],
                [hf.id_to_token(i) for i in want[max(0, k - 3):k + 4]],
                [hf.id_to_token(i) for i in got["ids"][max(0, k - 3):k + 4]]))
            failures += 1
            if failures > 5:
                break
        should = all(b in byte_tokens for b in text.encode("utf-8"))
        if got["lossless"] != should:
            print("%s: decode(encode(text)) == text is %s, expected %s" % (name, got["lossless"], should))
            failures += 1
    print("bpe_vs_hf: %d texts, %d bytes, %d ids; %s" % (len(items), total_bytes, total_ids, run.stderr.strip()))

    chats = CHATS
    conv_path = work / "chats.json"
    conv_path.write_text(json.dumps(chats))
    run = subprocess.run([tool, "chat", str(mdir), str(conv_path)], capture_output=True, text=True)
    if run.returncode != 0:
        print("bpe_vs_hf: the tool failed on chats: " + run.stderr.strip())
        return 1
    for chat, (without, with_gen) in zip(chats, json.loads(run.stdout)):
        for gen, got in ((False, without), (True, with_gen)):
            want = auto.apply_chat_template(chat, tokenize=False, add_generation_prompt=gen)
            if got != want:
                print("chat %s (add_generation_prompt=%s): ours %r, HF %r" % (
                    [m["role"] for m in chat], gen, got, want))
                failures += 1
    print("bpe_vs_hf: %d conversations x 2 rendered" % len(chats))
    if failures:
        print("bpe_vs_hf: FAILED (%d)" % failures)
        return 1
    print("bpe_vs_hf: ids identical to HF tokenizers and transformers, decode lossless (but for bytes without a "
          "token), chat template identical")
    return 0


if __name__ == "__main__":
    sys.exit(main())
