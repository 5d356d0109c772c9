"""Runs the ```python blocks of a markdown page in order, in one namespace, from the repository root (the
page's example session must work as written). Blocks after a line `<!-- not run -->` are skipped."""

import re
import sys


def blocks(text: str):
    skip = False
    for m in re.finditer(r"(<!-- not run -->\s*)?```python\n(.*?)```", text, re.S):
        skip = bool(m.group(1))
        if not skip:
            yield m.group(2)


def main(path: str) -> int:
    with open(path) as f:
        text = f.read()
    ns: dict = {"__name__": "__docs__"}
    n = 0
    for n, code in enumerate(blocks(text), 1):
        try:
            exec(compile(code, f"{path} block {n}", "exec"), ns)
        except Exception:
            print(f"{path}: block {n} failed:\n{code}", file=sys.stderr)
            raise
    if n == 0:
        print(f"{path}: no python blocks", file=sys.stderr)
        return 1
    print(f"{path}: {n} blocks ran")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
