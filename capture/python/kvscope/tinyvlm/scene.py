"""Procedural scenes: coloured shapes on a 4x4 grid of a 64x64 RGB image (bit-exact with the C++ runner).

Image of seed s (rng = SplitMix64(s)): background (16, 16, 16); 16x16-pixel cells, cell index r*4 + c.
count = 1 + uniform(6). Cells: Fisher-Yates prefix over [0..15]: for i < count: j = i + uniform(16 - i);
swap(cells[i], cells[j]); object i goes to cells[i]. Then for each object i in order:
repeat { shape = uniform(4); color = uniform(5) } until (shape, color) differs from all earlier objects'.
Local pixel (x, y) in 0..15 of the cell is painted when (see `shape_mask`):
  square:   3 <= x <= 12 and 3 <= y <= 12
  circle:   (2x-15)^2 + (2y-15)^2 <= 121
  triangle: 3 <= y <= 12 and |2x-15| <= y - 2
  cross:    square and (6 <= x <= 9 or 6 <= y <= 9)
"""

from dataclasses import dataclass
from typing import List, Tuple

import numpy as np

from .rng import SplitMix64

IMAGE_SIZE = 64
CELL = 16
GRID = 4
BACKGROUND = (16, 16, 16)
SHAPES = ("square", "circle", "triangle", "cross")
COLORS = ("red", "green", "blue", "yellow", "white")
COLOR_RGB = ((220, 40, 40), (40, 190, 60), (50, 90, 230), (230, 210, 40), (235, 235, 235))
MAX_OBJECTS = 6


@dataclass(frozen=True)
class SceneObject:
    row: int
    col: int
    shape: int  # index into SHAPES
    color: int  # index into COLORS


@dataclass
class Scene:
    seed: int
    objects: List[SceneObject]
    image: np.ndarray  # uint8 [64, 64, 3], y then x then channel

    @property
    def count(self) -> int:
        return len(self.objects)


def shape_mask(shape: int) -> np.ndarray:
    """bool [16, 16] indexed [y, x]: the painted local pixels of `shape` inside one cell."""
    y, x = np.mgrid[0:CELL, 0:CELL]
    in_square = (x >= 3) & (x <= 12) & (y >= 3) & (y <= 12)
    if shape == 0:
        return in_square
    if shape == 1:
        return (2 * x - 15) ** 2 + (2 * y - 15) ** 2 <= 121
    if shape == 2:
        return (y >= 3) & (y <= 12) & (np.abs(2 * x - 15) <= y - 2)
    if shape == 3:
        return in_square & (((x >= 6) & (x <= 9)) | ((y >= 6) & (y <= 9)))
    raise ValueError(f"shape index must be in 0..3, got {shape}")


_MASKS = [shape_mask(s) for s in range(len(SHAPES))]


def scene_objects(seed: int) -> List[SceneObject]:
    """The object list of scene `seed` (cells and attributes drawn as in the module docstring)."""
    rng = SplitMix64(seed)
    count = 1 + rng.uniform(MAX_OBJECTS)
    cells = list(range(GRID * GRID))
    for i in range(count):
        j = i + rng.uniform(GRID * GRID - i)
        cells[i], cells[j] = cells[j], cells[i]
    used: List[Tuple[int, int]] = []
    objects = []
    for i in range(count):
        while True:
            shape = rng.uniform(len(SHAPES))
            color = rng.uniform(len(COLORS))
            if (shape, color) not in used:
                break
        used.append((shape, color))
        objects.append(SceneObject(cells[i] // GRID, cells[i] % GRID, shape, color))
    return objects


def render(objects: List[SceneObject]) -> np.ndarray:
    """uint8 [64, 64, 3] image of an object list."""
    image = np.empty((IMAGE_SIZE, IMAGE_SIZE, 3), dtype=np.uint8)
    image[:, :] = BACKGROUND
    for obj in objects:
        cell = image[obj.row * CELL:(obj.row + 1) * CELL, obj.col * CELL:(obj.col + 1) * CELL]
        cell[_MASKS[obj.shape]] = COLOR_RGB[obj.color]
    return image


def make_scene(seed: int) -> Scene:
    objects = scene_objects(seed)
    return Scene(seed=seed, objects=objects, image=render(objects))
