"""Train the tiny VLM on the tiny-shapes dataset (CPU, deterministic for a seed).

  train.py --out DIR [--seed S] [--minutes M] [--steps N] [--batch B] [--lr LR] [--aux-* ...] [--smoke]

Trains with teacher forcing (loss on the answer tokens and <eos>, plus the optional auxiliary losses of
--aux-weight/--aux-position, --aux-binding and --aux-ground, which shape vision positions, stated colours and
one attention head during training only), AdamW with warmup + cosine decay
over --steps (stopping early at --minutes of wall time), evaluates exact-match accuracy on held-out samples
(overall and per family) and writes config.json, model.safetensors, vocab.json (and train_log.json) into
DIR. Determinism: weights init from torch.manual_seed(seed), the training stream is dataset split
train(seed), batches are formed from that stream in order; only --minutes (wall clock) can change the
result, so reproducible runs fix --steps and leave --minutes large.
"""

import argparse
import json
import math
import os
import sys
import time
from typing import List, Optional

import numpy as np
import torch
import torch.nn.functional as F

from .dataset import FAMILIES, NOUNS, NUM_PATCHES, NUMBERS, Sample, train_sample
from .evaluate import evaluate
from .model import TinyVlm, TinyVlmConfig, VisionConfig, load_model, save_model
from .scene import COLORS, SHAPES, scene_objects
from .vocab import PAD, Vocab

IGNORE = -100


def init_weights(model: TinyVlm, seed: int) -> None:
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith(".bias"):
                p.zero_()
            elif name in ("model.embed_tokens.weight", "vision.pos_embed"):
                p.normal_(0.0, 0.5 if "pos_embed" in name else 1.0)
            else:
                p.normal_(0.0, 1.0 / math.sqrt(p.shape[1]))
        # residual branch outputs start small so the stack starts near identity
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.mul_(1.0 / math.sqrt(2 * len(model.model.layers)))
            layer.mlp.down_proj.weight.mul_(1.0 / math.sqrt(2 * len(model.model.layers)))


def image_start(i: int) -> int:
    """Prompt position of the first vision token of image i (<bos>, then <img> 64 patches </img> each)."""
    return 2 + i * (NUM_PATCHES + 2)


def cell_patches(row: int, col: int) -> List[int]:
    """Patch indices (pr * 8 + pc) of the 2x2 patches covering grid cell (row, col)."""
    return [(2 * row + dr) * 8 + 2 * col + dc for dr in (0, 1) for dc in (0, 1)]


def patch_targets(vocab: Vocab, image_seed: int, position: bool = False) -> List[torch.Tensor]:
    """Auxiliary targets of the 64 vision positions of an image, each [64] long: the colour word and the
    shape word of the object in the patch's grid cell (<pad> for background patches) and, with
    `position`, the row word and the column word of the patch's cell (one..four, background included)."""
    color = torch.full((NUM_PATCHES,), PAD, dtype=torch.long)
    shape = torch.full((NUM_PATCHES,), PAD, dtype=torch.long)
    for o in scene_objects(image_seed):
        cells = cell_patches(o.row, o.col)
        color[cells] = vocab.ids[COLORS[o.color]]
        shape[cells] = vocab.ids[SHAPES[o.shape]]
    if not position:
        return [color, shape]
    cell = torch.arange(NUM_PATCHES) // 16, (torch.arange(NUM_PATCHES) % 8) // 2
    number_ids = torch.tensor([vocab.ids[w] for w in NUMBERS[:4]])
    return [color, shape, number_ids[cell[0]], number_ids[cell[1]]]


def binding_targets(vocab: Vocab, prompt_ids: List[int]) -> torch.Tensor:
    """Auxiliary target of the prompt text: at a colour word that ends "NOUN is COLOUR" (the text-only
    statements), the noun it describes; IGNORE elsewhere. [len(prompt_ids)]."""
    colors = {vocab.ids[c] for c in COLORS}
    nouns = {vocab.ids[n] for n in NOUNS}
    is_id = vocab.ids["is"]
    tgt = torch.full((len(prompt_ids),), IGNORE, dtype=torch.long)
    for i in range(2, len(prompt_ids)):
        if prompt_ids[i] in colors and prompt_ids[i - 1] == is_id and prompt_ids[i - 2] in nouns:
            tgt[i] = prompt_ids[i - 2]
    return tgt


