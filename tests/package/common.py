"""Shared by the kvscope package tests: repository paths, kvsim, scratch folders."""

import os
import subprocess
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TRACES = os.path.join(REPO, "traces")
FINE = os.path.join(TRACES, "tiny-shapes-fine.h5")  # float32 capture, text and vision tokens
TWO = os.path.join(TRACES, "tiny-shapes-two.h5")  # float32 capture, two images
SYNTH = os.path.join(TRACES, "tiny-synth.h5")  # float16 synthetic trace
KVSIM = os.environ.get("KVSCOPE_KVSIM", os.path.join(REPO, "build", "bin", "kvsim"))


def scratch() -> tempfile.TemporaryDirectory:
    return tempfile.TemporaryDirectory(prefix="kvscope-pytest-")


def kvsim_csv(*args: str):
    """Runs kvsim with `args` plus --csv FILE -q and returns the CSV as pandas reads it."""
    import pandas as pd

    with scratch() as d:
        out = os.path.join(d, "r.csv")
        subprocess.run([KVSIM, *args, "--csv", out, "-q"], check=True, stdout=subprocess.DEVNULL)
        return pd.read_csv(out, keep_default_na=False, na_values=["nan"])
