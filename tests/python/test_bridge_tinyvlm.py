"""Bridge on the tiny PyTorch VLM: the trace captured through kvscope.bridge equals the trace `kvcap run`
captures on the same scene + question (same tokens and decode tokens, q/k/v within 1e-4 relative:
max |bridge - runner| <= 1e-4 * max |runner| per tensor, fp32); an exception inside the block aborts the
capture (kvcap validate reports it incomplete) and propagates; runs the bridge cannot record raise
BridgeError. Needs KVSCOPE_CAPTURE_LIB and KVSCOPE_KVCAP (set by ctest)."""

import os
import subprocess
import tempfile
import unittest

import h5py
import numpy as np
import torch

from kvscope import bridge
from kvscope.tinyvlm.model import load_model
from kvscope.tinyvlm.scene import make_scene

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
KVCAP = os.environ.get("KVSCOPE_KVCAP", os.path.join(ROOT, "build", "bin", "kvcap"))
REL_TOL = 1e-4
MAX_NEW = 8
TOKEN_SETS = ["tokens/modality", "tokens/position", "tokens/token_id", "tokens/segment", "tokens/grid",
              "tokens/text", "decode/tokens/token_id", "decode/tokens/position", "decode/tokens/text"]
GEOMETRY = ["num_layers", "num_q_heads", "num_kv_heads", "head_dim", "rope_theta", "model_name", "device",
            "dtype", "complete"]


def run_bridge(model_dir, seeds, question, path, max_new=MAX_NEW):
    model, vocab = load_model(model_dir)
    ids, tokens = bridge.tinyvlm_prompt(vocab, model.config, question, len(seeds))
    images = torch.from_numpy(np.stack([make_scene(s).image for s in seeds]))
    with bridge.capture(model, path, tokens=tokens, token_text=vocab.tokens, max_decode_steps=max_new,
                        model_name=os.path.basename(model_dir)) as cap:
        out = model.generate(ids, images, max_new=max_new)
    return out, cap


class BridgeTinyVlmTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        torch.set_num_threads(2)
        if not os.path.exists(KVCAP):
            raise RuntimeError(f"kvcap not found at {KVCAP} (set KVSCOPE_KVCAP; build the target kvcap)")

    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory()

    def tearDown(self):
        self.tmp.cleanup()

    def path(self, name):
        return os.path.join(self.tmp.name, name)

    def compare_with_runner(self, model_dir, seeds, question):
        ours, theirs = self.path("bridge.h5"), self.path("runner.h5")
        generated, cap = run_bridge(model_dir, seeds, question, ours)
        r = subprocess.run([KVCAP, "run", "--model", model_dir, "--scene", ",".join(map(str, seeds)),
                            "--question", question, "--max-new", str(MAX_NEW), "--threads", "1",
                            "-o", theirs],
                           capture_output=True, text=True)
        self.assertEqual(r.returncode, 0, r.stderr)
        fed = [t for t in generated if t != 2]
        self.assertEqual(cap.decode_steps, len(fed))
        worst = 0.0
        with h5py.File(ours, "r") as a, h5py.File(theirs, "r") as b:
            for name in GEOMETRY:
                self.assertEqual(a.attrs[name], b.attrs[name], name)
            for name in TOKEN_SETS:
                np.testing.assert_array_equal(a[name][:], b[name][:], err_msg=name)
            np.testing.assert_array_equal(a["decode/tokens/token_id"][:], fed)
            for layer in range(int(a.attrs["num_layers"])):
                for group in ("layers", "decode/layers"):
                    for t in "qkv":
                        name = f"{group}/{layer:03d}/{t}"
                        x, y = a[name][:], b[name][:]
                        self.assertEqual(x.shape, y.shape, name)
                        err = float(np.abs(x - y).max() / np.abs(y).max())
                        worst = max(worst, err)
                        self.assertLessEqual(err, REL_TOL, f"{name}: relative error {err:.3g}")
        print(f"{os.path.basename(model_dir)} scenes {seeds} '{question}': {cap.decode_steps} decode steps, "
              f"worst relative q/k/v difference to kvcap run {worst:.2e}")
        self.assertEqual(validate(ours)[0], 0)

    def test_equals_runner_one_image(self):
        self.compare_with_runner(os.path.join(ROOT, "tests/data/tinyvlm-random-none"), [7],
                                 "how many shapes ?")

    def test_equals_runner_two_images_ntk_rope(self):
        self.compare_with_runner(os.path.join(ROOT, "tests/data/tinyvlm-random-ntk"), [3, 8],
                                 "which image has more shapes ?")

    def test_equals_runner_trained_model(self):
        model_dir = os.path.join(ROOT, "traces/models/tiny-shapes")
        if not os.path.exists(os.path.join(model_dir, "model.safetensors")):
            self.skipTest(f"{model_dir} not trained yet")
        self.compare_with_runner(model_dir, [7], "what color is the circle ?")

    def test_multi_token_forward_after_prefill_is_decode_steps(self):
        """A question fed in one forward after the context is one decode step per token, causal: its q/k/v
        equal feeding the tokens one at a time and the prefill of the whole prompt; roles are recorded."""
        model, vocab = load_model(os.path.join(ROOT, "tests/data/tinyvlm-random-none"))
        ids, tokens = bridge.tinyvlm_prompt(vocab, model.config, "how many shapes are there ?", 1)
        images = torch.from_numpy(make_scene(7).image[None])
        n = 5
        T = len(ids) - n
        ids_t = torch.tensor(ids)
        files = {}
        for name, chunks in (("one", [n]), ("each", [1] * n), ("whole", [])):
            path = self.path(f"{name}.h5")
            ctx = dict(vars(tokens))
            if name != "whole":
                ctx = {k: (v[:T] if isinstance(v, list) else v) for k, v in ctx.items()}
                ctx["role"] = [3] + [0] * (T - 1)
            with bridge.capture(model, path, tokens=bridge.TokenTable(**ctx), token_text=vocab.tokens) as cap, \
                    torch.no_grad():
                first = len(ids) if name == "whole" else T
                logits, past = model(ids_t[:first], images, return_cache=True)
                at = first
                for c in chunks:
                    logits, past = model(ids_t[at:at + c], None, past=past, start_pos=at,
                                                 return_cache=True)
                    at += c
                nxt = torch.argmax(logits[-1]).reshape(1)
                model(nxt, None, past=past, start_pos=at, return_cache=True)
                if name != "whole":
                    cap.set_decode_roles([1] * (n - 1) + [3, 2])
            self.assertEqual(validate(path)[0], 0, validate(path)[1])
            files[name] = h5py.File(path, "r")
        one, each, whole = files["one"], files["each"], files["whole"]
        self.assertEqual(one["decode/tokens/token_id"][:n].tolist(), ids[T:])
        self.assertEqual(one["decode/tokens/position"][:].tolist(), list(range(T, T + n + 1)))
        self.assertEqual(one["decode/tokens/role"][:].tolist(), [1] * (n - 1) + [3, 2])
        self.assertEqual(one["tokens/role"][0], 3)
        self.assertEqual(one.attrs["version"], "1.1")
        for layer in range(int(one.attrs["num_layers"])):
            for t in "qkv":
                a = one[f"decode/layers/{layer:03d}/{t}"][:]
                scale = float(np.abs(a).max())
                for b in (each[f"decode/layers/{layer:03d}/{t}"][:],
                          np.concatenate([whole[f"layers/{layer:03d}/{t}"][:, T:],
                                          whole[f"decode/layers/{layer:03d}/{t}"][:]], axis=1)):
                    self.assertLessEqual(float(np.abs(a - b).max()) / scale, REL_TOL, f"layer {layer} {t}")
        for f in files.values():
            f.close()

    def test_exception_in_block_aborts_and_propagates(self):
        model, vocab = load_model(os.path.join(ROOT, "tests/data/tinyvlm-random-none"))
        ids, tokens = bridge.tinyvlm_prompt(vocab, model.config, "how many shapes ?", 1)
        images = torch.from_numpy(make_scene(7).image[None])
        path = self.path("aborted.h5")

        class Interrupted(Exception):
            pass

        steps = []

        def stop_after_two_layers(module, inputs, output):
            steps.append(1)
            if len(steps) == 3:  # prefill layer 0 and 1 recorded, then the first decode step fails
                raise Interrupted("user stopped the run")

        handle = model.model.layers[0].register_forward_hook(stop_after_two_layers)
        try:
            with self.assertRaises(Interrupted):
                with bridge.capture(model, path, tokens=tokens, token_text=vocab.tokens):
                    model.generate(ids, images, max_new=MAX_NEW)
        finally:
            handle.remove()
        rc, out = validate(path)
        self.assertEqual(rc, 2, out)
        self.assertIn("incomplete trace", out)
        self.assertIn(f"{len(ids)} tokens", out)
        self.assertIn("2 of 2 prefill layers", out)
        # every wrapper is gone: the model runs as before
        self.assertNotIn("forward", vars(model))
        self.assertNotIn("forward", vars(model.model.layers[0].self_attn))
        self.assertNotIn("forward", vars(model.model.layers[0].self_attn.rotary_emb))

    def test_unrecordable_runs_raise_bridge_error(self):
        model, vocab = load_model(os.path.join(ROOT, "tests/data/tinyvlm-random-none"))
        ids, tokens = bridge.tinyvlm_prompt(vocab, model.config, "how many shapes ?", 1)
        images = torch.from_numpy(make_scene(7).image[None])
        cases = {
            "full recompute": lambda: model.generate(ids, images, max_new=3, use_cache=False),
            "wrong prompt": lambda: model.generate(ids[:-1], images, max_new=3),
        }
        for what, run in cases.items():
            path = self.path(what.replace(" ", "_") + ".h5")
            with self.assertRaises(bridge.BridgeError, msg=what) as ctx:
                with bridge.capture(model, path, tokens=tokens):
                    run()
            self.assertIn(path, str(ctx.exception))
            with h5py.File(path, "r") as f:
                self.assertEqual(int(f.attrs["complete"]), 0, what)
        with self.assertRaises(bridge.BridgeError) as ctx:
            with bridge.capture(model, self.path("idle.h5"), tokens=tokens):
                pass
        self.assertIn("never ran", str(ctx.exception))


def validate(path):
    r = subprocess.run([KVCAP, "validate", path], capture_output=True, text=True)
    return r.returncode, r.stdout + r.stderr


if __name__ == "__main__":
    unittest.main()
