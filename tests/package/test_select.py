"""kvscope.select: one layer of a live cache through a policy, by the C++ closed loop's compressors; kept
tokens, slots and bytes as kvsim's replay of the same tensors reports them."""

import unittest

import numpy as np

import kvscope.select as sel
import kvscope.sim as ks
import kvscope.trace as kt
from common import FINE, TWO


def labels(t: kt.Trace) -> dict:
    g, tok = t.geometry, t.tokens()
    return dict(num_layers=g.num_layers, num_q_heads=g.num_q_heads, num_kv_heads=g.num_kv_heads,
                head_dim=g.head_dim, modality=tok["modality"].astype(str).tolist(),
                position=tok["position"].to_numpy(), segment=tok["segment"].to_numpy(),
                grid_row=tok["grid_row"].to_numpy(), grid_col=tok["grid_col"].to_numpy(), dtype=t.dtype)


def layer_rows(df):
    return df[df["modality"] == "all"].set_index("layer")


class PrefillTest(unittest.TestCase):
    def check_against_kvsim(self, path, policy, budget):
        t = kt.open(path)
        c = sel.PrefillCompressor(policy, budget, **labels(t))
        ref = layer_rows(ks.run(path, policy, budget).df)
        out = []
        for layer in range(t.geometry.num_layers):
            s = c.compress_layer(layer, *t.layer(layer))
            row = ref.loc[str(layer)]
            self.assertEqual(s.bytes_kept, row["bytes_kept"], (policy, layer))
            self.assertEqual(s.bytes_full, row["bytes_full"], (policy, layer))
            self.assertEqual(sum(h.kept for h in s.heads), row["kept"])
            self.assertEqual(sum(h.merged for h in s.heads), row["merged"])
            for h in range(t.geometry.num_kv_heads):
                K = len(s.kept[h])
                self.assertEqual(s.keys[h].shape, (K, t.geometry.head_dim))
                self.assertEqual(s.values[h].shape, (K, t.geometry.head_dim))
                self.assertEqual(s.multiplicity[h].shape, (K,))
                self.assertTrue(np.all(np.diff(s.kept[h]) > 0))  # ascending, distinct
            out.append(s)
        return t, out

    def test_eviction_keeps_the_rows_kvsim_keeps(self):
        t, layers = self.check_against_kvsim(FINE, "snapkv", 0.3)
        for layer, s in enumerate(layers):
            _, k, v = t.layer(layer)
            for h in range(t.geometry.num_kv_heads):
                self.assertEqual(len(s.kept[h]), s.heads[h].kept)
                np.testing.assert_array_equal(s.keys[h], k[h, s.kept[h]])  # evicting keeps rows exact
                np.testing.assert_array_equal(s.values[h], v[h, s.kept[h]])
                self.assertTrue(np.all(s.multiplicity[h] == 1))
        self.check_against_kvsim(TWO, "h2o", "40tok")
        self.check_against_kvsim(TWO, "streamingllm", 0.25)

    def test_warnings_say_when_a_budget_is_below_the_forced_set(self):
        t = kt.open(FINE)
        c = sel.PrefillCompressor("streamingllm", 0.02, **labels(t))
        self.assertEqual(c.warnings, [])
        s = c.compress_layer(0, *t.layer(0))
        self.assertEqual(len(c.warnings), 1, c.warnings)
        self.assertIn("below the forced set", c.warnings[0])
        self.assertTrue(all(len(k) == 4 for k in s.kept))  # the 4 sinks/recent tokens, as kvsim keeps

    def test_quantizing_and_merging(self):
        t, layers = self.check_against_kvsim(FINE, "h2o+int8", 0.5)
        _, k, _ = t.layer(0)
        s = layers[0]
        rows = k[0, s.kept[0]]
        self.assertFalse(np.array_equal(s.keys[0], rows))  # dequantized int8
        np.testing.assert_allclose(s.keys[0], rows, atol=np.abs(rows).max() / 100)
        merging = ks.policy("h2o", executor="merge-evicted", rename="h2o-merge")
        t, layers = self.check_against_kvsim(TWO, merging, 0.3)
        merged = [s for s in layers if any((m > 1).any() for m in s.multiplicity)]
        self.assertTrue(merged, "no slot absorbed a token")
        for s in layers:
            for h, st in enumerate(s.heads):
                self.assertEqual(int(s.multiplicity[h].sum()), st.kept + st.merged)

    def test_head_merging_shares_working_heads(self):
        t, layers = self.check_against_kvsim(TWO, "unicache", None)
        for s in layers:
            for h, w in enumerate(s.cluster):
                for g, w2 in enumerate(s.cluster):
                    if w == w2:
                        np.testing.assert_array_equal(s.kept[h], s.kept[g])

    def test_bad_input(self):
        t = kt.open(FINE)
        c = sel.PrefillCompressor("h2o", 0.3, **labels(t))
        q, k, v = t.layer(0)
        with self.assertRaises(ValueError) as e:
            c.compress_layer(1, q, k, v)
        self.assertIn("expected 0", str(e.exception))
        with self.assertRaises(ValueError) as e:
            c.compress_layer(0, q[:, :10], k, v)
        self.assertIn("q", str(e.exception))
        with self.assertRaises(ValueError):
            c.compress_layer(0, q, k[:1], v)
        with self.assertRaises(sel.PolicyError):
            sel.PrefillCompressor("h2o~decode", 0.3, **labels(t))
        with self.assertRaises(sel.PolicyError):
            sel.PrefillCompressor("oracle-topk", 0.3, **labels(t))
        with self.assertRaises(sel.PolicyError):
            sel.PrefillCompressor("no-such", 0.3, **labels(t))
        with self.assertRaises(sel.PolicyError):
            sel.PrefillCompressor("h2o", "2.5", **labels(t))
        bad = labels(t)
        bad["modality"] = ["text", "smell"] + bad["modality"][2:]
        with self.assertRaises(ValueError) as e:
            sel.PrefillCompressor("h2o", 0.3, **bad)
        self.assertIn("smell", str(e.exception))
        bad = labels(t)
        bad["position"] = bad["position"][:5]
        with self.assertRaises(ValueError):
            sel.PrefillCompressor("h2o", 0.3, **bad)
        bad = labels(t)
        bad["num_kv_heads"] = 3
        with self.assertRaises(ValueError):
            sel.PrefillCompressor("h2o", 0.3, **bad)