def grounding_keys(sample: Sample) -> List[int]:
    """Prompt positions of the vision patches showing the object a question is about ("what color is the
    SHAPE ?", "where is the COLOR SHAPE ?", "which image has the COLOR SHAPE ?": the 4 patches of its grid
    cell, in the image that has it); [] for questions about no single object (counting, "more shapes",
    text-only)."""
    w = sample.question.split()
    if w[:4] == ["what", "color", "is", "the"] and sample.family == "fine-grained":
        want = lambda o: SHAPES[o.shape] == w[4]
    elif w[:3] == ["where", "is", "the"] or w[:4] == ["which", "image", "has", "the"]:
        color, shape = w[-3], w[-2]
        want = lambda o: COLORS[o.color] == color and SHAPES[o.shape] == shape
    else:
        return []
    for i, seed in enumerate(sample.image_seeds):
        for o in scene_objects(seed):
            if want(o):
                return [image_start(i) + n for n in cell_patches(o.row, o.col)]
    raise ValueError(f"no object answers {sample.question!r} in images {sample.image_seeds}")


def grounding_loss(probs: torch.Tensor, samples: List[Sample]) -> Optional[torch.Tensor]:
    """Mean over the answer positions of grounded questions of -log(attention mass on the object's patches),
    from one head's probabilities probs [B, T, Tk]; None when no sample of the batch is grounded."""
    terms = []
    for b, s in enumerate(samples):
        keys = grounding_keys(s)
        if keys:
            p = len(s.prompt_ids)
            mass = probs[b, p - 1:p - 1 + len(s.answer_ids) - 1][:, keys].sum(-1)
            terms.append(-torch.log(mass + 1e-6))
    return torch.cat(terms).mean() if terms else None


def collate(samples: List[Sample], vocab: Optional[Vocab] = None, position: bool = False):
    """Right-padded batch: input ids [B, L], targets [B, L] (IGNORE outside the answer), images [N, ...],
    and with `vocab` the auxiliary targets: a list of vision target groups (colour, shape[, row, column]),
    each [B, L] (IGNORE outside vision positions), and the text binding targets [B, L]."""
    seqs = [s.prompt_ids + s.answer_ids[:-1] for s in samples]
    length = max(len(x) for x in seqs)
    ids = torch.full((len(samples), length), PAD, dtype=torch.long)
    tgt = torch.full((len(samples), length), IGNORE, dtype=torch.long)
    groups = 4 if position else 2
    vision_aux = [torch.full((len(samples), length), IGNORE, dtype=torch.long) for _ in range(groups)]
    binding = torch.full((len(samples), length), IGNORE, dtype=torch.long)
    for b, (s, x) in enumerate(zip(samples, seqs)):
        ids[b, :len(x)] = torch.tensor(x)
        p = len(s.prompt_ids)
        tgt[b, p - 1:p - 1 + len(s.answer_ids)] = torch.tensor(s.answer_ids)
        if vocab is not None:
            for i, seed in enumerate(s.image_seeds):
                start = image_start(i)
                for group, t in zip(vision_aux, patch_targets(vocab, seed, position)):
                    group[b, start:start + NUM_PATCHES] = t
            binding[b, :p] = binding_targets(vocab, s.prompt_ids)
    images = torch.from_numpy(np.concatenate([s.images for s in samples]))
    if vocab is None:
        return ids, tgt, images
    return ids, tgt, images, vision_aux, binding


class BatchStream:
    """Deterministic batches: chunks of `chunk` consecutive training samples are sorted by length (less
    padding) and cut into batches, which are used in a seeded shuffled order."""

    def __init__(self, vocab: Vocab, seed: int, batch: int, chunk_batches: int = 8,
                 focus_family: Optional[int] = None):
        self.vocab, self.seed, self.batch, self.chunk_batches = vocab, seed, batch, chunk_batches
        self.focus_family = focus_family  # when set, every even sample k is forced to this family
        self.k = 0
        self.queue: List[List[Sample]] = []
        self.gen = torch.Generator().manual_seed(seed + 12345)

    def next(self) -> List[Sample]:
        if not self.queue:
            n = self.batch * self.chunk_batches
            samples = [train_sample(self.vocab, self.seed, self.k + i,
                                    self.focus_family if (self.k + i) % 2 == 0 else None) for i in range(n)]
            self.k += n
            samples.sort(key=lambda s: len(s.prompt_ids) + len(s.answer_ids))
            batches = [samples[i:i + self.batch] for i in range(0, n, self.batch)]
            order = torch.randperm(len(batches), generator=self.gen).tolist()
            self.queue = [batches[i] for i in order]
        return self.queue.pop()


def lr_at(step: int, steps: int, lr: float, warmup: int) -> float:
    if step < warmup:
        return lr * (step + 1) / warmup
    t = (step - warmup) / max(1, steps - warmup)
    return lr * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * min(1.0, t))))


