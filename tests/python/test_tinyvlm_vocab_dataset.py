"""Tokeniser rules and the dataset: answer lengths, family shares, determinism, split disjointness."""

import collections
import unittest

from kvscope.tinyvlm.dataset import (FAMILIES, HELDOUT_IMAGE_OFFSET, NUM_PATCHES, heldout_sample,
                                     train_sample)
from kvscope.tinyvlm.scene import COLORS, SHAPES, make_scene
from kvscope.tinyvlm.vocab import BOS, EOS, IMAGE_PATCH_ID, IMG_END, IMG_START, SEP, UnknownWordError, Vocab


class VocabTest(unittest.TestCase):
    def setUp(self):
        self.v = Vocab()

    def test_special_ids(self):
        self.assertEqual(self.v.tokens[:9],
                         ["<pad>", "<bos>", "<eos>", "<img>", "</img>", "<sep>", "?", ".", "the"])

    def test_punctuation_split_and_case(self):
        ids = self.v.encode("The ball is RED.what color is the ball?")
        words = [self.v.tokens[i] for i in ids]
        self.assertEqual(words, ["the", "ball", "is", "red", ".", "what", "color", "is", "the", "ball", "?"])
        self.assertEqual(self.v.encode("  where\tis the?  "), self.v.encode("where is the ?"))
        self.assertEqual([self.v.tokens[i] for i in self.v.encode("?.?")], ["?", ".", "?"])

    def test_unknown_word(self):
        with self.assertRaises(UnknownWordError) as ctx:
            self.v.encode("what colour is the ball ?")
        self.assertEqual(ctx.exception.word, "colour")
        self.assertIn("colour", str(ctx.exception))
        with self.assertRaises(UnknownWordError):
            self.v.encode("<sep>")


class DatasetTest(unittest.TestCase):
    def setUp(self):
        self.v = Vocab()

    def test_answers_families_and_layout(self):
        fams = collections.Counter()
        for k in range(800):
            s = train_sample(self.v, 0, k)
            fams[s.family] += 1
            self.assertTrue(3 <= len(s.answer_ids) - 1 <= 8, s.answer)
            self.assertEqual(s.answer_ids[-1], EOS)
            n_img = 2 if s.family == "two-image" else 1
            self.assertEqual(s.images.shape, (n_img, 64, 64, 3))
            p = s.prompt_ids
            self.assertEqual(p[0], BOS)
            self.assertEqual(p[-1], SEP)
            self.assertEqual(p.count(IMAGE_PATCH_ID), NUM_PATCHES * n_img)
            for i in range(n_img):
                start = 1 + i * (NUM_PATCHES + 2)
                self.assertEqual(p[start], IMG_START)
                self.assertEqual(p[start + NUM_PATCHES + 1], IMG_END)
        for f in FAMILIES:
            self.assertGreater(fams[f] / 800, 0.18, fams)
            self.assertLess(fams[f] / 800, 0.32, fams)

    def test_answers_are_correct(self):
        for k in range(300):
            s = heldout_sample(self.v, k)
            scenes = [make_scene(seed) for seed in s.image_seeds]
            q = s.question.split()
            if s.question == "how many shapes ?":
                n = scenes[0].count
                self.assertEqual(s.answer.split()[2], ["one", "two", "three", "four", "five", "six"][n - 1])
            elif q[:3] == ["where", "is", "the"]:
                obj = [o for o in scenes[0].objects if COLORS[o.color] == q[3] and SHAPES[o.shape] == q[4]]
                self.assertEqual(len(obj), 1)
            elif s.family == "two-image" and q[3] == "the":
                key = (q[4], q[5])
                has = [any((COLORS[o.color], SHAPES[o.shape]) == key for o in sc.objects) for sc in scenes]
                self.assertEqual(sum(has), 1)
                self.assertEqual(s.answer, "the first image" if has[0] else "the second image")
            elif s.family == "two-image":
                a, b = scenes[0].count, scenes[1].count
                self.assertNotEqual(a, b)
                self.assertEqual(s.answer, "the first image" if a > b else "the second image")
            elif s.family == "text-only":
                noun = q[-2]
                i = q.index(noun)
                self.assertEqual(s.answer, f"the {noun} is {q[i + 2]}")

    def test_deterministic_and_disjoint(self):
        a = [train_sample(self.v, 0, k) for k in range(50)]
        b = [train_sample(self.v, 0, k) for k in range(50)]
        self.assertEqual([(x.question, x.answer, x.image_seeds) for x in a],
                         [(x.question, x.answer, x.image_seeds) for x in b])
        c = [train_sample(self.v, 1, k) for k in range(50)]
        self.assertNotEqual([x.image_seeds for x in a], [x.image_seeds for x in c])
        for k in range(200):
            self.assertTrue(all(s < HELDOUT_IMAGE_OFFSET for s in train_sample(self.v, 0, k).image_seeds))
            self.assertTrue(all(s >= HELDOUT_IMAGE_OFFSET for s in heldout_sample(self.v, k).image_seeds))


if __name__ == "__main__":
    unittest.main()
