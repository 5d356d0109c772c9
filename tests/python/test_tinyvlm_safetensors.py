"""safetensors reader/writer: round trip of every dtype (incl. bf16), metadata, header layout, bad files."""

import json
import os
import struct
import tempfile
import unittest

import numpy as np
import torch

from kvscope.tinyvlm import safetensors_io as st


class SafetensorsTest(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.TemporaryDirectory()
        self.path = os.path.join(self.dir.name, "t.safetensors")

    def tearDown(self):
        self.dir.cleanup()

    def test_round_trip_all_dtypes_and_metadata(self):
        g = torch.Generator().manual_seed(3)
        tensors = {
            "f32": torch.randn(3, 5, generator=g),
            "f16": torch.randn(7, generator=g).half(),
            "bf16": torch.tensor([1.0, -2.5, 3.140625, 1e30, -0.0]).bfloat16(),
            "i32": torch.tensor([[-2147483648, 2147483647]], dtype=torch.int32),
            "i64": torch.tensor([-(1 << 62), 1 << 62], dtype=torch.int64),
            "u8": torch.arange(256, dtype=torch.uint8).view(16, 16),
            "scalar": torch.tensor(2.5),
            "numpy": np.arange(6, dtype=np.float32).reshape(2, 3),
        }
        meta = {"format": "pt", "json": json.dumps({"a": [1, 2]})}
        st.save_file(tensors, self.path, meta)
        back, back_meta = st.load_file(self.path)
        self.assertEqual(back_meta, meta)
        self.assertEqual(set(back), set(tensors))
        for name, t in tensors.items():
            t = torch.as_tensor(t)
            self.assertEqual(back[name].dtype, t.dtype, name)
            self.assertEqual(back[name].shape, t.shape, name)
            self.assertTrue(torch.equal(back[name], t), name)

    def test_header_layout(self):
        st.save_file({"b": torch.tensor([1.0, 2.0]), "a": torch.tensor([7], dtype=torch.uint8)}, self.path)
        with open(self.path, "rb") as f:
            blob = f.read()
        (n,) = struct.unpack("<Q", blob[:8])
        self.assertEqual((8 + n) % 8, 0)
        header = json.loads(blob[8:8 + n])
        self.assertEqual(header["b"]["dtype"], "F32")
        self.assertEqual(header["b"]["shape"], [2])
        b0, b1 = header["b"]["data_offsets"]
        self.assertEqual(b1 - b0, 8)
        self.assertEqual(struct.unpack("<2f", blob[8 + n + b0:8 + n + b1]), (1.0, 2.0))
        # bf16 is the upper half of the float32 bit pattern
        st.save_file({"x": torch.tensor([1.0]).bfloat16()}, self.path)
        with open(self.path, "rb") as f:
            blob = f.read()
        self.assertEqual(blob[-2:], struct.pack("<H", 0x3F80))

    def test_bad_files(self):
        with open(self.path, "wb") as f:
            f.write(b"\x01")
        with self.assertRaises(st.SafetensorsError):
            st.load_file(self.path)
        header = json.dumps({"x": {"dtype": "F32", "shape": [4], "data_offsets": [0, 8]}}).encode()
        with open(self.path, "wb") as f:
            f.write(struct.pack("<Q", len(header)) + header + b"\0" * 8)
        with self.assertRaisesRegex(st.SafetensorsError, "'x'"):
            st.load_file(self.path)
        with self.assertRaises(st.SafetensorsError):
            st.save_file({"x": torch.zeros(2, dtype=torch.float64)}, self.path)


if __name__ == "__main__":
    unittest.main()
