"""The compiled extension kvscope._core, with a clear error when it is not built."""

import os

try:
    from kvscope import _core  # noqa: F401
except ImportError as exc:  # pragma: no cover - depends on the installation
    # scripts/py sets KVSCOPE_CORE_MISSING when its build folder has no extension: one line naming the folder
    # and saying to run scripts/build
    if os.environ.get("KVSCOPE_CORE_MISSING"):
        raise ImportError(os.environ["KVSCOPE_CORE_MISSING"]) from exc
    raise ImportError(
        "kvscope's compiled extension kvscope._core is not importable (" + str(exc) + "): install the "
        "package with `pip install .` from the kvscope repository, or build it (scripts/build) and put "
        "<build>/python and capture/python on PYTHONPATH"
    ) from exc

core = _core

__all__ = ["core"]
