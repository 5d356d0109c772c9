"""kvscope: trace-driven KV-cache compression simulator (docs/python.md).

Submodules: ``kvscope.trace`` (read traces), ``kvscope.sim`` (kvsim's replay: run, sweep, results),
``kvscope.stages`` (the stage registry, custom scorers and allocators in Python), ``kvscope.select``
(one layer of a live cache through a policy, for closed loops). They need the compiled extension
``kvscope._core`` (``pip install .``, or a CMake build: ``PYTHONPATH=build/python:capture/python``, which
``scripts/py`` sets); the capture bridge modules (``kvscope.capture``, ``kvscope.bridge``, ``kvscope.hf``)
do not. Each is imported on first use, so ``import kvscope; kvscope.sim.sweep(...)`` works.
"""

import importlib as _importlib

# The extension of a CMake build lives in <build>/python/kvscope/, the Python modules in
# capture/python/kvscope/: with both folders on sys.path they form one package.
__path__ = __import__("pkgutil").extend_path(__path__, __name__)

# Submodules imported when first read as attributes (PEP 562): `import kvscope` stays light (no extension,
# no torch) and `kvscope.sim.sweep(...)` still works after it.
_SUBMODULES = ("trace", "sim", "stages", "select", "capture", "bridge", "hf", "hf_policy", "kvpress_press",
               "task_accuracy", "gguf_import", "tinyvlm")


def __getattr__(name):
    if name in _SUBMODULES:
        return _importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_SUBMODULES))
