"""transformers support for the capture bridge: LLaMA-family decoders and LLaVA.

Importing this module does not import transformers; the adapters work on model objects the caller made.
Tested with transformers 4.40.2 on torch 1.13 (eager attention, DynamicCache).

How q, k, v are obtained (per attention module, one wrapper around its forward):
  - k and v: after the module's forward, from the model's own KV cache (`past_key_value`, updated in place by
    the module): the entries of the tokens of this forward, i.e. post-RoPE keys exactly as cached;
  - q: recomputed from the module's input with its own `q_proj` and rotary embedding (the same functions
    the module calls, from the module's source file), post-RoPE — one extra q projection per layer.
The run must use the KV cache (`use_cache=True`, the default of `generate`), batch 1.

    from kvscope import bridge, hf
    tokens = hf.llava_tokens(model.config, input_ids[0], token_text=tokenizer.convert_ids_to_tokens)
    with bridge.capture(model, "llava.h5", tokens=tokens, token_text=tokenizer.convert_ids_to_tokens):
        model.generate(input_ids=input_ids, pixel_values=pixel_values, max_new_tokens=16)
"""

import inspect
import sys
from typing import Any, Dict, List, Sequence

from .bridge import Adapter, BridgeError, Patcher, Recorder, TokenTable, TokenText, _text_fn, bind_arguments
from .capture import Modality


def transformers_available() -> bool:
    try:
        import transformers  # noqa: F401 - only whether it imports
    except ImportError:
        return False
    return True


def _text_config(config):
    return getattr(config, "text_config", None) or config


