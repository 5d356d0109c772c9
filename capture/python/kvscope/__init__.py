"""kvscope: trace-driven KV-cache compression simulator (docs/python.md).

Submodules: ``kvscope.trace`` (read traces), ``kvscope.sim`` (kvsim's replay: run, sweep, results),
``kvscope.stages`` (the stage registry, custom scorers and allocators in Python), ``kvscope.select``
(one layer of a live cache through a policy, for closed loops). They need the compiled extension
``kvscope._core`` (``pip install .``, or a CMake build: ``PYTHONPATH=build/python:capture/python``); the
capture bridge modules (``kvscope.capture``, ``kvscope.bridge``, ``kvscope.hf``) do not.
"""

# The extension of a CMake build lives in <build>/python/kvscope/, the Python modules in
# capture/python/kvscope/: with both folders on sys.path they form one package.
__path__ = __import__("pkgutil").extend_path(__path__, __name__)
