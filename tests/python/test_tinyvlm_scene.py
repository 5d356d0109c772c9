"""splitmix64 reference values, scene determinism and hand-checked pixel facts."""

import unittest

import numpy as np

from kvscope.tinyvlm.rng import SplitMix64
from kvscope.tinyvlm.scene import BACKGROUND, COLOR_RGB, make_scene, shape_mask


class SceneTest(unittest.TestCase):
    def test_splitmix64_reference_values(self):
        r = SplitMix64(0)
        self.assertEqual(r.next(), 0xE220A8397B1DCDAF)
        self.assertEqual(r.next(), 0x6E789E6AA1B965F4)
        self.assertEqual(r.next(), 0x06C45D188009454F)
        self.assertEqual(SplitMix64(5).uniform(7), SplitMix64(5).next() % 7)
        big = SplitMix64((1 << 64) - 1)
        self.assertLess(big.next(), 1 << 64)

    def test_deterministic(self):
        for seed in (0, 7, 123456789, (1 << 64) - 1):
            a, b = make_scene(seed), make_scene(seed)
            self.assertEqual(a.objects, b.objects)
            self.assertTrue(np.array_equal(a.image, b.image))
        self.assertFalse(np.array_equal(make_scene(1).image, make_scene(2).image))

    def test_object_rules(self):
        counts = set()
        for seed in range(300):
            s = make_scene(seed)
            counts.add(s.count)
            cells = [(o.row, o.col) for o in s.objects]
            attrs = [(o.shape, o.color) for o in s.objects]
            self.assertEqual(len(set(cells)), len(cells))
            self.assertEqual(len(set(attrs)), len(attrs))
        self.assertEqual(counts, {1, 2, 3, 4, 5, 6})

    def test_pixels(self):
        bg = np.array(BACKGROUND, np.uint8)
        for seed in range(40):
            s = make_scene(seed)
            occupied = {(o.row, o.col): o for o in s.objects}
            for r in range(4):
                for c in range(4):
                    cell = s.image[r * 16:(r + 1) * 16, c * 16:(c + 1) * 16]
                    # the cell corner is always background
                    self.assertTrue(np.array_equal(cell[0, 0], bg))
                    if (r, c) not in occupied:
                        self.assertTrue((cell == bg).all(), (seed, r, c))
                        continue
                    o = occupied[(r, c)]
                    rgb = np.array(COLOR_RGB[o.color], np.uint8)
                    # the cell centre (7, 7) is painted for every shape
                    self.assertTrue(np.array_equal(cell[7, 7], rgb))
                    # local (x=3, y=3) is painted only for the square
                    self.assertEqual(np.array_equal(cell[3, 3], rgb), o.shape == 0)
                    painted = (cell == rgb).all(-1)
                    self.assertTrue(np.array_equal(painted, shape_mask(o.shape)), (seed, r, c))

    def test_shape_masks(self):
        self.assertEqual(int(shape_mask(0).sum()), 100)
        cross = shape_mask(3)
        self.assertTrue(cross[7, 3] and cross[3, 7] and not cross[3, 3])
        tri = shape_mask(2)  # [y, x]: apex row y=3 has x 7..8, base row y=12 has x 3..12
        self.assertEqual(list(np.nonzero(tri[3])[0]), [7, 8])
        self.assertEqual(list(np.nonzero(tri[12])[0]), list(range(3, 13)))
        self.assertFalse(tri[2].any() or tri[13].any())
        circle = shape_mask(1)
        # (2x-15)^2 + (2y-15)^2 at (x=3, y=7) is 81 + 1 (in), at (x=2, y=7) 121 + 1 (out)
        self.assertTrue(circle[7, 3] and not circle[7, 2] and circle[3, 7] and not circle[2, 7])
        self.assertEqual(int(circle.sum()), 88)


if __name__ == "__main__":
    unittest.main()
