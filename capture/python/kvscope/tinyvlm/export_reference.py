"""Reference tensors for the C++ runner-vs-PyTorch test, and the tiny random-init fixtures.

Usage:
  export_reference.py --model DIR                       writes DIR/reference.safetensors
  export_reference.py --random-fixture DIR [--rope-scaling none|linear:F|ntk:F] [--seed S]
      creates a small random-init model (hidden 32, 2 layers, 4 q / 2 kv heads, head_dim 8,
      intermediate 64, vision 64x64 / patch 8 / vision hidden 48) in DIR + DIR/reference.safetensors

Layout of reference.safetensors (all tensors little-endian, row-major):
  For each sample i in 0..n_samples-1:
    sample.{i}.input_ids      I32 [T]   full prompt: <bos>, per image <img> + 64 x (-1) + </img>, question
                                        words, <sep>. -1 (IMAGE_PATCH_ID) marks a vision position; the n-th
                                        run of 64 (-1) is image n, patch p = pr*8 + pc in order.
    sample.{i}.images         U8  [n_img, 64, 64, 3]   (absent when the sample has no image)
    sample.{i}.vision_embeds  F32 [n_img*64, d]   mm_projector(patch_embed(patch) + pos_embed) (absent
                                        when no image)
    sample.{i}.logits         F32 [T, V]   prefill logits at every prompt position (positions 0..T-1)
    sample.{i}.generated      I32 [G]   greedy tokens from the logits at <sep>, each fed back at position
                                        T, T+1, ...; ends with <eos> (2) unless max_new was reached
    sample.{i}.step_logits    F32 [G, V]   row 0 = logits[T-1]; row g = logits after feeding generated[g-1]
    sample.{i}.q_layer0       F32 [Hq, T, Dh]   layer-0 prefill queries after RoPE
    sample.{i}.k_layer0       F32 [Hkv, T, Dh]  layer-0 prefill keys after RoPE
    sample.{i}.v_layer0       F32 [Hkv, T, Dh]  layer-0 prefill values
  For each scene j in 0..n_scenes-1 (seeds in metadata scene_seeds, some >= 2^63):
    scene.{j}.image           U8  [64, 64, 3]
    scene.{j}.objects         I32 [count, 4]   rows (row, col, shape, color) in object order
  __metadata__ (all values strings; JSON where structured):
    layout_version "1", image_patch_id "-1", n_samples, n_scenes, max_new,
    samples: JSON list of {"family", "question", "answer" (dataset answer, "" if none), "image_seeds"
             (list), "generated_text"},
    scene_seeds: JSON list of unsigned 64-bit integers,
    tokenization: JSON list of {"text", "ids"} (ids of the words only, no special tokens),
    tokenization_errors: JSON list of {"text", "unknown_word"} (encoding must fail naming that word),
    config: the config.json text.
"""

import argparse
import json
import os
import sys
from typing import List

import numpy as np
import torch

from . import safetensors_io
from .dataset import FAMILIES, Sample, build_prompt, heldout_sample
from .model import TinyVlm, TinyVlmConfig, VisionConfig, load_model, save_model
from .scene import make_scene
from .vocab import UnknownWordError, Vocab

SCENE_SEEDS = [0, 1, 2, 3, 7, 42, 1234, (1 << 32) + 5, (1 << 63) + 11, (1 << 64) - 1]
TOKENIZATION_TEXTS = ["what color is the circle?", "How many shapes ?",
                      "The ball is RED.what color is the ball?", "  where is   the blue\tcross ?  ",
                      "row four column one", "?.?"]
TOKENIZATION_ERRORS = [("what colour is the circle ?", "colour"), ("the Dog is red .", "dog"),
                       ("what is <sep> ?", "<sep>")]
TEXT_ONLY_QUESTION = "the cup is green and the kite is white . what color is the kite ?"


def reference_samples(vocab: Vocab) -> List[Sample]:
    """First held-out sample of each family, plus one prompt without any image."""
    chosen = {}
    k = 0
    while len(chosen) < len(FAMILIES):
        s = heldout_sample(vocab, k)
        chosen.setdefault(s.family, s)
        k += 1
    samples = [chosen[f] for f in FAMILIES]
    samples.append(Sample(family="no-image", question=TEXT_ONLY_QUESTION, answer="the kite is white",
                          image_seeds=[], images=np.zeros((0, 64, 64, 3), np.uint8),
                          prompt_ids=build_prompt(vocab, 0, TEXT_ONLY_QUESTION), answer_ids=[]))
    return samples