class DecodeTest(unittest.TestCase):
    def test_resident_cache_bytes_equal_kvsim_decode_replay(self):
        t = kt.open(FINE)
        g = t.geometry
        c = sel.DecodeCompressor("h2o~decode", "30tok", **labels(t))
        ref = layer_rows(ks.run(FINE, "h2o~decode", "30tok").df)
        S = t.num_decode_steps
        for layer in range(g.num_layers):
            c.set_prefill(layer, *t.layer(layer))
            start = c.resident(layer)  # the starting cache: the whole context
            self.assertTrue(all(len(x) == t.num_tokens for x in start.tokens))
            dq, dk, dv = t.decode_layer(layer)
            for s in range(S):
                c.add_step(layer, dq[:, s], dk[:, s], dv[:, s])
            self.assertEqual(c.steps(layer), S)
            r = c.resident(layer)
            self.assertEqual(sum(h.bytes_end for h in r.heads), ref.loc[str(layer), "bytes_end"])
            self.assertEqual(sum(h.bytes_peak for h in r.heads), ref.loc[str(layer), "bytes_peak"])
            for h in range(g.num_kv_heads):
                self.assertEqual(len(r.tokens[h]), 30)
                ids = r.tokens[h]
                ctx = ids[ids < t.num_tokens]
                _, k, _ = t.layer(layer)
                np.testing.assert_array_equal(r.keys[h][: len(ctx)], k[h, ctx])
        with self.assertRaises(sel.PolicyError):
            sel.DecodeCompressor("h2o", 0.3, **labels(t))


if __name__ == "__main__":
    unittest.main()
