"""The tiny-shapes question-answering dataset (four families, answers of 3-8 tokens).

Prompt layout: <bos>, then per image <img> + 64 vision positions (IMAGE_PATCH_ID) + </img>, then the
question words, then <sep>. Target: answer words + <eos>.

Sample k of a split is drawn from rng = SplitMix64(split_base + k):
  family = rng.uniform(4)  (0 fine-grained, 1 counting, 2 two-image, 3 text-only)
  an image seed is image_offset + rng.uniform(2^32), where image_offset = 0 for training splits and 2^32
  for the held-out split, so training and held-out images come from disjoint seed ranges.
  0 fine-grained (one image): variant = uniform(2); 0: "what color is the SHAPE ?" -> "the SHAPE is COLOR"
    for a shape occurring once (picked uniformly among those, sorted by shape index); when no shape is
    unique, or variant 1: object = objects[uniform(count)], "where is the COLOR SHAPE ?" ->
    "row R column C" (R, C spelled one..four).
  1 counting (one image): "how many shapes ?" -> "there are N shapes" / "there is one shape".
  2 two-image: variant = uniform(2); 0: draw the second image's seed until the counts differ,
    "which image has more shapes ?"; 1: draw the second image's seed until some (shape, color) is in
    exactly one image, pick one uniformly (sorted by (shape, color)), "which image has the COLOR SHAPE ?".
    Answer "the first image" / "the second image".
  3 text-only (one irrelevant image): variant = uniform(2); 0: "the N is C . what color is the N ?";
    1: "the N1 is C1 and the N2 is C2 . what color is the Nq ?" (N1 != N2, Nq one of them) ->
    "the Nq is Cq".
Split bases: train(seed) = (seed + 1) << 40, held-out = 0xF0000000 << 32.
"""

from dataclasses import dataclass
from typing import List, Optional

import numpy as np

from .rng import SplitMix64
from .scene import COLORS, SHAPES, Scene, make_scene
from .vocab import BOS, EOS, IMG_END, IMG_START, IMAGE_PATCH_ID, SEP, Vocab

FAMILIES = ("fine-grained", "counting", "two-image", "text-only")
NOUNS = ("ball", "car", "hat", "cup", "box", "kite")
NUMBERS = ("one", "two", "three", "four", "five", "six")
NUM_PATCHES = 64
HELDOUT_BASE = 0xF0000000 << 32
HELDOUT_IMAGE_OFFSET = 1 << 32


def train_base(seed: int) -> int:
    return (seed + 1) << 40


@dataclass
class Sample:
    family: str
    question: str
    answer: str
    image_seeds: List[int]
    images: np.ndarray  # uint8 [n_images, 64, 64, 3]
    prompt_ids: List[int]  # ends with <sep>
    answer_ids: List[int]  # answer words + <eos>


def build_prompt(vocab: Vocab, n_images: int, question: str) -> List[int]:
    """<bos> (<img> 64 x IMAGE_PATCH_ID </img>)*n_images question-words <sep>."""
    ids = [BOS]
    for _ in range(n_images):
        ids += [IMG_START] + [IMAGE_PATCH_ID] * NUM_PATCHES + [IMG_END]
    return ids + vocab.encode(question) + [SEP]


def _fine_grained(rng: SplitMix64, scene: Scene):
    variant = rng.uniform(2)
    if variant == 0:
        shapes = [o.shape for o in scene.objects]
        unique = sorted(s for s in set(shapes) if shapes.count(s) == 1)
        if unique:
            shape = unique[rng.uniform(len(unique))]
            color = next(o.color for o in scene.objects if o.shape == shape)
            return f"what color is the {SHAPES[shape]} ?", f"the {SHAPES[shape]} is {COLORS[color]}"
    obj = scene.objects[rng.uniform(scene.count)]
    return (f"where is the {COLORS[obj.color]} {SHAPES[obj.shape]} ?",
            f"row {NUMBERS[obj.row]} column {NUMBERS[obj.col]}")


def _counting(scene: Scene):
    n = scene.count
    answer = "there is one shape" if n == 1 else f"there are {NUMBERS[n - 1]} shapes"
    return "how many shapes ?", answer


def _two_image(rng: SplitMix64, draw_seed):
    a = make_scene(draw_seed())
    variant = rng.uniform(2)
    while True:
        b = make_scene(draw_seed())
        if variant == 0:
            if a.count != b.count:
                which = "first" if a.count > b.count else "second"
                return [a, b], "which image has more shapes ?", f"the {which} image"
        else:
            pa = {(o.shape, o.color) for o in a.objects}
            pb = {(o.shape, o.color) for o in b.objects}
            cands = sorted(pa ^ pb)
            if cands:
                shape, color = cands[rng.uniform(len(cands))]
                which = "first" if (shape, color) in pa else "second"
                return ([a, b], f"which image has the {COLORS[color]} {SHAPES[shape]} ?",
                        f"the {which} image")


def _text_only(rng: SplitMix64):
    variant = rng.uniform(2)
    n1 = NOUNS[rng.uniform(len(NOUNS))]
    c1 = COLORS[rng.uniform(len(COLORS))]
    if variant == 0:
        return f"the {n1} is {c1} . what color is the {n1} ?", f"the {n1} is {c1}"
    rest = [n for n in NOUNS if n != n1]
    n2 = rest[rng.uniform(len(rest))]
    c2 = COLORS[rng.uniform(len(COLORS))]
    nq, cq = (n1, c1) if rng.uniform(2) == 0 else (n2, c2)
    return f"the {n1} is {c1} and the {n2} is {c2} . what color is the {nq} ?", f"the {nq} is {cq}"


def make_sample(vocab: Vocab, split_base: int, k: int, image_offset: int,
                family: Optional[int] = None) -> Sample:
    """Sample k of the split with base `split_base` (see the module docstring). `family` overrides the
    drawn family (the draw still happens, so other draws stay aligned)."""
    rng = SplitMix64(split_base + k)
    fam = rng.uniform(len(FAMILIES))
    if family is not None:
        fam = family

    def draw_seed() -> int:
        return image_offset + rng.uniform(1 << 32)

    if fam == 0:
        scenes = [make_scene(draw_seed())]
        q, a = _fine_grained(rng, scenes[0])
    elif fam == 1:
        scenes = [make_scene(draw_seed())]
        q, a = _counting(scenes[0])
    elif fam == 2:
        scenes, q, a = _two_image(rng, draw_seed)
    else:
        scenes = [make_scene(draw_seed())]
        q, a = _text_only(rng)
    images = np.stack([s.image for s in scenes])
    return Sample(family=FAMILIES[fam], question=q, answer=a, image_seeds=[s.seed for s in scenes],
                  images=images, prompt_ids=build_prompt(vocab, len(scenes), q),
                  answer_ids=vocab.encode(a) + [EOS])


def train_sample(vocab: Vocab, seed: int, k: int, family: Optional[int] = None) -> Sample:
    return make_sample(vocab, train_base(seed), k, 0, family)


def heldout_sample(vocab: Vocab, k: int) -> Sample:
    return make_sample(vocab, HELDOUT_BASE, k, HELDOUT_IMAGE_OFFSET)
