"""transformers support for the capture bridge: LLaMA-family and Qwen2 decoders, LLaVA and Qwen2-VL.

Importing this module does not import transformers; the adapter works on model objects the caller made.
Tested with transformers 5.2.0 on torch 2.15 (docs/capture.md lists what was tested).

How q, k, v are obtained: through transformers' public extension points only.
  - The attention function: kvscope registers `kvscope-sdpa` and `kvscope-eager` with
    `transformers.AttentionInterface` (and the matching mask functions with `AttentionMaskInterface`, so
    the model builds exactly the mask the real one gets). Inside a capture block the decoder's attention
    implementation is switched to the kvscope one (`model.set_attn_implementation`) and switched back at
    the end. The function receives the post-RoPE queries of the forward and the keys and values the
    model's `Cache.update` returned, i.e. exactly what the model caches; it calls the real sdpa / eager
    function with the same arguments and records q and the k / v of the forward's tokens.
  - Positions: a forward pre-hook on the decoder's rotary embedding sees the position ids the model uses
    (1-D, or M-RoPE's 3 x T for Qwen2-VL); the prefill's must equal `tokens.position` (and, for M-RoPE,
    the height / width components of vision tokens position + grid row / column).
  - Forward boundaries: a forward pre-hook and a forward hook on the model (torch's public hooks).
The run must use a dynamic KV cache (`use_cache=True`, the default of `generate`), batch 1.

    from kvscope import bridge, hf
    tokens = hf.tokens_for(model, input_ids[0], token_text=hf.token_text(tokenizer))
    with bridge.capture(model, "t.h5", tokens=tokens, token_text=hf.token_text(tokenizer)):
        model.generate(input_ids=input_ids, max_new_tokens=16)
"""

import sys
from typing import Any, Callable, Dict, List, Optional, Sequence

from .bridge import Adapter, BridgeError, Hooks, Recorder, TokenTable, TokenText, _text_fn
from .capture import Modality

KVSCOPE_ATTENTION = {"sdpa": "kvscope-sdpa", "eager": "kvscope-eager"}

# id(attention module) -> handler(module, base, query, key, value, attention_mask, kwargs) -> output.
# Filled by capture blocks (and kvscope's cache policies) for the modules they own, emptied when they end.
_ROUTES: Dict[int, Callable] = {}


def transformers_available() -> bool:
    try:
        import transformers  # noqa: F401 - only whether it imports
    except ImportError:
        return False
    return True


# ---- the registered attention functions ----------------------------------------------------------------
def _base_attention(module, implementation: str) -> Callable:
    """The real attention function a module would call under `implementation` (sdpa or eager)."""
    if implementation == "eager":
        fn = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
        if fn is None:
            raise BridgeError(f"{type(module).__name__}: its module has no eager_attention_forward")
        return fn
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    return ALL_ATTENTION_FUNCTIONS[implementation]  # the shared instance: a library's local override included


def _make_attention(implementation: str) -> Callable:
    def attention(module, query, key, value, attention_mask, **kwargs):
        base = _base_attention(module, implementation)
        handler = _ROUTES.get(id(module))
        if handler is None:
            return base(module, query, key, value, attention_mask, **kwargs)
        return handler(module, base, query, key, value, attention_mask, kwargs)
    attention.__name__ = f"kvscope_{implementation}_attention"
    return attention