def make_config(vocab: Vocab, args) -> TinyVlmConfig:
    return TinyVlmConfig(vocab_size=len(vocab), hidden_size=args.hidden, intermediate_size=args.intermediate,
                         num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=args.hidden // 4, vision_config=VisionConfig(hidden_size=args.hidden))


def train(args) -> dict:
    torch.set_num_threads(args.threads)
    vocab = Vocab()
    if args.init_from:
        model, vocab = load_model(args.init_from)  # continue training (a second stage)
        torch.manual_seed(args.seed)
    else:
        model = TinyVlm(make_config(vocab, args))
        init_weights(model, args.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.98), weight_decay=args.wd)
    focus = FAMILIES.index(args.focus_family) if args.focus_family else None
    stream = BatchStream(vocab, args.seed, args.batch, focus_family=focus)
    ground = None
    if args.aux_ground > 0:
        if not 0 <= args.ground_layer < len(model.model.layers) or \
                not 0 <= args.ground_head < model.config.num_attention_heads:
            raise ValueError(f"--ground-layer {args.ground_layer} / --ground-head {args.ground_head} outside "
                             f"the model's {len(model.model.layers)} layers x "
                             f"{model.config.num_attention_heads} heads")
        ground = model.model.layers[args.ground_layer].self_attn
        ground.keep_probs = True
    t0, cpu0 = time.time(), time.process_time()
    losses: List[float] = []
    log = []
    step = 0
    for step in range(args.steps):
        if time.time() - t0 > args.minutes * 60:
            print(f"time limit reached after {step} steps", flush=True)
            break
        cur_lr = lr_at(step, args.steps, args.lr, args.warmup)
        for g in opt.param_groups:
            g["lr"] = cur_lr
        batch = stream.next()
        ids, tgt, images, vision_aux, binding = collate(batch, vocab, args.aux_position)
        model.train()
        logits = model(ids, images)
        flat = logits.view(-1, logits.shape[-1])
        loss = F.cross_entropy(flat, tgt.view(-1), ignore_index=IGNORE)
        total = loss
        if args.aux_weight > 0:
            # auxiliary dense supervision: each vision position names its cell's colour and shape (and row
            # and column with --aux-position)
            aux = sum(F.cross_entropy(flat, g.view(-1), ignore_index=IGNORE) for g in vision_aux)
            total = total + args.aux_weight * aux / len(vision_aux)
        if args.aux_binding > 0 and bool((binding != IGNORE).any()):
            # each stated colour names the noun it belongs to (text-only statements)
            total = total + args.aux_binding * F.cross_entropy(flat, binding.view(-1), ignore_index=IGNORE)
        if ground is not None:
            # one head learns to look at the object the question names (training signal only)
            g = grounding_loss(ground.last_probs[:, args.ground_head], batch)
            if g is not None:
                total = total + args.aux_ground * g
        opt.zero_grad(set_to_none=True)
        total.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(float(loss))
        if (step + 1) % args.log_every == 0 or step == 0:
            avg = sum(losses[-args.log_every:]) / len(losses[-args.log_every:])
            print(f"step {step + 1}/{args.steps} loss {avg:.4f} lr {cur_lr:.2e} "
                  f"{time.time() - t0:.0f}s", flush=True)
            log.append({"step": step + 1, "loss": avg, "seconds": round(time.time() - t0, 1)})
        if args.eval_every and (step + 1) % args.eval_every == 0:
            acc = evaluate(model, vocab, 100)
            print(f"  held-out (100): {acc['overall']:.3f} " +
                  " ".join(f"{f}={acc[f]:.2f}" for f in FAMILIES), flush=True)
    train_seconds = time.time() - t0
    # CPU seconds of this process (all torch threads): with --threads 1 on a shared machine, the time a
    # quiet core would take, which wall time (inflated by other jobs) does not show
    train_cpu_seconds = time.process_time() - cpu0
    model.eval()
    result = {"steps": len(losses), "train_seconds": round(train_seconds, 1),
              "train_cpu_seconds": round(train_cpu_seconds, 1), "first_loss": losses[0],
              "last_loss": sum(losses[-10:]) / len(losses[-10:]), "log": log}
    if args.eval_samples:
        acc = evaluate(model, vocab, args.eval_samples)
        result["heldout"] = acc
        print(f"held-out exact match on {args.eval_samples}: {acc['overall']:.4f} (" +
              ", ".join(f"{f} {acc[f]:.4f} of {acc['n_' + f]}" for f in FAMILIES) + ")", flush=True)
    if ground is not None:
        ground.keep_probs, ground.last_probs = False, None
    save_model(model, vocab, args.out)
    result["args"] = {k: v for k, v in vars(args).items()}
    with open(os.path.join(args.out, "train_log.json"), "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {args.out} (training {train_seconds:.0f}s wall, {train_cpu_seconds:.0f} CPU-s; "
          f"total {time.time() - t0:.0f}s)", flush=True)
    return result


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description="Train the kvscope tiny VLM on the tiny-shapes dataset (CPU).",
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="the shipped model (traces/models/tiny-shapes/README.md: 95.5 % held-out, "
                                        "about 25 CPU-minutes):\n  PYTHONPATH=capture/python /usr/bin/python3 -m "
                                        "kvscope.tinyvlm.train --out DIR --seed 0 --batch 32 \\\n"
                                        "    --steps 3000 --lr 2e-3 --warmup 150 --aux-weight 0.5 --aux-position "
                                        "--aux-binding 0.5 \\\n    --aux-ground 0.5 --threads 1 --eval-every 300 "
                                        "--eval-samples 400 --minutes 60")
    ap.add_argument("--out", required=True, help="output model directory")
    ap.add_argument("--seed", type=int, default=0, help="init and data seed (default 0)")
    ap.add_argument("--minutes", type=float, default=30.0, help="wall-clock limit (default 30)")
    ap.add_argument("--steps", type=int, default=None, help="optimizer steps (default 2000, smoke 40)")
    ap.add_argument("--batch", type=int, default=32, help="batch size (default 32)")
    ap.add_argument("--lr", type=float, default=2e-3, help="peak learning rate (default 2e-3)")
    ap.add_argument("--wd", type=float, default=0.01, help="AdamW weight decay (default 0.01)")
    ap.add_argument("--warmup", type=int, default=100, help="warmup steps (default 100)")
    ap.add_argument("--hidden", type=int, default=128, help="hidden size (default 128; head_dim = hidden/4)")
    ap.add_argument("--intermediate", type=int, default=384, help="MLP size (default 384)")
    ap.add_argument("--layers", type=int, default=4, help="decoder layers (default 4)")
    ap.add_argument("--aux-weight", type=float, default=0.0, help="weight of the auxiliary loss naming "
                    "each vision patch's colour and shape (default 0 = off)")
    ap.add_argument("--aux-position", action="store_true", help="the auxiliary vision loss also names "
                    "each patch's row and column words (one..four)")
    ap.add_argument("--aux-binding", type=float, default=0.0, help="weight of the auxiliary loss naming, at "
                    "each colour word of a text statement 'the NOUN is COLOUR', its noun (default 0 = off)")
    ap.add_argument("--aux-ground", type=float, default=0.0, help="weight of the auxiliary grounding loss: "
                    "at the answer positions of a question about one object, head --ground-head of layer "
                    "--ground-layer puts its attention on that object's 4 patches (default 0 = off)")
    ap.add_argument("--ground-layer", type=int, default=2, help="layer of the grounding head (default 2)")
    ap.add_argument("--ground-head", type=int, default=0, help="query head of the grounding loss (default 0)")
    ap.add_argument("--init-from", metavar="DIR", default=None, help="start from the weights of model DIR "
                    "instead of a random init (sizes come from its config; the data stream still starts at "
                    "sample 0 of train(seed), so use another --seed for a second stage)")
    ap.add_argument("--focus-family", choices=FAMILIES, default=None, help="curriculum: force every "
                    "second training sample to this family (default off)")
    ap.add_argument("--eval-samples", type=int, default=None, help="held-out samples for the final "
                    "evaluation (default 1000, smoke 0)")
    ap.add_argument("--eval-every", type=int, default=0, help="quick 100-sample eval every N steps (0 = off)")
    ap.add_argument("--log-every", type=int, default=25, help="progress line every N steps (default 25)")
    ap.add_argument("--threads", type=int, default=2, help="torch CPU threads (default 2; on a machine "
                    "shared with other jobs 1 can be much faster; results are deterministic per seed and "
                    "thread count)")
    ap.add_argument("--smoke", action="store_true", help="< 90 s run: tiny model, 40 steps, no eval")
    args = ap.parse_args(argv)
    if args.smoke:
        args.hidden, args.intermediate, args.layers, args.batch = 32, 64, 2, 16
        args.warmup, args.log_every = 5, 5
        args.steps = 40 if args.steps is None else args.steps
        args.eval_samples = 0 if args.eval_samples is None else args.eval_samples
    args.steps = 2000 if args.steps is None else args.steps
    args.eval_samples = 1000 if args.eval_samples is None else args.eval_samples
    if args.steps < 1 or args.batch < 1 or args.threads < 1 or args.hidden % 8:
        print("train: --steps, --batch and --threads must be >= 1 and --hidden a multiple of 8",
              file=sys.stderr)
        return 2
    try:
        train(args)
    except (OSError, ValueError) as e:
        print(f"train: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
