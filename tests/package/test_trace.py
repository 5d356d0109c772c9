"""kvscope.trace: header, geometry, tokens as a DataFrame, one layer's tensors, errors."""

import os
import unittest

import h5py
import numpy as np

import kvscope.trace as kt
from common import FINE, SYNTH, scratch


class TraceTest(unittest.TestCase):
    def test_geometry_and_header(self):
        t = kt.open(FINE)
        g = t.geometry
        self.assertEqual((g.num_layers, g.num_q_heads, g.num_kv_heads, g.head_dim), (4, 4, 2, 32))
        self.assertEqual(g.group_size, 2)
        self.assertEqual(g.model_name, "tiny-shapes")
        self.assertEqual(t.dtype, "float32")
        self.assertEqual(kt.open(SYNTH).dtype, "float16")
        self.assertTrue(t.header["complete"])
        with h5py.File(FINE) as f:
            self.assertEqual(t.num_tokens, f["tokens/modality"].shape[0])
            self.assertEqual(t.num_decode_steps, f["decode/layers/000/q"].shape[1])

    def test_tokens_frame(self):
        t = kt.open(FINE)
        df = t.tokens()
        self.assertEqual(len(df), t.num_tokens)
        for col in ["token_id", "position", "modality", "modality_code", "segment", "grid_row", "grid_col", "role"]:
            self.assertIn(col, df.columns)
        with h5py.File(FINE) as f:
            np.testing.assert_array_equal(df["modality_code"].to_numpy(), f["tokens/modality"][()])
            np.testing.assert_array_equal(df["position"].to_numpy(), f["tokens/position"][()])
            np.testing.assert_array_equal(df["grid_row"].to_numpy(), f["tokens/grid"][()][:, 0])
            np.testing.assert_array_equal(df["grid_col"].to_numpy(), f["tokens/grid"][()][:, 1])
        self.assertEqual(set(df["modality"].cat.categories), set(kt.MODALITIES))
        self.assertGreater((df["modality"] == "vision").sum(), 0)
        self.assertGreater((df["modality"] == "text").sum(), 0)
        self.assertTrue((df["role"] == "context").all())  # no roles recorded: every token is context
        self.assertIn("text", df.columns)
        dec = t.decode_tokens()
        self.assertEqual(len(dec), t.num_decode_steps)
        self.assertTrue((dec["role"] == "answer").all())

    def test_layer_tensors_as_stored(self):
        t = kt.open(FINE)
        q, k, v = t.layer(2)
        self.assertEqual(q.shape, (4, t.num_tokens, 32))
        self.assertEqual(k.shape, (2, t.num_tokens, 32))
        self.assertEqual(q.dtype, np.float32)
        with h5py.File(FINE) as f:
            np.testing.assert_array_equal(q, f["layers/002/q"][()])
            np.testing.assert_array_equal(k, f["layers/002/k"][()])
            np.testing.assert_array_equal(v, f["layers/002/v"][()])
            dq, dk, dv = t.decode_layer(1)
            np.testing.assert_array_equal(dq, f["decode/layers/001/q"][()])
            np.testing.assert_array_equal(dv, f["decode/layers/001/v"][()])
        # float16 traces come as float16, or float32 on request
        s = kt.open(SYNTH)
        q16 = s.layer(0).q
        self.assertEqual(q16.dtype, np.float16)
        q32 = s.layer(0, dtype="float32").q
        self.assertEqual(q32.dtype, np.float32)
        np.testing.assert_array_equal(q16.astype(np.float32), q32)
        with h5py.File(SYNTH) as f:
            np.testing.assert_array_equal(q16, f["layers/000/q"][()])

    def test_errors_carry_the_message(self):
        with self.assertRaises(kt.TraceError) as e:
            kt.open("/nonexistent/trace.h5")
        self.assertIn("/nonexistent/trace.h5", str(e.exception))
        self.assertIsInstance(e.exception, ValueError)
        t = kt.open(FINE)
        with self.assertRaises(kt.TraceError) as e:
            t.layer(4)
        self.assertIn("4", str(e.exception))
        with scratch() as d:
            bad = os.path.join(d, "truncated.h5")
            with open(FINE, "rb") as src, open(bad, "wb") as dst:
                dst.write(src.read()[:5000])
            with self.assertRaises(kt.TraceError) as e:
                kt.open(bad)
            self.assertIn(bad, str(e.exception))
        with self.assertRaises(ValueError):
            t.layer(0, dtype="float64")


if __name__ == "__main__":
    unittest.main()