def register_attention() -> None:
    """Registers kvscope-sdpa and kvscope-eager (attention and mask functions) with transformers; once."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    for base, name in KVSCOPE_ATTENTION.items():
        if name not in AttentionInterface._global_mapping:
            AttentionInterface.register(name, _make_attention(base))
        if name not in AttentionMaskInterface._global_mapping:
            AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[base])


# ---- where a transformers model keeps its decoder --------------------------------------------------------
def _text_config(config):
    return getattr(config, "text_config", None) or config


def _head_dim(tc) -> int:
    return int(getattr(tc, "head_dim", None) or tc.hidden_size // tc.num_attention_heads)


def _rope_theta(tc) -> float:
    params = getattr(tc, "rope_parameters", None)
    if isinstance(params, dict) and params.get("rope_theta") is not None:
        return float(params["rope_theta"])
    return float(getattr(tc, "rope_theta", None) or 10000.0)


def find_decoder(model):
    """The module holding the decoder layers (`layers`, each with `self_attn`) and the rotary embedding
    (`rotary_emb`): LlamaModel / Qwen2Model, LLaVA's language model, Qwen2-VL's text model."""
    for m in model.modules():
        layers = getattr(m, "layers", None)
        if (layers is not None and len(layers) and all(hasattr(l, "self_attn") for l in layers)
                and hasattr(m, "rotary_emb") and hasattr(m, "config")):
            return m
    raise BridgeError(f"{type(model).__name__}: no decoder with layers[i].self_attn and rotary_emb found "
                      "(the bridge supports LLaMA-family, Qwen2, LLaVA and Qwen2-VL models)")


def _implementation_of(config) -> str:
    impl = getattr(config, "_attn_implementation", None) or "sdpa"
    for base, name in KVSCOPE_ATTENTION.items():
        if impl == name:
            return base
    return impl


def _sub_config_key(model, decoder) -> str:
    """'' when the decoder shares the model's config, else the name of the model's sub-config it uses."""
    if decoder.config is model.config:
        return ""
    for key in getattr(model.config, "sub_configs", {}) or {}:
        if getattr(model.config, key, None) is decoder.config:
            return key
    return ""


class HfDecoder:
    """A transformers model's decoder: its layers' attention modules, geometry, and the switch of its
    attention implementation to kvscope's (and back)."""

    def __init__(self, model):
        self.model = model
        self.decoder = find_decoder(model)
        self.config = self.decoder.config
        self.attentions = [l.self_attn for l in self.decoder.layers]
        self.layer_of = {id(a): i for i, a in enumerate(self.attentions)}
        self.base = _implementation_of(self.config)
        if self.base not in KVSCOPE_ATTENTION:
            raise BridgeError(f"{type(model).__name__}: attention implementation {self.base!r} is not supported "
                              "(the bridge wraps sdpa and eager; load the model with attn_implementation="
                              "'sdpa' or 'eager')")
        self.mrope = isinstance(getattr(self.config, "rope_parameters", None), dict) and \
            "mrope_section" in self.config.rope_parameters

    def geometry(self) -> Dict[str, Any]:
        c = self.config
        mc = self.model.config
        return dict(num_layers=len(self.attentions), num_q_heads=c.num_attention_heads,
                    num_kv_heads=getattr(c, "num_key_value_heads", None) or c.num_attention_heads,
                    head_dim=_head_dim(c), rope_theta=_rope_theta(c),
                    model_name=getattr(mc, "_name_or_path", "") or getattr(mc, "model_type", "") or
                    type(self.model).__name__)

    def switch(self, hooks: Hooks) -> None:
        """Switches the decoder to kvscope's attention function until hooks.remove()."""
        register_attention()
        key = _sub_config_key(self.model, self.decoder)
        before = self.config._attn_implementation
        target = KVSCOPE_ATTENTION[self.base]
        if before == target:
            return

        def set_to(name):
            self.model.set_attn_implementation({key: name} if key else name)
            if self.config._attn_implementation != name:
                raise BridgeError(f"{type(self.model).__name__}: could not set the attention implementation "
                                  f"{name!r} (it stays {self.config._attn_implementation!r})")

        set_to(target)
        hooks.on_remove(lambda: set_to(before))

    def route(self, hooks: Hooks, handler: Callable) -> None:
        """handler(layer, module, base, query, key, value, attention_mask, kwargs) for every decoder attention
        module until hooks.remove()."""
        for a in self.attentions:
            if id(a) in _ROUTES:
                raise BridgeError(f"{type(self.model).__name__}: its attention is already hooked by kvscope "
                                  "(a capture or policy block inside another?)")
        for i, a in enumerate(self.attentions):
            _ROUTES[id(a)] = (lambda i: lambda *args: handler(i, *args))(i)
        hooks.on_remove(lambda: [_ROUTES.pop(id(a), None) for a in self.attentions])

    def watch_positions(self, hooks: Hooks, slot: Dict[str, Any]) -> None:
        """slot['position_ids'] = the position ids of the current forward ([B, t] or M-RoPE [3, B, t])."""
        def pre(module, args, kwargs):
            pos = kwargs.get("position_ids")
            if pos is None and len(args) > 1:
                pos = args[1]
            slot["position_ids"] = pos
        hooks.add(self.decoder.rotary_emb.register_forward_pre_hook(pre, with_kwargs=True))


