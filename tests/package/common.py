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


def assert_same_results(got, kvsim):
    """The package's frame against kvsim's CSV of the same run: the same rows and columns, the numbers equal up
    to float32 rounding. Two processes may sum a float32 row in another order (the BLAS and SIMD paths can
    depend on the machine and the buffers' addresses): on one CI machine entropy_delta differed by 1.3e-7."""
    import pandas as pd

    pd.testing.assert_frame_equal(got, kvsim, check_exact=False, rtol=1e-5, atol=1e-6)
