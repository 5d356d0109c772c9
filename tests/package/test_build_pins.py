"""`pip install .`'s build requirements (pyproject.toml [build-system] requires) are exact pins (name==version),
equal to requirements.lock's version wherever the lock lists the same package, and docs/python.md names the
versions pip fetches. Fails on a range (>=), a missing pin, or a lock / docs that disagree."""

import re
import sys
import unittest
from pathlib import Path

try:
    import tomllib
except ImportError:  # Python < 3.11
    print("SKIPPED: tomllib needs Python 3.11")
    sys.exit(77)

REPO = Path(__file__).resolve().parents[2]


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


class BuildPins(unittest.TestCase):
    def setUp(self):
        self.requires = tomllib.loads((REPO / "pyproject.toml").read_text())["build-system"]["requires"]
        self.lock = {}
        for line in (REPO / "requirements.lock").read_text().splitlines():
            line = line.split("#", 1)[0].strip()
            if line:
                name, version = line.split("==")
                self.lock[canonical(name)] = version

    def pins(self):
        out = {}
        for req in self.requires:
            m = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)==([0-9][0-9A-Za-z.+!-]*)", req.strip())
            self.assertIsNotNone(m, f"pyproject.toml build requirement {req!r} is not an exact pin (name==version)")
            out[canonical(m.group(1))] = m.group(2)
        return out

    def test_exact_pins(self):
        pins = self.pins()
        self.assertEqual(set(pins), {"scikit-build-core", "pybind11"})

    def test_consistent_with_the_lock(self):
        for name, version in self.pins().items():
            if name in self.lock:
                self.assertEqual(self.lock[name], version, f"{name}: pyproject.toml {version}, requirements.lock "
                                                           f"{self.lock[name]}")

    def test_docs_name_the_pinned_versions(self):
        text = (REPO / "docs" / "python.md").read_text()
        for name, version in self.pins().items():
            self.assertIn(f"{name} {version}", text, f"docs/python.md does not say {name} {version}")


if __name__ == "__main__":
    unittest.main()
