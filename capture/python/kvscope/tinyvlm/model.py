"""The tiny VLM: a LLaMA decoder (RMSNorm, RoPE with optional linear/NTK scaling, GQA, SwiGLU) plus a
vision tower (linear patch embedding + learned position embedding + 2-layer GELU projector).

Module tree = weight names of the spec (`model.layers.{i}.self_attn.q_proj.weight`, ...). Token-id
sequences mark vision positions with IMAGE_PATCH_ID (-1): the n-th run of 64 such ids (row-major over the
batch) receives the 64 projected patch embeddings of the n-th image of `images`.

Attention modules are self-contained for the PyTorch bridge: `LlamaAttention.forward(x, positions,
past_kv)` computes q, k, v, applies `self.rotary_emb(q, k, positions)` (hook it for post-RoPE queries),
concatenates past_kv and attends; it returns (output, (k, v)) with k post-RoPE, shapes [B, Hkv, T, Dh].
"""

import json
import math
import os
from dataclasses import dataclass, field, asdict
from typing import List, Optional, Sequence, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import safetensors_io
from .vocab import IMAGE_PATCH_ID, EOS, Vocab

KVCache = List[Optional[Tuple[torch.Tensor, torch.Tensor]]]  # per layer (k post-RoPE, v) [B, Hkv, T, Dh]


@dataclass
class VisionConfig:
    image_size: int = 64
    patch_size: int = 8
    num_channels: int = 3
    hidden_size: int = 128
    projector: str = "mlp2x_gelu"

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2


