"""kvscope.capture (ctypes binding of the C API): library lookup, a trace written through every function,
strided and float16 inputs passed through, errors as CaptureError with the library's message, incomplete
traces on abort / failed close. Needs KVSCOPE_CAPTURE_LIB (set by ctest) or build/lib; h5py to read back."""

import os
import subprocess
import sys
import tempfile
import unittest

import h5py
import numpy as np

from kvscope import capture as kc

L, HQ, HKV, D, T = 2, 4, 2, 8, 5


def open_capture(path, **kw):
    cfg = dict(num_layers=L, num_q_heads=HQ, num_kv_heads=HKV, head_dim=D, context_tokens=T,
               model_name="binding-test", max_decode_steps=4, profile=True)
    cfg.update(kw)
    return kc.Capture(path, **cfg)


def set_tokens(cap):
    cap.set_tokens([3, 1, 1, 0, 0], range(T), [1, -1, -1, 7, 8], [0, 0, 0, 1, 1], [-1, 0, 0, -1, -1],
                   [-1, 0, 1, -1, -1], ["<s>", "", "", "what", "is"])


class CaptureBindingTest(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory()
        self.rng = np.random.default_rng(3)

    def tearDown(self):
        self.tmp.cleanup()

    def path(self, name):
        return os.path.join(self.tmp.name, name)

    def test_full_trace_round_trip_with_strided_views(self):
        path = self.path("t.h5")
        # A [B, T, H, D] cache-like buffer: its [H, T, D] view of batch 0 has strides (D, H*D, 1),
        # passed as is.
        cache_k = self.rng.standard_normal((1, T, HKV, D)).astype(np.float32)
        q = self.rng.standard_normal((HQ, T, D)).astype(np.float32)
        v16 = self.rng.standard_normal((HKV, T, D)).astype(np.float16)
        k_view = cache_k[0].transpose(1, 0, 2)
        self.assertFalse(k_view.flags["C_CONTIGUOUS"])
        dec = [self.rng.standard_normal((HQ, 1, D)).astype(np.float32) for _ in range(2)]
        with open_capture(path) as cap:
            set_tokens(cap)
            for layer in range(L):
                with cap.range(f"layer {layer}"):
                    cap.prefill_layer(layer, q + layer, k_view, v16)
            cap.layer_aggregates(0, attn_colsum=np.ones((HQ, T), np.float32))
            for step in range(2):
                for layer in range(L):
                    cap.decode_layer(layer, step, dec[step], dec[step][:HKV], dec[step][:HKV])
                cap.decode_token(step, 20 + step, T + step, f"w{step}")
            stats = cap.stats()
        self.assertFalse(cap.is_open)
        self.assertEqual(stats["queue_bytes_bound"], 256 << 20)  # the documented default
        with h5py.File(path, "r") as f:
            self.assertEqual(int(f.attrs["complete"]), 1)
            self.assertEqual(f.attrs["model_name"], "binding-test")
            np.testing.assert_array_equal(f["tokens/modality"][:], [3, 1, 1, 0, 0])
            np.testing.assert_array_equal(f["tokens/grid"][:, 1], [-1, 0, 1, -1, -1])
            self.assertEqual(f["tokens/text"][3], b"what")
            np.testing.assert_array_equal(f["layers/001/q"][:], q + 1)
            np.testing.assert_array_equal(f["layers/000/k"][:], k_view)  # strides honoured
            np.testing.assert_array_equal(f["layers/000/v"][:], v16.astype(np.float32))
            np.testing.assert_array_equal(f["layers/000/attn_colsum"][:], np.ones((HQ, T)))
            np.testing.assert_array_equal(f["decode/layers/001/q"][:, 1, :], dec[1][:, 0, :])
            np.testing.assert_array_equal(f["decode/tokens/token_id"][:], [20, 21])
            self.assertEqual(f["decode/tokens/text"][1], b"w1")
            names = [r[0] for r in f["profile/ranges"][:]]
            self.assertIn(b"layer 1", names)

    def test_torch_views_and_dtypes(self):
        import torch

        path = self.path("torch.h5")
        cache = torch.randn(1, HKV, T + 3, D)  # a longer cache: the last T entries, a strided view
        q = torch.randn(1, T, HQ, D).transpose(1, 2)[0]  # [HQ, T, D], not contiguous
        with open_capture(path, dtype="float32") as cap:
            set_tokens(cap)
            for layer in range(L):
                cap.prefill_layer(layer, q, cache[0, :, -T:], cache[0, :, -T:].double())
        with h5py.File(path, "r") as f:
            np.testing.assert_array_equal(f["layers/000/q"][:], q.numpy())
            np.testing.assert_array_equal(f["layers/001/k"][:], cache[0, :, -T:].numpy())
            np.testing.assert_array_equal(f["layers/001/v"][:], cache[0, :, -T:].numpy())

    def test_argument_error_names_the_problem_and_capture_stays_usable(self):
        path = self.path("err.h5")
        with open_capture(path) as cap:
            set_tokens(cap)
            bad = np.zeros((HKV, T - 1, D), np.float32)
            good = np.zeros((HKV, T, D), np.float32)
            with self.assertRaises(kc.CaptureError) as ctx:
                cap.prefill_layer(0, np.zeros((HQ, T, D), np.float32), bad, good)
            self.assertEqual(ctx.exception.status, kc.Status.ERR_ARGUMENT)
            self.assertIn("k has shape [2, 4, 8]", str(ctx.exception))
            with self.assertRaises(kc.CaptureError) as ctx:
                cap.decode_token(1, 5, T, None)  # step 0 first
            self.assertEqual(ctx.exception.status, kc.Status.ERR_STATE)
            for layer in range(L):
                cap.prefill_layer(layer, np.zeros((HQ, T, D), np.float32), good, good)
        with h5py.File(path, "r") as f:
            self.assertEqual(int(f.attrs["complete"]), 1)
        with self.assertRaises(ValueError):
            with open_capture(self.path("x.h5")) as cap:
                cap.set_tokens([0] * (T - 1), range(T), range(T), [0] * T, [-1] * T, [-1] * T)

    def test_failed_close_and_exception_leave_trace_incomplete(self):
        path = self.path("partial.h5")
        cap = open_capture(path)
        set_tokens(cap)
        cap.prefill_layer(0, np.zeros((HQ, T, D), np.float32), np.zeros((HKV, T, D), np.float32),
                          np.zeros((HKV, T, D), np.float32))
        with self.assertRaises(kc.CaptureError) as ctx:
            cap.close()
        self.assertEqual(ctx.exception.status, kc.Status.ERR_STATE)
        self.assertIn("prefill layers not recorded: 1", str(ctx.exception))
        self.assertFalse(cap.is_open)
        with self.assertRaises(kc.CaptureError):
            cap.prefill_layer(1, np.zeros((HQ, T, D), np.float32), np.zeros((HKV, T, D), np.float32),
                              np.zeros((HKV, T, D), np.float32))  # the handle is gone: a Python-side error
        with h5py.File(path, "r") as f:
            self.assertEqual(int(f.attrs["complete"]), 0)

        path2 = self.path("raised.h5")
        with self.assertRaises(KeyError):
            with open_capture(path2) as cap:
                set_tokens(cap)
                raise KeyError("model failed")
        with h5py.File(path2, "r") as f:
            self.assertEqual(int(f.attrs["complete"]), 0)

    def test_unwritable_path_is_io_error(self):
        with self.assertRaises(kc.CaptureError) as ctx:
            open_capture(os.path.join(self.tmp.name, "no", "such", "dir", "t.h5"))
        self.assertEqual(ctx.exception.status, kc.Status.ERR_IO)

    def test_missing_library_error_names_where_it_looked(self):
        env = dict(os.environ, KVSCOPE_CAPTURE_LIB=self.path("nowhere/libkvscope_capture.so"))
        r = subprocess.run([sys.executable, "-c", "import kvscope.capture as c; c.load_library()"], env=env,
                           capture_output=True, text=True)
        self.assertNotEqual(r.returncode, 0)
        self.assertIn("CaptureLibraryNotFound", r.stderr)
        self.assertIn(self.path("nowhere/libkvscope_capture.so"), r.stderr)
        self.assertIn("KVSCOPE_CAPTURE_LIB", r.stderr)


if __name__ == "__main__":
    unittest.main()