# ---- the capture adapter ---------------------------------------------------------------------------------
class HfAdapter(Adapter):
    """Any supported transformers model (LlamaForCausalLM, Qwen2ForCausalLM, LlavaForConditionalGeneration,
    Qwen2VLForConditionalGeneration, ...): see the module docstring."""

    def __init__(self, model):
        super().__init__(model)
        self.hf = HfDecoder(model)
        self._slot: Dict[str, Any] = {}
        self.tokens: Optional[TokenTable] = None

    def geometry(self) -> Dict[str, Any]:
        return self.hf.geometry()

    def attach(self, recorder: Recorder, hooks: Hooks) -> None:
        self.hook_model_forward(recorder, hooks)
        self.hf.watch_positions(hooks, self._slot)
        self.hf.switch(hooks)
        if self.hf.mrope:
            recorder.next_position = None  # M-RoPE: the model picks the first decode position (checked)
        self.hf.route(hooks, lambda *args: self._attention(recorder, *args))

    def _positions(self, t: int):
        """The forward's position ids as lists: [t] (1-D) or 3 x [t] (M-RoPE), batch element 0."""
        pos = self._slot.get("position_ids")
        if pos is None:
            return None
        if pos.dim() == 3:  # M-RoPE [3, B, t] (or [4, B, t] with text positions first)
            pos = pos[-3:, 0]
            return [row.tolist() for row in pos]
        return pos[0].tolist() if pos.dim() == 2 else pos.tolist()

    def _check_prefill_positions(self, recorder: Recorder, positions) -> None:
        tok = recorder.tokens
        if positions is None:
            return
        rows = positions if isinstance(positions[0], list) else [positions]
        temporal = rows[0]
        for i, p in enumerate(tok.position):
            if temporal[i] != p:
                recorder.fail(f"token {i}: tokens.position is {p} but the model's position id is {temporal[i]} "
                              "(label the prompt with kvscope.hf.tokens_for)")
        if len(rows) == 3:
            for i, (p, r, c) in enumerate(zip(tok.position, tok.grid_row, tok.grid_col)):
                want = (p + r, p + c) if r >= 0 else (p, p)
                if (rows[1][i], rows[2][i]) != want:
                    recorder.fail(f"token {i}: M-RoPE position (t, h, w) = ({rows[0][i]}, {rows[1][i]}, "
                                  f"{rows[2][i]}), the tokens' (position, grid) give {(p, *want)}")
        recorder.min_next_position = max(max(r) for r in rows) + 1

    def _attention(self, recorder: Recorder, layer: int, module, base, query, key, value, attention_mask,
                   kwargs):
        began = recorder.attention_begin(layer)
        try:
            out = base(module, query, key, value, attention_mask, **kwargs)
        finally:
            if began:
                recorder.attention_end()
        if not recorder.active or not recorder.in_forward:
            return out
        t, tk = int(query.shape[2]), int(key.shape[2])
        try:
            positions = self._positions(t)
            if not recorder.prefilled:
                expected = recorder.T
                if not recorder.seen_any():
                    self._check_prefill_positions(recorder, positions)
            else:
                expected = recorder.T + recorder.decode_steps + t
            if tk != expected:
                recorder.fail(f"layer {layer}: the attention saw {tk} cached keys, expected {expected} (the bridge "
                              "records runs with a dynamic KV cache: use_cache=True, no static or offloaded cache)")
        except BaseException as e:
            recorder.error = recorder.error or e
            raise
        last = None
        if positions is not None:
            last = (positions[0] if isinstance(positions[0], list) else positions)[-1]
        recorder.layer(layer, query[0], key[0, :, tk - t:], value[0, :, tk - t:], last, batch=int(query.shape[0]))
        return out