@torch.no_grad()
def export(model: TinyVlm, vocab: Vocab, path: str, max_new: int = 12) -> None:
    model.eval()
    tensors = {}
    sample_meta = []
    captured = {}
    attn0 = model.model.layers[0].self_attn

    def rot_hook(_mod, _inp, out):
        captured["q"], captured["k"] = out

    def v_hook(_mod, _inp, out):
        captured["v"] = out

    handles = [attn0.rotary_emb.register_forward_hook(rot_hook), attn0.v_proj.register_forward_hook(v_hook)]
    try:
        for i, s in enumerate(reference_samples(vocab)):
            ids = torch.tensor(s.prompt_ids, dtype=torch.long)
            images = torch.from_numpy(s.images) if len(s.image_seeds) else None
            logits = model(ids, images)
            t = ids.shape[0]
            cfg = model.config
            q, k = captured["q"][0], captured["k"][0]
            v = captured["v"][0].view(t, cfg.num_key_value_heads, cfg.head_dim).transpose(0, 1)
            gen = model.generate(s.prompt_ids, images, max_new=max_new)
            full = torch.tensor(s.prompt_ids + gen[:-1], dtype=torch.long) if len(gen) > 1 else ids
            all_logits = model(full, images)
            step_logits = all_logits[t - 1:t - 1 + len(gen)]
            p = f"sample.{i}."
            tensors[p + "input_ids"] = ids.to(torch.int32)
            if images is not None:
                tensors[p + "images"] = images
                tensors[p + "vision_embeds"] = model.image_embeddings(images).reshape(-1, cfg.hidden_size)
            tensors[p + "logits"] = logits.float()
            tensors[p + "generated"] = torch.tensor(gen, dtype=torch.int32)
            tensors[p + "step_logits"] = step_logits.float()
            tensors[p + "q_layer0"] = q.contiguous()
            tensors[p + "k_layer0"] = k.contiguous()
            tensors[p + "v_layer0"] = v.contiguous()
            sample_meta.append({"family": s.family, "question": s.question, "answer": s.answer,
                                "image_seeds": s.image_seeds, "generated_text": vocab.decode(gen)})
    finally:
        for h in handles:
            h.remove()
    for j, seed in enumerate(SCENE_SEEDS):
        sc = make_scene(seed)
        tensors[f"scene.{j}.image"] = torch.from_numpy(sc.image)
        tensors[f"scene.{j}.objects"] = torch.tensor([[o.row, o.col, o.shape, o.color] for o in sc.objects],
                                                     dtype=torch.int32)
    errors = []
    for text, word in TOKENIZATION_ERRORS:
        try:
            vocab.encode(text)
            raise AssertionError(f"tokenising {text!r} should fail")
        except UnknownWordError as e:
            assert e.word == word, (e.word, word)
        errors.append({"text": text, "unknown_word": word})
    metadata = {
        "layout_version": "1", "image_patch_id": "-1", "n_samples": str(len(sample_meta)),
        "n_scenes": str(len(SCENE_SEEDS)), "max_new": str(max_new), "samples": json.dumps(sample_meta),
        "scene_seeds": json.dumps(SCENE_SEEDS),
        "tokenization": json.dumps([{"text": t, "ids": vocab.encode(t)} for t in TOKENIZATION_TEXTS]),
        "tokenization_errors": json.dumps(errors), "config": json.dumps(model.config.to_json()),
    }
    safetensors_io.save_file(tensors, path, metadata)


def random_fixture_model(vocab: Vocab, rope_scaling, seed: int) -> TinyVlm:
    """Small random model with O(1) logits (so a 1e-3 comparison is meaningful)."""
    cfg = TinyVlmConfig(vocab_size=len(vocab), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=8, rope_scaling=rope_scaling,
                        vision_config=VisionConfig(hidden_size=48))
    torch.manual_seed(seed)
    model = TinyVlm(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("layernorm.weight") or name == "model.norm.weight":
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif name.endswith(".bias"):
                p.copy_(0.1 * torch.randn_like(p))
            elif p.dim() == 2 and "embed_tokens" not in name and "pos_embed" not in name:
                p.copy_(torch.randn_like(p) / p.shape[1] ** 0.5)
            else:
                p.copy_(torch.randn_like(p))
    return model


def parse_rope_scaling(text: str):
    if text == "none":
        return None
    kind, _, factor = text.partition(":")
    if kind not in ("linear", "ntk") or not factor:
        raise ValueError(f"--rope-scaling: expected none, linear:F or ntk:F, got {text!r}")
    return {"type": kind, "factor": float(factor)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="example: export_reference.py --model traces/models/tiny-shapes")
    g = ap.add_mutually_exclusive_group(required=True)
    g.add_argument("--model", help="trained model directory (config.json, model.safetensors, vocab.json)")
    g.add_argument("--random-fixture", metavar="DIR", help="create a random-init fixture model in DIR")
    ap.add_argument("--rope-scaling", default="none", help="fixture RoPE scaling: none, linear:F, ntk:F "
                    "(default none)")
    ap.add_argument("--seed", type=int, default=0, help="fixture init seed (default 0)")
    ap.add_argument("--max-new", type=int, default=None, help="greedy tokens per sample (default 12, "
                    "fixtures 8)")
    args = ap.parse_args(argv)
    torch.set_num_threads(2)
    try:
        if args.model:
            model, vocab = load_model(args.model)
            out_dir = args.model
        else:
            vocab = Vocab()
            model = random_fixture_model(vocab, parse_rope_scaling(args.rope_scaling), args.seed)
            out_dir = args.random_fixture
            save_model(model, vocab, out_dir)
        max_new = args.max_new or (12 if args.model else 8)
        export(model, vocab, os.path.join(out_dir, "reference.safetensors"), max_new=max_new)
    except (OSError, ValueError) as e:
        print(f"export_reference: {e}", file=sys.stderr)
        return 2
    print(f"wrote {os.path.join(out_dir, 'reference.safetensors')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