@dataclass
class TinyVlmConfig:
    vocab_size: int
    hidden_size: int = 128
    intermediate_size: int = 384
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 32
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: Optional[dict] = None
    max_position_embeddings: int = 512
    tie_word_embeddings: bool = False
    bos_token_id: int = 1
    eos_token_id: int = 2
    image_start_token_id: int = 3
    image_end_token_id: int = 4
    sep_token_id: int = 5
    vision_config: VisionConfig = field(default_factory=VisionConfig)

    def to_json(self) -> dict:
        d = {"architectures": ["KvscopeTinyVlm"], "model_type": "kvscope-tiny-vlm"}
        d.update(asdict(self))
        return d

    @staticmethod
    def from_json(d: dict) -> "TinyVlmConfig":
        if d.get("model_type") != "kvscope-tiny-vlm":
            raise ValueError("config.json: model_type must be 'kvscope-tiny-vlm', "
                             f"got {d.get('model_type')!r}")
        known = set(TinyVlmConfig.__dataclass_fields__)
        kwargs = {k: v for k, v in d.items() if k in known}
        kwargs["vision_config"] = VisionConfig(**d.get("vision_config", {}))
        cfg = TinyVlmConfig(**kwargs)
        cfg.validate()
        return cfg

    def validate(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("config: num_attention_heads must be a multiple of num_key_value_heads")
        if self.head_dim % 2:
            raise ValueError("config: head_dim must be even")
        rs = self.rope_scaling
        if rs is not None and (rs.get("type") not in ("linear", "ntk") or float(rs.get("factor", 0)) <= 0):
            raise ValueError(f"config: unsupported rope_scaling {rs!r} (null, linear or ntk with factor > 0)")
        if self.vision_config.image_size % self.vision_config.patch_size:
            raise ValueError("config: vision image_size must be a multiple of patch_size")


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class RotaryEmbedding(nn.Module):
    """HF rotate_half RoPE. inv_freq[i] = base^(-2i/Dh); linear scaling divides positions by the factor;
    static NTK scales the base: base = theta * factor^(Dh/(Dh-2))."""

    def __init__(self, head_dim: int, theta: float, scaling: Optional[dict]):
        super().__init__()
        base = theta
        self.pos_scale = 1.0
        if scaling is not None:
            factor = float(scaling["factor"])
            if scaling["type"] == "linear":
                self.pos_scale = 1.0 / factor
            else:
                base = theta * factor ** (head_dim / (head_dim - 2))
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)  # float64 [Dh/2]

    def cos_sin(self, positions: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """positions [T] -> cos, sin [T, Dh] (float32, computed in float64)."""
        angle = (positions.to(torch.float64) * self.pos_scale)[:, None] * self.inv_freq[None, :]
        angle = torch.cat([angle, angle], dim=-1)
        return angle.cos().float(), angle.sin().float()

    @staticmethod
    def rotate_half(x: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        return torch.cat([-x[..., half:], x[..., :half]], dim=-1)

    def forward(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor):
        """q [B, Hq, T, Dh], k [B, Hkv, T, Dh], positions [T] -> rotated (q, k)."""
        cos, sin = self.cos_sin(positions)
        return q * cos + self.rotate_half(q) * sin, k * cos + self.rotate_half(k) * sin


class LlamaAttention(nn.Module):
    def __init__(self, cfg: TinyVlmConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        d = cfg.hidden_size
        self.q_proj = nn.Linear(d, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(d, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(d, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, d, bias=False)
        self.rotary_emb = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
        # training only: when set, forward keeps its attention probabilities [B, Hq, T, Tk] in last_probs
        # (train.py's grounding loss); the computation is the same either way
        self.keep_probs = False
        self.last_probs: Optional[torch.Tensor] = None

    def forward(self, x: torch.Tensor, positions: torch.Tensor,
                past_kv: Optional[Tuple[torch.Tensor, torch.Tensor]] = None):
        """x [B, T, d]; positions [T] (absolute); past_kv (k, v) [B, Hkv, Tp, Dh] or None.
        Returns (out [B, T, d], (k, v) [B, Hkv, Tp + T, Dh] with k post-RoPE)."""
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q, k = self.rotary_emb(q, k, positions)
        if past_kv is not None:
            k = torch.cat([past_kv[0], k], dim=2)
            v = torch.cat([past_kv[1], v], dim=2)
        group = self.num_heads // self.num_kv_heads
        kk = k.repeat_interleave(group, dim=1)
        vv = v.repeat_interleave(group, dim=1)
        scores = torch.matmul(q, kk.transpose(-1, -2)) / math.sqrt(self.head_dim)  # [B, Hq, T, Tk]
        tk = kk.shape[2]
        q_pos = torch.arange(tk - t, tk, device=x.device)[:, None]
        k_pos = torch.arange(tk, device=x.device)[None, :]
        scores = scores.masked_fill(k_pos > q_pos, float("-inf"))
        probs = torch.softmax(scores.float(), dim=-1)
        self.last_probs = probs if self.keep_probs else None
        out = torch.matmul(probs, vv).transpose(1, 2).reshape(b, t, self.num_heads * self.head_dim)
        return self.o_proj(out), (k, v)


class LlamaMLP(nn.Module):
    def __init__(self, d: int, inter: int):
        super().__init__()
        self.gate_proj = nn.Linear(d, inter, bias=False)
        self.up_proj = nn.Linear(d, inter, bias=False)
        self.down_proj = nn.Linear(inter, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: TinyVlmConfig, layer_idx: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = LlamaAttention(cfg, layer_idx)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = LlamaMLP(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, h, positions, past_kv=None):
        a, kv = self.self_attn(self.input_layernorm(h), positions, past_kv)
        h = h + a
        h = h + self.mlp(self.post_attention_layernorm(h))
        return h, kv


class LlamaModel(nn.Module):
    def __init__(self, cfg: TinyVlmConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList([DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class VisionTower(nn.Module):
    def __init__(self, vc: VisionConfig):
        super().__init__()
        self.vc = vc
        self.patch_embed = nn.Linear(vc.num_channels * vc.patch_size ** 2, vc.hidden_size)
        self.pos_embed = nn.Parameter(torch.zeros(vc.num_patches, vc.hidden_size))

    def patchify(self, images: torch.Tensor) -> torch.Tensor:
        """uint8 [N, S, S, C] -> float [N, Np, C*P*P], patch n = pr*G + pc, entry (py*P + px)*C + c."""
        vc = self.vc
        n, s = images.shape[0], vc.image_size
        if tuple(images.shape[1:]) != (s, s, vc.num_channels):
            raise ValueError(f"images: expected [N, {s}, {s}, {vc.num_channels}], got {list(images.shape)}")
        g, p = s // vc.patch_size, vc.patch_size
        x = images.float() / 127.5 - 1.0
        x = x.view(n, g, p, g, p, vc.num_channels).permute(0, 1, 3, 2, 4, 5)
        return x.reshape(n, g * g, p * p * vc.num_channels)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.patch_embed(self.patchify(images)) + self.pos_embed


class TinyVlm(nn.Module):
    def __init__(self, cfg: TinyVlmConfig):
        super().__init__()
        cfg.validate()
        self.config = cfg
        vc = cfg.vision_config
        self.vision = VisionTower(vc)
        self.mm_projector = nn.Sequential(nn.Linear(vc.hidden_size, cfg.hidden_size), nn.GELU(),
                                          nn.Linear(cfg.hidden_size, cfg.hidden_size))
        self.model = LlamaModel(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    # ---- forward -------------------------------------------------------------------------------------
    def image_embeddings(self, images: torch.Tensor) -> torch.Tensor:
        """uint8 [N, 64, 64, 3] -> projected vision token embeddings [N, 64, d]."""
        return self.mm_projector(self.vision(images))

    def embed(self, input_ids: torch.Tensor, images: Optional[torch.Tensor]) -> torch.Tensor:
        """input_ids [B, T] (vision positions = -1) -> embeddings [B, T, d]."""
        is_patch = input_ids == IMAGE_PATCH_ID
        x = self.model.embed_tokens(input_ids.clamp(min=0))
        n_patch = int(is_patch.sum())
        if n_patch:
            if images is None or images.shape[0] * self.config.vision_config.num_patches != n_patch:
                have = 0 if images is None else images.shape[0]
                raise ValueError(f"input_ids have {n_patch} vision positions but {have} images were given")
            vis = self.image_embeddings(images).reshape(-1, self.config.hidden_size)
            x = x.clone()
            x[is_patch] = vis.to(x.dtype)
        return x

    def forward(self, input_ids: torch.Tensor, images: Optional[torch.Tensor] = None,
                past: Optional[KVCache] = None, start_pos: int = 0, return_cache: bool = False):
        """input_ids [B, T] or [T]; images uint8 [N, 64, 64, 3] in order of appearance. Returns logits
        [B, T, V] (and the updated per-layer KV cache when return_cache)."""
        squeeze = input_ids.dim() == 1
        if squeeze:
            input_ids = input_ids[None]
        h = self.embed(input_ids, images)
        positions = torch.arange(start_pos, start_pos + input_ids.shape[1])
        cache: KVCache = []
        for i, layer in enumerate(self.model.layers):
            h, kv = layer(h, positions, None if past is None else past[i])
            cache.append(kv)
        logits = self.lm_head(self.model.norm(h))
        if squeeze:
            logits = logits[0]
        return (logits, cache) if return_cache else logits

    @torch.no_grad()
    def generate(self, input_ids: Sequence[int], images: Optional[torch.Tensor] = None, max_new: int = 12,
                 use_cache: bool = True) -> List[int]:
        """Greedy decoding from the logits of the last prompt token; stops after <eos> (included) or
        max_new tokens. use_cache=False recomputes the full sequence each step (reference)."""
        ids = torch.as_tensor(list(input_ids), dtype=torch.long)
        logits, cache = self(ids, images, return_cache=True)
        out: List[int] = []
        pos = ids.shape[0]
        full = ids
        for _ in range(max_new):
            nxt = int(torch.argmax(logits[-1]))
            out.append(nxt)
            if nxt == self.config.eos_token_id:
                break
            step = torch.tensor([nxt])
            if use_cache:
                logits, cache = self(step, None, past=cache, start_pos=pos, return_cache=True)
            else:
                full = torch.cat([full, step])
                logits = self(full, images)
            pos += 1
        return out


# ---- save / load ---------------------------------------------------------------------------------------
def state_dict_f32(model: TinyVlm) -> dict:
    return {k: v.detach().float().contiguous() for k, v in model.state_dict().items()}


def save_model(model: TinyVlm, vocab: Vocab, out_dir: str) -> None:
    """Writes config.json, model.safetensors, vocab.json into out_dir."""
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(model.config.to_json(), f, indent=2)
        f.write("\n")
    safetensors_io.save_file(state_dict_f32(model), os.path.join(out_dir, "model.safetensors"),
                             metadata={"format": "pt"})
    vocab.save(os.path.join(out_dir, "vocab.json"))


def load_model(model_dir: str) -> Tuple[TinyVlm, Vocab]:
    with open(os.path.join(model_dir, "config.json")) as f:
        cfg = TinyVlmConfig.from_json(json.load(f))
    vocab = Vocab.load(os.path.join(model_dir, "vocab.json"))
    if len(vocab) != cfg.vocab_size:
        raise ValueError(f"{model_dir}: vocab.json has {len(vocab)} tokens, "
                         f"config vocab_size {cfg.vocab_size}")
    model = TinyVlm(cfg)
    tensors, _ = safetensors_io.load_file(os.path.join(model_dir, "model.safetensors"))
    expected = model.state_dict()
    missing = sorted(set(expected) - set(tensors))
    extra = sorted(set(tensors) - set(expected))
    if missing or extra:
        raise ValueError(f"{model_dir}/model.safetensors: missing {missing}, unexpected {extra}")
    for name, t in tensors.items():
        if tuple(t.shape) != tuple(expected[name].shape):
            raise ValueError(f"{model_dir}/model.safetensors: '{name}' has shape {list(t.shape)}, "
                             f"expected {list(expected[name].shape)}")
    model.load_state_dict({k: v.float() for k, v in tensors.items()})
    model.eval()
    return model, vocab