def adapter_for(model) -> Adapter:
    return HfAdapter(model)


# ---- token labels ------------------------------------------------------------------------------------------
def _special_ids(config, extra: Sequence[int] = ()) -> List[int]:
    out = []
    for c in (config, _text_config(config)):
        for name in ("bos_token_id", "eos_token_id", "pad_token_id", "vision_start_token_id",
                     "vision_end_token_id"):
            v = getattr(c, name, None)
            for i in (v if isinstance(v, (list, tuple)) else [v]):
                if isinstance(i, int):
                    out.append(int(i))
    return out + [int(i) for i in extra]


def text_tokens(config, input_ids: Sequence[int], token_text: TokenText = None,
                special_ids: Sequence[int] = ()) -> TokenTable:
    """Labels of a text-only prompt: bos/eos/pad (and `special_ids`, e.g. a tokenizer's
    all_special_ids) special, the rest text, positions 0..T-1."""
    return TokenTable.from_ids([int(i) for i in input_ids], token_text, _special_ids(config, special_ids))


class _TableBuilder:
    def __init__(self, token_text: TokenText, special: Sequence[int]):
        self.text_of = _text_fn(token_text)
        self.special = set(special)
        self.t = TokenTable([], [], [], [], [], [], [] if self.text_of else None)

    def push(self, modality, token_id, position, segment, row=-1, col=-1):
        t = self.t
        t.modality.append(int(modality))
        t.position.append(int(position))
        t.token_id.append(int(token_id))
        t.segment.append(int(segment))
        t.grid_row.append(int(row))
        t.grid_col.append(int(col))
        if t.text is not None:
            t.text.append(self.text_of(token_id) if token_id >= 0 else "")

    def text(self, i: int, position: int, segment: int):
        self.push(Modality.SPECIAL if i in self.special else Modality.TEXT, i, position, segment)


