"""Custom stages in Python: a scorer computing H2O's score gives exactly the built-in h2o results; custom
allocators; the registry listings; errors."""

import os
import sys
import unittest

import numpy as np
import pandas as pd

import kvscope.select as sel
import kvscope.sim as ks
import kvscope.stages as st
import kvscope.trace as kt
from common import FINE, SYNTH, TWO, kvsim_csv, scratch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
from causal_softmax import causal_attention  # noqa: E402  (tests/python: the tests' one causal softmax)


def h2o_scores(layer: st.Layer) -> np.ndarray:
    """H2O (Zhang et al. 2023): attention each token received from every prefill query, causal by position,
    summed over the query heads of its kv head."""
    per_q_head = causal_attention(layer).sum(axis=1)  # [Hq, T]
    return per_q_head.reshape(layer.num_kv_heads, layer.group_size, layer.T).sum(axis=1)


class CustomScorerTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        st.register_scorer("h2o-py", h2o_scores, meaning="H2O in numpy")

    def metrics(self, df):
        return df.drop(columns=["policy"]).reset_index(drop=True)

    def test_python_h2o_equals_builtin_h2o(self):
        mine = ks.policy("h2o", scorer="h2o-py", rename="h2o-py")
        for trace in (FINE, TWO, SYNTH):
            res = ks.sweep(trace, [mine, "h2o"], [0.1, 0.25, 0.5, 0.8], bound=False, alloc_search=None)
            df = res.df
            a, b = df[df["policy"] == "h2o-py"], df[df["policy"] == "h2o"]
            self.assertGreater(len(a), 0)
            pd.testing.assert_frame_equal(self.metrics(a), self.metrics(b), obj=trace)

    def test_python_h2o_in_ini_composition_and_select(self):
        with scratch() as d:
            ini = os.path.join(d, "p.ini")
            with open(ini, "w") as f:
                f.write("[policy my-h2o-int8]\nbase = h2o+int8\nscorer = h2o-py\n")
            res = ks.sweep(FINE, ["my-h2o-int8", "h2o+int8"], [0.3], policy_files=[ini], bound=False, alloc_search=None)
        df = res.df
        pd.testing.assert_frame_equal(
            self.metrics(df[df["policy"] == "my-h2o-int8"]), self.metrics(df[df["policy"] == "h2o+int8"])
        )
        # the preset of the registered name, as kvsim would run it (uniform allocator, evict)
        self.assertIn("h2o-py", ks.policies())
        self.assertEqual(ks.run(FINE, "h2o-py", 0.4).df["kind"].iloc[0], "policy")
        # the select API keeps the same tokens with either scorer
        t = kt.open(FINE)
        g = t.geometry
        labels = dict(num_layers=g.num_layers, num_q_heads=g.num_q_heads, num_kv_heads=g.num_kv_heads,
                      head_dim=g.head_dim, modality=t.tokens()["modality_code"].to_numpy(),
                      position=t.tokens()["position"].to_numpy())
        a = sel.PrefillCompressor(ks.policy("h2o", scorer="h2o-py"), 0.3, **labels)
        b = sel.PrefillCompressor("h2o", 0.3, **labels)
        for layer in range(g.num_layers):
            x, y = a.compress_layer(layer, *t.layer(layer)), b.compress_layer(layer, *t.layer(layer))
            for h in range(g.num_kv_heads):
                np.testing.assert_array_equal(x.kept[h], y.kept[h])
            self.assertEqual(x.bytes_kept, y.bytes_kept)

    def test_a_different_scorer_changes_the_results(self):
        st.register_scorer("oldest-first", lambda layer: -np.tile(np.arange(layer.T, dtype=np.float32), (layer.num_kv_heads, 1)))
        newest = ks.policy("h2o", scorer="recency", rename="newest")
        oldest = ks.policy("h2o", scorer="oldest-first", rename="oldest")
        res = ks.sweep(FINE, [oldest, newest], [0.8], bound=False, alloc_search=None)
        rows = res.df[(res.df["layer"] == "all") & (res.df["modality"] == "all")].set_index("policy")
        self.assertNotEqual(rows.loc["oldest", "output_error"], rows.loc["newest", "output_error"])

    def test_scorer_errors(self):
        st.register_scorer("bad-shape", lambda layer: np.zeros(3))
        with self.assertRaises(RuntimeError) as e:
            ks.run(FINE, "bad-shape", 0.3)
        self.assertIn("bad-shape", str(e.exception))
        self.assertIn("expected (num_kv_heads, T)", str(e.exception))

        def raising(layer):
            raise ZeroDivisionError("no scores for layer %d" % layer.layer)

        st.register_scorer("raising", raising)
        with self.assertRaises(RuntimeError) as e:
            ks.run(FINE, "raising", 0.3)
        self.assertIn("no scores for layer 0", str(e.exception))
        with self.assertRaises(ks.PolicyError) as e:
            st.register_scorer("h2o", h2o_scores)
        self.assertIn("built-in", str(e.exception))
        with self.assertRaises(ks.PolicyError):
            st.register_scorer("has space", h2o_scores)
        with self.assertRaises(TypeError):
            st.register_scorer("not-callable", 3)


