"""The type stub kvscope/_core.pyi against the built extension kvscope._core: every public name the module
exports (functions, classes, their methods and properties) is in the stub and the stub has no public name
the module lacks; every function's and method's parameter names (and which have defaults) equal the
pybind11 signature (the first line of its docstring, e.g. `read_layer(self: ..., layer: int, to_float32:
bool = False) -> tuple`). py.typed sits next to the stub.

Usage: test_stubs.py [STUB]  (default: the _core.pyi next to the imported extension)."""

import ast
import inspect
import os
import re
import sys
import unittest

from kvscope import _core

STUB = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(_core.__file__), "_core.pyi")


def public(name: str) -> bool:
    return not name.startswith("_") or name in ("__init__", "__repr__")


def split_params(text: str):
    """'a: int, b: Dict[str, int] = 1' -> [('a', False), ('b', True)] (commas inside brackets kept)."""
    out, depth, cur = [], 0, ""
    for ch in text + ",":
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        if ch == "," and depth == 0:
            if cur.strip():
                name, _, rest = cur.strip().partition(":")
                out.append((name.strip(), "=" in rest))
            cur = ""
        else:
            cur += ch
    return out


def pybind_params(obj, name: str):
    """The parameters of a pybind11 function from its docstring's signature line (None: not pybind11's)."""
    doc = (getattr(obj, "__doc__", None) or "").lstrip()
    first = doc.splitlines()[0] if doc else ""
    m = re.match(re.escape(name) + r"\((.*)\)\s*->", first)
    if not m:
        return None
    return split_params(m.group(1))


def stub_params(fn: ast.FunctionDef):
    a = fn.args
    params = a.posonlyargs + a.args
    defaults = [False] * (len(params) - len(a.defaults)) + [True] * len(a.defaults)
    out = list(zip((p.arg for p in params), defaults))
    out += [(p.arg, d is not None) for p, d in zip(a.kwonlyargs, a.kw_defaults)]
    return out


def stub_members(body):
    """name -> ('function', FunctionDef) | ('property', FunctionDef) | ('class', ClassDef) | ('value', node)."""
    out = {}
    for node in body:
        if isinstance(node, ast.FunctionDef):
            is_prop = any(isinstance(d, ast.Name) and d.id == "property" for d in node.decorator_list)
            out[node.name] = ("property" if is_prop else "function", node)
        elif isinstance(node, ast.ClassDef):
            out[node.name] = ("class", node)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            out[node.target.id] = ("value", node)
        elif isinstance(node, ast.Assign):
            for t in node.targets:
                if isinstance(t, ast.Name):
                    out[t.id] = ("value", node)
    return out


def module_names():
    return {n for n in dir(_core) if public(n) and not n.startswith("__")}


def class_members(cls):
    """Public methods and properties defined by a pybind11 class itself (not inherited from object)."""
    out = {}
    for n, v in vars(cls).items():
        if not public(n):
            continue
        if isinstance(v, property):
            out[n] = ("property", v)
        elif callable(v):
            if n == "__init__" and pybind_params(v, "__init__") is None:
                continue  # no py::init: the class is made by the module's functions only
            out[n] = ("function", v)
    return out


def compare(stub_path: str):
    """The differences between the stub and the module, as lines (empty: they agree)."""
    with open(stub_path, encoding="utf-8") as f:
        stub = stub_members(ast.parse(f.read(), stub_path).body)
    problems = []
    names = module_names()
    stub_public = {n for n in stub if public(n)}
    for n in sorted(names - stub_public):
        problems.append(f"{n}: exported by kvscope._core, missing from the stub")
    for n in sorted(stub_public - names):
        problems.append(f"{n}: in the stub, not exported by kvscope._core")

    def check_function(where, obj, fn_node, name):
        theirs = pybind_params(obj, name)
        if theirs is None:
            problems.append(f"{where}: no pybind11 signature in the docstring")
            return
        mine = stub_params(fn_node)
        if mine != theirs:
            problems.append(f"{where}: stub parameters {mine} != pybind11's {theirs}")

    for n in sorted(names & stub_public):
        obj = getattr(_core, n)
        kind, node = stub[n]
        if inspect.isclass(obj):
            if kind != "class":
                problems.append(f"{n}: a class in the module, a {kind} in the stub")
                continue
            if issubclass(obj, BaseException):
                bases = [b.id for b in node.bases if isinstance(b, ast.Name)]
                if obj.__bases__[0].__name__ not in bases:
                    problems.append(f"{n}: derives from {obj.__bases__[0].__name__}, the stub says {bases}")
                continue
            members = class_members(obj)
            smembers = {k: v for k, v in stub_members(node.body).items() if public(k)}
            for m in sorted(set(members) - set(smembers)):
                problems.append(f"{n}.{m}: in the module, missing from the stub")
            for m in sorted(set(smembers) - set(members)):
                problems.append(f"{n}.{m}: in the stub, not in the module")
            for m in sorted(set(members) & set(smembers)):
                mk, mobj = members[m]
                sk, snode = smembers[m]
                if mk != sk:
                    problems.append(f"{n}.{m}: a {mk} in the module, a {sk} in the stub")
                elif mk == "function":
                    check_function(f"{n}.{m}", mobj, snode, m)
        elif callable(obj):
            if kind != "function":
                problems.append(f"{n}: a function in the module, a {kind} in the stub")
            else:
                check_function(n, obj, node, n)
        elif kind != "value":
            problems.append(f"{n}: a value in the module, a {kind} in the stub")
    return problems


class Stubs(unittest.TestCase):
    def test_stub_matches_the_module(self):
        self.assertTrue(os.path.isfile(STUB), f"{STUB}: no stub next to the extension")
        problems = compare(STUB)
        self.assertEqual(problems, [], "\n".join(problems))
        print(f"{STUB}: {len(module_names())} names of kvscope._core, all in the stub with pybind11's "
              "parameter names")

    def test_py_typed(self):
        self.assertTrue(os.path.isfile(os.path.join(os.path.dirname(STUB), "py.typed")), "py.typed missing")

    def test_the_check_fails_on_a_broken_stub(self):
        """A stub with a renamed parameter, a missing function and an extra one is reported three times."""
        import tempfile
        with open(STUB, encoding="utf-8") as f:
            text = f.read()
        broken = text.replace("def read_layer(self, layer: int", "def read_layer(self, index: int")
        broken = re.sub(r"\ndef check_budget\([^\n]*\n", "\n", broken)
        broken += "\ndef not_in_the_module() -> None: ...\n"
        self.assertNotEqual(broken, text)
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "_core.pyi")
            with open(path, "w", encoding="utf-8") as f:
                f.write(broken)
            problems = compare(path)
        self.assertEqual(len(problems), 3, problems)
        self.assertTrue(any("TraceReader.read_layer" in p for p in problems), problems)
        self.assertTrue(any(p.startswith("check_budget:") for p in problems), problems)
        self.assertTrue(any(p.startswith("not_in_the_module:") for p in problems), problems)


if __name__ == "__main__":
    unittest.main(argv=sys.argv[:1])
