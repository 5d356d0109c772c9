"""The real model for the Hugging Face tests: where scripts/setup imports SmolLM2-135M-Instruct, and
skipping (ctest's exit code 77) with one line when it is not there."""
import os
import sys
from pathlib import Path


def model_dir() -> Path:
    cache = os.environ.get("KVSCOPE_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "kvscope")
    return Path(cache) / "models" / "smollm2-135m-instruct"


def require_model() -> Path:
    model = model_dir()
    if not (model / "kvscope-import.json").exists():
        print(f"SKIPPED: {model} not found (scripts/setup imports SmolLM2-135M-Instruct there; it needs PyPI)")
        sys.exit(77)
    return model