class CustomAllocatorTest(unittest.TestCase):
    def test_layer_fraction(self):
        st.register_allocator("same-keep", lambda layer, keep: keep)
        res = ks.sweep(FINE, [ks.policy("snapkv", allocator="same-keep", rename="snap-same"), "snapkv"], [0.3],
                       bound=False, alloc_search=None)
        df = res.df
        pd.testing.assert_frame_equal(
            df[df["policy"] == "snap-same"].drop(columns=["policy"]).reset_index(drop=True),
            df[df["policy"] == "snapkv"].drop(columns=["policy"]).reset_index(drop=True),
        )

        # first layer uncompressed, the others at the budget
        st.register_allocator("spare-first", lambda layer, keep: 1.0 if layer.layer == 0 else keep)
        df = ks.run(FINE, ks.policy("snapkv", allocator="spare-first"), 0.3).df
        all_rows = df[df["modality"] == "all"].set_index("layer")
        self.assertEqual(all_rows.loc["0", "kept"], all_rows.loc["0", "tokens"])
        self.assertLess(all_rows.loc["1", "kept"], all_rows.loc["1", "tokens"])

    def test_per_modality(self):
        st.register_allocator("vision-tenth", lambda layer, keep: {"vision": 0.1, "text": 1.0})
        df = ks.run(TWO, ks.policy("h2o", allocator="vision-tenth"), 0.5).df
        layer0 = df[df["layer"] == "0"].set_index("modality")
        n_heads = kt.open(TWO).geometry.num_kv_heads
        vision_tokens = layer0.loc["vision", "tokens"] // n_heads
        self.assertEqual(layer0.loc["vision", "kept"], n_heads * round(0.1 * vision_tokens))
        self.assertEqual(layer0.loc["text", "kept"], layer0.loc["text", "tokens"])

    def test_allocator_errors(self):
        st.register_allocator("too-much", lambda layer, keep: 2.0)
        with self.assertRaises(RuntimeError) as e:
            ks.run(FINE, ks.policy("h2o", allocator="too-much"), 0.3)
        self.assertIn("outside [0, 1]", str(e.exception))
        st.register_allocator("bad-modality", lambda layer, keep: {"smell": 0.5})
        with self.assertRaises(RuntimeError) as e:
            ks.run(FINE, ks.policy("h2o", allocator="bad-modality"), 0.3)
        self.assertIn("smell", str(e.exception))


class RegistryTest(unittest.TestCase):
    def test_listings_come_from_the_registry(self):
        names = st.names("scorer")
        for n in ("h2o", "snapkv", "tova", "knorm"):
            self.assertIn(n, names)
        self.assertIn("cosine", st.names("head_merge"))
        self.assertIn("kivi2", st.names("quant"))
        snap = [s for s in st.stages("scorer") if s["name"] == "snapkv"][0]
        self.assertIn("snap_window", [p["name"] for p in snap["params"]])
        self.assertFalse(snap["custom"])
        self.assertIn("h2o", st.listing())
        self.assertIn("sinks", [p["name"] for p in st.pipeline_parameters()])
        st.register_scorer("listed-py", h2o_scores)
        mine = [s for s in st.stages("scorer") if s["name"] == "listed-py"][0]
        self.assertTrue(mine["custom"])
        with self.assertRaises(ValueError):
            st.stages("nonsense")
        # the kvsim listing is the same registry's
        import subprocess
        from common import KVSIM

        out = subprocess.run([KVSIM, "stages"], check=True, capture_output=True, text=True).stdout
        for s in st.stages():
            if not s["custom"]:
                self.assertIn(s["name"], out)


if __name__ == "__main__":
    unittest.main()
