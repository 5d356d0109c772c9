"""The auxiliary training targets of train.py name what the spec says they name: per vision patch the
colour, shape, row and column words of its grid cell; per stated colour of a text-only prompt its noun."""

import unittest

from kvscope.tinyvlm import train
from kvscope.tinyvlm.dataset import NOUNS, NUMBERS, heldout_sample
from kvscope.tinyvlm.scene import COLORS, SHAPES, make_scene
from kvscope.tinyvlm.train import IGNORE, binding_targets, collate, grounding_keys, grounding_loss, \
    patch_targets
from kvscope.tinyvlm.vocab import PAD, Vocab


class AuxTargetsTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.vocab = Vocab()

    def test_patch_targets_name_the_cell(self):
        v = self.vocab
        for seed in (3, 77, 123456):
            scene = make_scene(seed)
            by_cell = {(o.row, o.col): o for o in scene.objects}
            color, shape, row, col = patch_targets(v, seed, position=True)
            for n in range(64):
                pr, pc = divmod(n, 8)
                cell = (pr // 2, pc // 2)
                self.assertEqual(v.tokens[int(row[n])], NUMBERS[cell[0]], (seed, n))
                self.assertEqual(v.tokens[int(col[n])], NUMBERS[cell[1]], (seed, n))
                o = by_cell.get(cell)
                self.assertEqual(int(color[n]), v.ids[COLORS[o.color]] if o else PAD, (seed, n))
                self.assertEqual(int(shape[n]), v.ids[SHAPES[o.shape]] if o else PAD, (seed, n))
            self.assertEqual(len(patch_targets(v, seed)), 2)  # colour and shape only without position

    def test_binding_targets_only_on_stated_colours(self):
        v = self.vocab
        seen_two = False
        for k in range(200):
            s = heldout_sample(v, k)
            tgt = binding_targets(v, s.prompt_ids)
            marked = [(i, v.tokens[int(t)]) for i, t in enumerate(tgt.tolist()) if t != IGNORE]
            if s.family != "text-only":
                self.assertEqual(marked, [], s.question)
                continue
            words = s.question.split()
            # "the N is C ." or "the N1 is C1 and the N2 is C2 ." precede "what color is the N ?"
            stated = [(words[j + 1], words[j + 3]) for j in range(len(words) - 3)
                      if words[j] == "the" and words[j + 1] in NOUNS and words[j + 3] in COLORS]
            self.assertEqual([n for _, n in marked], [n for n, _ in stated], s.question)
            for i, noun in marked:
                self.assertIn(v.tokens[s.prompt_ids[i]], COLORS)
                self.assertEqual(v.tokens[s.prompt_ids[i - 2]], noun)
            seen_two |= len(marked) == 2
        self.assertTrue(seen_two)

    def test_grounding_keys_are_the_object_the_answer_is_about(self):
        import torch
        v = self.vocab
        kinds = set()
        for k in range(300):
            s = heldout_sample(v, k)
            keys = grounding_keys(s)
            w, a = s.question.split(), s.answer.split()
            if s.family in ("counting", "text-only") or s.question == "which image has more shapes ?":
                self.assertEqual(keys, [], s.question)
                continue
            self.assertEqual(len(keys), 4, s.question)
            image = (keys[0] - 2) // 66
            cells = {divmod(((q - 2) % 66) // 8 // 2 * 4 + ((q - 2) % 66) % 8 // 2, 4) for q in keys}
            self.assertEqual(len(cells), 1, keys)  # the 4 patches of one grid cell
            (row, col), = cells
            obj = next(o for o in make_scene(s.image_seeds[image]).objects if (o.row, o.col) == (row, col))
            if w[0] == "where":
                kinds.add("where")
                self.assertEqual(a, ["row", NUMBERS[row], "column", NUMBERS[col]])
                self.assertEqual((COLORS[obj.color], SHAPES[obj.shape]), (w[3], w[4]))
            elif w[0] == "what":
                kinds.add("what")
                self.assertEqual(a, ["the", SHAPES[obj.shape], "is", COLORS[obj.color]])
            else:
                kinds.add("which")
                self.assertEqual(a[1], ("first", "second")[image])
                self.assertEqual((COLORS[obj.color], SHAPES[obj.shape]), (w[4], w[5]))
        self.assertEqual(kinds, {"where", "what", "which"})
        # the loss is small only when the attention sits on those patches
        s = next(heldout_sample(v, k) for k in range(20) if grounding_keys(heldout_sample(v, k)))
        t = len(s.prompt_ids) + len(s.answer_ids) - 1
        on = torch.zeros(1, t, t)
        on[0, :, grounding_keys(s)] = 0.25
        off = torch.full((1, t, t), 1.0 / t)
        self.assertLess(float(grounding_loss(on, [s])), 1e-4)
        self.assertGreater(float(grounding_loss(off, [s])), 2.0)

    def test_collate_places_targets_at_vision_positions(self):
        v = self.vocab
        samples = [heldout_sample(v, k) for k in range(12)]
        ids, tgt, images, vision_aux, binding = collate(samples, v, position=True)
        self.assertEqual(len(vision_aux), 4)
        for b, s in enumerate(samples):
            is_patch = ids[b] == -1
            for g in vision_aux:
                # every vision position has a target (row and column even on background), nothing else has
                self.assertTrue(bool(((g[b] != IGNORE) <= is_patch).all()))
            self.assertTrue(bool((vision_aux[2][b] != IGNORE).eq(is_patch).all()))
            self.assertTrue(bool((binding[b][len(s.prompt_ids):] == IGNORE).all()))

    def test_smoke_training_with_every_aux_loss(self):
        import json
        import os
        import tempfile
        with tempfile.TemporaryDirectory() as d:
            self.assertEqual(train.main(["--out", d, "--smoke", "--seed", "4", "--threads", "1",
                                         "--aux-weight", "0.5", "--aux-position", "--aux-binding", "0.5",
                                         "--aux-ground", "0.5", "--ground-layer", "1"]), 0)
            with open(os.path.join(d, "train_log.json")) as f:
                log = json.load(f)
            self.assertEqual(log["steps"], 40)
            self.assertLess(log["last_loss"], 0.8 * log["first_loss"], log)
            # the smoke model has 2 layers: a grounding head in layer 2 does not exist
            self.assertEqual(train.main(["--out", d, "--smoke", "--aux-ground", "0.5", "--ground-layer", "2"]), 2)


if __name__ == "__main__":
    unittest.main()
