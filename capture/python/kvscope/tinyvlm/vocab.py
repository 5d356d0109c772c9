"""Vocabulary and tokeniser of the tiny VLM.

Tokeniser (spec): lowercase; "?" and "." are split off as their own tokens (also when attached to a word);
split on whitespace; every word must be in the vocabulary (unknown word = `UnknownWordError` naming it).
Ids are indices into `vocab.json` ({"tokens": [...]}). Vision positions inside a token-id sequence are
marked with `IMAGE_PATCH_ID` (-1), which is never a vocabulary id.
"""

import json
import os
from typing import Dict, List, Sequence

PAD, BOS, EOS, IMG_START, IMG_END, SEP = 0, 1, 2, 3, 4, 5
IMAGE_PATCH_ID = -1

SPECIAL_TOKENS = ["<pad>", "<bos>", "<eos>", "<img>", "</img>", "<sep>"]
# Fixed order: changing it changes every id (and invalidates trained models).
WORDS = [
    "?", ".", "the",
    # scene attributes
    "square", "circle", "triangle", "cross",
    "red", "green", "blue", "yellow", "white",
    "one", "two", "three", "four", "five", "six",
    # question / answer words
    "what", "color", "is", "where", "row", "column", "how", "many", "shapes", "shape",
    "there", "are", "which", "image", "has", "more", "first", "second", "and",
    # text-only nouns
    "ball", "car", "hat", "cup", "box", "kite",
]
DEFAULT_TOKENS = SPECIAL_TOKENS + WORDS


class UnknownWordError(ValueError):
    """A word of a prompt is not in the vocabulary."""

    def __init__(self, word: str):
        super().__init__(f"unknown word '{word}' (not in vocab.json)")
        self.word = word


def split_words(text: str) -> List[str]:
    """Lowercase, split '?' and '.' off as separate tokens, split on whitespace."""
    text = text.lower().replace("?", " ? ").replace(".", " . ")
    return text.split()


class Vocab:
    def __init__(self, tokens: Sequence[str] = DEFAULT_TOKENS):
        self.tokens = list(tokens)
        if self.tokens[:len(SPECIAL_TOKENS)] != SPECIAL_TOKENS:
            raise ValueError(f"vocab must start with {SPECIAL_TOKENS}")
        if len(set(self.tokens)) != len(self.tokens):
            raise ValueError("vocab has duplicate tokens")
        self.ids: Dict[str, int] = {t: i for i, t in enumerate(self.tokens)}

    def __len__(self) -> int:
        return len(self.tokens)

    def encode(self, text: str) -> List[int]:
        """Token ids of the words of `text` (no special tokens added)."""
        out = []
        for word in split_words(text):
            if word not in self.ids or word in SPECIAL_TOKENS:
                raise UnknownWordError(word)
            out.append(self.ids[word])
        return out

    def decode(self, ids: Sequence[int]) -> str:
        return " ".join(self.tokens[i] if i >= 0 else "<patch>" for i in ids)

    def save(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump({"tokens": self.tokens}, f, indent=1)
            f.write("\n")

    @staticmethod
    def load(path: str) -> "Vocab":
        with open(path) as f:
            data = json.load(f)
        if not isinstance(data, dict) or "tokens" not in data:
            raise ValueError(f"{path}: expected an object with a 'tokens' list")
        return Vocab(data["tokens"])


def default_vocab_path(model_dir: str) -> str:
    return os.path.join(model_dir, "vocab.json")