def llava_tokens(config, input_ids: Sequence[int], token_text: TokenText = None,
                 special_ids: Sequence[int] = ()) -> TokenTable:
    """Labels of a LLaVA prompt (1-D ids as the processor makes them: each image's `image_token_index`
    repeated once per image feature): vision tokens on the vision tower's patch grid (row-major), segment =
    image index, token_id -1; text segment = number of images before it; bos/eos/pad special. With
    vision_feature_select_strategy "full" the first token of each image (CLS) has grid (-1, -1)."""
    vc = config.vision_config
    grid = int(vc.image_size) // int(vc.patch_size)
    strategy = getattr(config, "vision_feature_select_strategy", "default")
    if strategy not in ("default", "full"):
        raise ValueError(f"vision_feature_select_strategy {strategy!r} is not supported (default, full)")
    cls = 1 if strategy == "full" else 0
    per_image = cls + grid * grid
    b = _TableBuilder(token_text, _special_ids(config, special_ids))
    ids = [int(x) for x in input_ids]
    images, run = 0, 0
    for pos, i in enumerate(ids):
        if i == config.image_token_index:
            p = run - cls
            b.push(Modality.VISION, -1, pos, images, p // grid if p >= 0 else -1, p % grid if p >= 0 else -1)
            run += 1
            if run == per_image:
                images, run = images + 1, 0
            continue
        if run:
            raise ValueError(f"image {images} has {run} image tokens before token {pos}, expected {per_image} "
                             "(grid^2, +1 with the 'full' strategy): expand the prompt as LlavaProcessor does")
        b.text(i, pos, images)
    if run:
        raise ValueError(f"the last image has {run} image tokens, expected {per_image}")
    return b.t


def qwen2vl_tokens(config, input_ids: Sequence[int], image_grid_thw, token_text: TokenText = None,
                   special_ids: Sequence[int] = ()) -> TokenTable:
    """Labels of a Qwen2-VL prompt (1-D ids as Qwen2VLProcessor makes them: <|vision_start|>, the image's
    `image_token_id` once per merged patch, <|vision_end|>). image_grid_thw: per image (t, h, w) in vision
    patches; the merger joins spatial_merge_size^2 (2x2) patches into one token, so image i has
    (h / m) x (w / m) vision tokens, grid (row, col) on that merged grid in row-major order, segment = image
    index, token_id -1. Positions follow M-RoPE (Qwen2VLModel.get_rope_index): `position` is the temporal
    component; a vision token's height / width components are position + row / position + col, a text
    token's all equal position; text after an image continues at the image's largest component + 1.
    Videos (t > 1) are not supported."""
    m = int(config.vision_config.spatial_merge_size)
    grids = [[int(x) for x in row] for row in (image_grid_thw.tolist() if hasattr(image_grid_thw, "tolist")
                                              else image_grid_thw)]
    b = _TableBuilder(token_text, _special_ids(config, special_ids))
    ids = [int(x) for x in input_ids]
    image_token = int(config.image_token_id)
    images, pos, i = 0, 0, 0
    while i < len(ids):
        if ids[i] != image_token:
            b.text(ids[i], pos, images)
            pos += 1
            i += 1
            continue
        if images >= len(grids):
            raise ValueError(f"more images in input_ids than the {len(grids)} rows of image_grid_thw")
        gt, gh, gw = grids[images]
        if gt != 1:
            raise ValueError(f"image {images}: grid t = {gt}; videos (t > 1) are not supported")
        rows, cols = gh // m, gw // m
        n = rows * cols
        if ids[i:i + n] != [image_token] * n:
            have = len(ids[i:i + n]) - ids[i:i + n][::-1].index(image_token) if image_token in ids[i:i + n] else 0
            raise ValueError(f"image {images}: image_grid_thw {grids[images]} gives {n} tokens, input_ids have "
                             f"a run of {have}")
        for k in range(n):
            b.push(Modality.VISION, -1, pos, images, k // cols, k % cols)
        pos += max(rows, cols)
        images += 1
        i += n
    if images != len(grids):
        raise ValueError(f"image_grid_thw has {len(grids)} rows, input_ids have {images} images")
    return b.t


def tokens_for(model, input_ids: Sequence[int], token_text: TokenText = None, image_grid_thw=None,
               special_ids: Sequence[int] = ()) -> TokenTable:
    """The labels of a prompt for `model`: llava_tokens, qwen2vl_tokens or text_tokens by model type."""
    model_type = getattr(model.config, "model_type", "")
    ids = input_ids.reshape(-1).tolist() if hasattr(input_ids, "reshape") else list(input_ids)
    if model_type == "llava":
        return llava_tokens(model.config, ids, token_text, special_ids)
    if model_type in ("qwen2_vl", "qwen2_5_vl"):
        if image_grid_thw is None:
            image_grid_thw = []
        return qwen2vl_tokens(model.config, ids, image_grid_thw, token_text, special_ids)
    return text_tokens(model.config, ids, token_text, special_ids)


# ---- tokenizers --------------------------------------------------------------------------------------------
def _byte_decoder() -> Dict[str, int]:
    """GPT-2's byte-level alphabet, reversed: the character a byte-level BPE token uses -> the byte."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("\u00a1"), ord("\u00ac") + 1)) +
                 list(range(ord("\u00ae"), ord("\u00ff") + 1)))
    chars, n = {}, 0
    for byte in range(256):
        if byte in printable:
            chars[chr(byte)] = byte
        else:
            chars[chr(256 + n)] = byte
            n += 1
    return chars


def token_bytes(tokenizer) -> Callable[[int], bytes]:
    """id -> the bytes the token stands for, for a byte-level BPE tokenizer (GPT-2, SmolLM2, Qwen2):
    added tokens (<|im_start|>, ...) as their text in UTF-8, other tokens through the byte alphabet. This
    is the text kvcap run records per token."""
    decoder = _byte_decoder()
    added = {int(i): t.content for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items()}
    cache: Dict[int, bytes] = {}

    def of(i: int) -> bytes:
        i = int(i)
        if i not in cache:
            if i in added:
                cache[i] = added[i].encode()
            else:
                piece = tokenizer.convert_ids_to_tokens(i)
                if piece is None:
                    cache[i] = b""
                elif all(ch in decoder for ch in piece):
                    cache[i] = bytes(decoder[ch] for ch in piece)
                else:
                    cache[i] = piece.encode()
        return cache[i]
    return of


def token_text(tokenizer) -> Callable[[int], bytes]:
    """The per-token text kvscope records (token_bytes): pass it as token_text= to capture()."""
    return token_bytes(tokenizer)


def special_ids(tokenizer) -> List[int]:
    """The tokenizer's special tokens (added tokens marked special), for text_tokens(special_ids=...)."""
    return sorted(int(i) for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items() if t.special)


# ---- kvscope's long-context tasks (docs/tasks.md) ----------------------------------------------------------
ROLE_CONTEXT, ROLE_QUESTION, ROLE_ANSWER, ROLE_TEMPLATE = 0, 1, 2, 3


def task_prompt(tokenizer, sample: Dict[str, Any]):
    """The token ids and roles of a task sample (one JSON line of `kvcap tasks`) exactly as `kvcap eval
    --task` / `kvcap run --task` build them: the user message through the tokenizer's chat template (the
    assistant turn opened), the answer prefix appended, encoded without added special tokens; each token's
    role from the byte its text starts at (closedloop::task_token_roles: template up to the haystack,
    context, question, template, answer prefix). Returns (ids, roles, split) where split is the first
    question token: `kvcap run --task` prefills ids[:split] and feeds the rest as decode steps."""
    head = tokenizer.apply_chat_template([{"role": "user", "content": sample["user"]}], tokenize=False,
                                         add_generation_prompt=True)
    text = (head + sample["answer_prefix"]).encode()
    head_b, user_b = head.encode(), sample["user"].encode()
    user = head_b.rfind(user_b)
    if user < 0:
        raise ValueError(f"task sample {sample.get('index')}: the user message is not in the rendered prompt")
    ids = tokenizer(head + sample["answer_prefix"], add_special_tokens=False)["input_ids"]
    piece = token_bytes(tokenizer)
    bounds = [(user + int(sample["context_char"]), ROLE_TEMPLATE), (user + int(sample["question_char"]), ROLE_CONTEXT),
              (user + len(user_b), ROLE_QUESTION), (len(head_b), ROLE_TEMPLATE)]
    roles, at = [], 0
    for i, t in enumerate(ids):
        b = piece(t)
        if text[at:at + len(b)] != b:
            raise ValueError(f"task sample {sample.get('index')}: token {i} does not spell the prompt at byte {at}")
        roles.append(next((role for end, role in bounds if at < end), ROLE_ANSWER))
        at += len(b)
    if at != len(text):
        raise ValueError(f"task sample {sample.get('index')}: the tokens spell {at} of {len(text)} bytes")
    split = roles.index(ROLE_QUESTION) if ROLE_QUESTION in roles else len(ids)
    return ids, roles, split


# ---- kvscope policies inside the model (kvscope.hf_policy; needs the native kvscope package) ---------------
def apply_policy(model, policy, budget=None, **kwargs):
    """kvscope.hf_policy.apply_policy: a kvscope policy applied to the model's cache after the prefill and,
    for decode-time policies, during generation (the C++ closed loop's compressors)."""
    from .hf_policy import apply_policy as apply
    return apply(model, policy, budget, **kwargs)


def prefill(model, input_ids):
    """kvscope.hf_policy.Prefill: one uncompressed prefill to continue several apply_policy runs from."""
    from .hf_policy import Prefill
    return Prefill(model, input_ids)

