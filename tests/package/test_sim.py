"""kvscope.sim: the same results as kvsim (its CSV, its HDF5 file), progress, the GIL, errors."""

import os
import sys
import threading
import unittest

import h5py
import pandas as pd

import kvscope.sim as ks
import kvscope.trace as kt
from common import FINE, SYNTH, assert_same_results, kvsim_csv, scratch


class SimTest(unittest.TestCase):
    def test_sweep_equals_kvsim_sweep(self):
        pols, budgets = "h2o,snapkv,streamingllm,int8,h2o+int8", "0.2,0.5"
        res = ks.sweep(FINE, pols.split(","), [0.2, 0.5])
        ref = kvsim_csv("sweep", "--trace", FINE, "--policies", pols, "--budgets", budgets)
        self.assertEqual(list(res.df.columns), list(ref.columns))
        assert_same_results(res.df, ref)
        # the bound and the allocation search rows are there, as in kvsim
        self.assertEqual(set(res.df["kind"]), {"policy", "bound", "search"})
        # a string list and kvsim's range syntax give the same points
        again = ks.sweep(kt.open(FINE), pols, "0.2:0.5:0.3", bound=False, alloc_search=None)
        self.assertEqual(set(again.df["kind"]), {"policy"})
        assert_same_results(again.df.reset_index(drop=True), ref[ref["kind"] == "policy"].reset_index(drop=True))

    def test_run_equals_kvsim_run(self):
        for policy, budget, text in [("snapkv", 0.3, "snapkv@0.3"), ("h2o~decode", "24tok", "h2o~decode@24tok")]:
            res = ks.run(SYNTH, policy, budget)
            assert_same_results(res.df, kvsim_csv("run", "--trace", SYNTH, "--policy", text))
        self.assertEqual(ks.run(SYNTH, "knorm@0.4").df.shape, kvsim_csv("run", "--trace", SYNTH, "--policy", "knorm@0.4").shape)
        # a budget-free policy ignores a budget with a warning, as kvsim run
        res = ks.run(SYNTH, "int8", 0.5)
        self.assertIn("'int8' ignores the budget '0.5'", res.warnings)
        self.assertEqual(set(res.df["budget"]), {"-"})

    def test_policy_parameters(self):
        p = ks.policy("snapkv", snap_window=8, rename="snap8")
        self.assertEqual(p.name, "snap8")
        self.assertEqual(p.params["snap_window"], "8")
        self.assertEqual(p.stages["scorer"], "snapkv")
        res = ks.sweep(FINE, [p, "snapkv"], [0.8], bound=False, alloc_search=None)  # above the forced recent 32
        rows = res.df[(res.df["layer"] == "all") & (res.df["modality"] == "all")].set_index("policy")
        self.assertNotEqual(rows.loc["snap8", "output_error"], rows.loc["snapkv", "output_error"])
        self.assertIn("h2o", ks.policies())
        self.assertIn("snap_window", dict(ks.parameters()))
        self.assertEqual(ks.budgets("0.1:0.3:0.1,512tok"), ["0.1", "0.2", "0.3", "512tok"])

    def test_results_files(self):
        res = ks.sweep(FINE, ["h2o", "int4"], [0.3], bound=False, alloc_search=None)
        with scratch() as d:
            h5 = os.path.join(d, "r.h5")
            ks.write_results(res, h5)
            with h5py.File(h5) as f:
                self.assertEqual(f.attrs["format"], "kvscope-results")
                self.assertEqual(f.attrs["trace_path"], FINE)
            csv = os.path.join(d, "r.csv")
            ks.write_results(res, csv)
            pd.testing.assert_frame_equal(pd.read_csv(csv, keep_default_na=False, na_values=["nan"]), res.df)
            self.assertFalse(os.path.exists(csv + ".partial"))
            with self.assertRaises(ks.ReportError) as e:
                ks.write_results(res, os.path.join(d, "missing-dir", "r.h5"))
            self.assertIn("missing-dir", str(e.exception))
        pts = res.points()
        self.assertEqual([p["policy"] for p in pts], ["h2o", "int4"])
        self.assertIn("h2o", res.table())

    def test_progress_callback(self):
        seen = []
        ks.sweep(FINE, ["h2o", "tova"], [0.2, 0.4], bound=False, alloc_search=None, progress=lambda d, t: seen.append((d, t)))
        self.assertTrue(seen)
        total = seen[-1][1]
        self.assertEqual(seen[-1][0], total)
        self.assertEqual(total, 4 * 4)  # 4 points x 4 layers
        self.assertEqual([d for d, _ in seen], sorted(d for d, _ in seen))

        def boom(done, total):
            raise KeyError("stop here")

        with self.assertRaises(KeyError):
            ks.run(FINE, "h2o", 0.3, progress=boom)
        ks.run(FINE, "h2o", 0.3, progress=True)  # tqdm or a line on stderr

    def test_progress_in_a_notebook_without_ipywidgets(self):
        # What a Jupyter user without ipywidgets sees (docs/python.md): tqdm.auto finds a notebook kernel
        # (ipykernel's shell, stubbed here), no IProgress widget, warns once (TqdmWarning) and kvscope's bar is
        # tqdm's text bar on stderr, which the notebook shows under the cell.
        try:
            import tqdm  # noqa: F401
        except ImportError:
            self.skipTest("tqdm is not installed (it is in kvscope's environment)")
        import subprocess

        code = """
import sys, types, warnings
class ZMQInteractiveShell: pass
ipython = types.ModuleType("IPython"); ipython.get_ipython = lambda: ZMQInteractiveShell()
sys.modules.update({"IPython": ipython, "ipykernel": types.ModuleType("ipykernel"),
                    "ipykernel.zmqshell": types.ModuleType("ipykernel.zmqshell"), "ipywidgets": None})
import kvscope.sim as ks
with warnings.catch_warnings(record=True) as w:
    warnings.simplefilter("always")
    ks.sweep(sys.argv[1], ["h2o"], [0.2, 0.4], bound=False, alloc_search=None, progress=True)
import tqdm.auto
import tqdm.std
mro = {c.__module__ for c in tqdm.auto.tqdm.__mro__}
print("widget" if "tqdm.notebook" in mro else "text" if tqdm.std.tqdm in tqdm.auto.tqdm.__mro__ else "other")
print([f"{type(x.message).__name__}: {x.message}" for x in w])
"""
        r = subprocess.run([sys.executable, "-c", code, FINE], capture_output=True, text=True, timeout=300)
        self.assertEqual(r.returncode, 0, r.stderr)
        bar_modules, warned = r.stdout.strip().splitlines()
        self.assertEqual(bar_modules, "text")  # tqdm.std's bar, not tqdm.notebook's widget
        self.assertRegex(warned, r"^\['TqdmWarning: IProgress not found. Please update jupyter and ipywidgets\.")
        self.assertIn("sweep: 100%|", r.stderr)  # the text bar, at its end: 8 of 8 steps
        self.assertIn("| 8/8 [", r.stderr)

    def test_gil_released_while_cpp_runs(self):
        # With a switch interval far longer than the test, a thread holding the GIL keeps it: the main thread,
        # woken by the first progress report, can only run before the sweep ends if C++ released the GIL.
        # Without the release that never happens; with it, it needs the OS to schedule the main thread inside
        # the sweep (a few tens of ms), which a loaded machine may not do at once, so a few sweeps are tried.
        def main_ran_inside_a_sweep():
            woke, counts, seen_at_wake = threading.Event(), [], []

            def progress(done, total):
                counts.append(done)
                woke.set()

            t = threading.Thread(
                target=ks.sweep,
                args=(FINE, ["h2o", "snapkv", "tova", "knorm"], [i / 20 for i in range(1, 20)]),
                kwargs=dict(bound=False, alloc_search=None, progress=progress, threads=1),
            )
            t.start()
            woke.wait(60)
            seen_at_wake.append(len(counts))
            t.join()
            return seen_at_wake[0] < len(counts)

        old = sys.getswitchinterval()
        sys.setswitchinterval(100.0)
        try:
            ran = any(main_ran_inside_a_sweep() for _ in range(20))
        finally:
            sys.setswitchinterval(old)
        self.assertTrue(ran, "in 20 sweeps the main thread only ran after the sweep ended")

    def test_errors_carry_the_cpp_message(self):
        with self.assertRaises(ks.TraceError) as e:
            ks.sweep("/nonexistent.h5", ["h2o"], [0.3])
        self.assertIn("/nonexistent.h5", str(e.exception))
        with self.assertRaises(ks.PolicyError) as e:
            ks.sweep(FINE, ["h2o", "no-such-policy"], [0.3])
        self.assertIn("no-such-policy", str(e.exception))
        self.assertIn("snapkv", str(e.exception))  # the message lists the valid names
        for bad in ["1.5", "-3tok", "lots", "0"]:
            with self.assertRaises(ks.PolicyError, msg=bad) as e:
                ks.run(FINE, "h2o", bad)
            self.assertIn(bad, str(e.exception))
        with self.assertRaises(ks.PolicyError) as e:
            ks.run(FINE, "h2o")
        self.assertIn("needs a budget", str(e.exception))
        with self.assertRaises(ks.PolicyError):
            ks.policy("snapkv", snap_window=-4)
        with self.assertRaises(ks.PolicyError):
            ks.policy("snapkv", no_such_key=1)
        with self.assertRaises(ks.PolicyError):
            ks.sweep(FINE, [], [0.3])
        with self.assertRaises(TypeError):
            ks.run(FINE, 42, 0.3)
        with self.assertRaises(ks.PolicyError):
            ks.sweep(FINE, ["h2o"], [0.3], alloc_search="int8")


if __name__ == "__main__":
    unittest.main()