def _head_dim(tc) -> int:
    return int(getattr(tc, "head_dim", None) or tc.hidden_size // tc.num_attention_heads)


def _special_ids(tc) -> List[int]:
    return [int(i) for i in (getattr(tc, "bos_token_id", None), getattr(tc, "eos_token_id", None),
                             getattr(tc, "pad_token_id", None)) if isinstance(i, int)]


def text_tokens(config, input_ids: Sequence[int], token_text: TokenText = None) -> TokenTable:
    """Labels of a text-only prompt of a LLaMA-family model: bos/eos/pad ids special, the rest text."""
    return TokenTable.from_ids([int(i) for i in input_ids], token_text, _special_ids(_text_config(config)))


def llava_tokens(config, input_ids: Sequence[int], token_text: TokenText = None) -> TokenTable:
    """Labels of a LLaVA prompt (one sequence, 1-D ids): each `image_token_index` expands, as the model
    merges it, into the image's features: vision tokens on the vision tower's patch grid (row-major),
    segment = image index; text segment = number of images before it; bos/eos/pad special. With
    vision_feature_select_strategy "full" the first token of each image (CLS) has grid (-1, -1)."""
    vc = config.vision_config
    grid = int(vc.image_size) // int(vc.patch_size)
    strategy = getattr(config, "vision_feature_select_strategy", "default")
    if strategy not in ("default", "full"):
        raise ValueError(f"vision_feature_select_strategy {strategy!r} is not supported (default, full)")
    cls = 1 if strategy == "full" else 0
    special = set(_special_ids(_text_config(config)))
    text_of = _text_fn(token_text)
    t = TokenTable([], [], [], [], [], [], [] if text_of else None)

    def push(modality, token_id, segment, row, col, text):
        t.modality.append(int(modality))
        t.position.append(len(t.position))
        t.token_id.append(token_id)
        t.segment.append(segment)
        t.grid_row.append(row)
        t.grid_col.append(col)
        if t.text is not None:
            t.text.append(text)

    images = 0
    for i in (int(x) for x in input_ids):
        if i == config.image_token_index:
            for n in range(cls + grid * grid):
                p = n - cls
                push(Modality.VISION, -1, images, p // grid if p >= 0 else -1, p % grid if p >= 0 else -1, "")
            images += 1
        else:
            push(Modality.SPECIAL if i in special else Modality.TEXT, i, images, -1, -1,
                 text_of(i) if text_of else "")
    return t


def _cache_kv(cache, layer_idx: int):
    """(k, v) [B, Hkv, Tk, D] of one layer from a transformers Cache object or a legacy (k, v) tuple."""
    if cache is None:
        return None
    if hasattr(cache, "key_cache"):
        if layer_idx >= len(cache.key_cache):
            return None
        return cache.key_cache[layer_idx], cache.value_cache[layer_idx]
    if isinstance(cache, (tuple, list)) and len(cache) == 2 and hasattr(cache[0], "shape"):
        return cache[0], cache[1]
    return None


class LlamaFamilyAdapter(Adapter):
    """LLaMA-family decoders (LlamaForCausalLM and models with the same attention: q_proj/k_proj/v_proj,
    rotary_emb, layer_idx, a Cache). `decoder` is the module holding `.layers` (LlamaModel)."""

    def __init__(self, model, decoder=None, config=None):
        super().__init__(model)
        self.decoder = decoder if decoder is not None else model.model
        self.config = _text_config(config if config is not None else model.config)
        layers = getattr(self.decoder, "layers", None)
        if layers is None or not all(hasattr(l, "self_attn") for l in layers):
            raise BridgeError(f"{type(model).__name__}: no decoder layers with self_attn found")
        self.attentions = [l.self_attn for l in layers]
        for a in self.attentions:
            for name in ("q_proj", "rotary_emb", "layer_idx"):
                if not hasattr(a, name):
                    raise BridgeError(f"{type(model).__name__}: attention module {type(a).__name__} has no "
                                      f"'{name}' (not a LLaMA-family attention this bridge supports)")

    def geometry(self) -> Dict[str, Any]:
        c = self.config
        return dict(num_layers=len(self.attentions), num_q_heads=c.num_attention_heads,
                    num_kv_heads=getattr(c, "num_key_value_heads", None) or c.num_attention_heads,
                    head_dim=_head_dim(c), rope_theta=float(getattr(c, "rope_theta", 10000.0)),
                    model_name=getattr(self.model.config, "_name_or_path", "") or
                    getattr(self.model.config, "model_type", type(self.model).__name__))

    def attach(self, recorder: Recorder, patcher: Patcher) -> None:
        self.wrap_model_forward(recorder, patcher)
        hq, d = self.config.num_attention_heads, _head_dim(self.config)
        for attn in self.attentions:
            patcher.wrap(attn, lambda original, attn=attn: self._wrapper(original, attn, recorder, hq, d))

    @staticmethod
    def _queries(attn, hidden, args: Dict[str, Any], hq: int, d: int):
        """Post-RoPE queries [B, Hq, t, D] recomputed with the module's q_proj and rotary embedding."""
        import torch

        rope_module = sys.modules[type(attn).__module__]
        b, t, _ = hidden.shape
        with torch.no_grad():
            q = attn.q_proj(hidden).view(b, t, hq, d).transpose(1, 2)
            position_ids = args.get("position_ids")
            if args.get("position_embeddings") is not None:  # newer transformers: (cos, sin) passed in
                cos, sin = args["position_embeddings"]
                q, _ = rope_module.apply_rotary_pos_emb(q, q, cos, sin)
            elif "position_ids" in inspect.signature(attn.rotary_emb.forward).parameters:  # 4.38 .. 4.47
                if position_ids is None:
                    raise BridgeError("attention called without position_ids")
                cos, sin = attn.rotary_emb(q, position_ids)
                q, _ = rope_module.apply_rotary_pos_emb(q, q, cos, sin)
            else:  # 4.36 / 4.37: cos/sin tables indexed by position_ids inside apply_rotary_pos_emb
                cos, sin = attn.rotary_emb(q, seq_len=int(position_ids.max()) + 1)
                q, _ = rope_module.apply_rotary_pos_emb(q, q, cos, sin, position_ids)
        return q

    def _wrapper(self, original, attn, recorder: Recorder, hq: int, d: int):
        def forward(*args, **kwargs):
            with recorder.attention_range(attn.layer_idx):
                out = original(*args, **kwargs)
            if not recorder.active:
                return out
            bound = bind_arguments(original, args, kwargs)
            hidden = bound.get("hidden_states", args[0] if args else None)
            t = hidden.shape[1]
            cache = getattr(attn, "past_key_value", None) or bound.get("past_key_value")
            if cache is None and isinstance(out, tuple) and len(out) > 2:
                cache = out[2]
            kv = _cache_kv(cache, attn.layer_idx)
            try:
                if kv is None:
                    recorder.fail(f"layer {attn.layer_idx}: no KV cache after the attention forward; run the "
                                  "model with use_cache=True")
                start = kv[0].shape[2] - t
                cache_position = bound.get("cache_position")
                if cache_position is not None and kv[0].shape[2] != int(cache_position[-1]) + 1:
                    start = int(cache_position[0])  # a pre-allocated (static) cache
                q = self._queries(attn, hidden, bound, hq, d)
            except BaseException as e:
                recorder.error = recorder.error or e
                raise
            position_ids = bound.get("position_ids")
            position = None if position_ids is None else int(position_ids.reshape(-1)[-1])
            recorder.layer(attn.layer_idx, q[0], kv[0][0, :, start:start + t], kv[1][0, :, start:start + t],
                           position, batch=hidden.shape[0])
            return out
        return forward


class LlavaAdapter(LlamaFamilyAdapter):
    """LlavaForConditionalGeneration: the language model's attention; vision tokens come from llava_tokens."""

    def __init__(self, model):
        lm = model.language_model
        super().__init__(model, decoder=getattr(lm, "model", lm), config=model.config.text_config)


def adapter_for(model) -> Adapter:
    model_type = getattr(model.config, "model_type", "")
    if model_type == "llava":
        return LlavaAdapter(model)
    if hasattr(model, "model") and hasattr(model.model, "layers"):
        return LlamaFamilyAdapter(model)
    raise BridgeError(f"unsupported transformers model {type(model).__name__} (model_type {model_type!r}): "
                      "the bridge supports LLaMA-family decoders and LLaVA")


def tokens_for(model, input_ids: Sequence[int], token_text: TokenText = None) -> TokenTable:
    """llava_tokens for a LLaVA model, text_tokens otherwise."""
    if getattr(model.config, "model_type", "") == "llava":
        return llava_tokens(model.config, input_ids, token_text)
    return text_tokens(model.config, input_ids, token_text)

