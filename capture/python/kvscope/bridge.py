"""The PyTorch capture bridge: record a model run into a kvscope trace through the capture C API.

    from kvscope import bridge
    ids, tokens = bridge.tinyvlm_prompt(vocab, model.config, "how many shapes ?", n_images=1)
    with bridge.capture(model, "t.h5", tokens=tokens, token_text=vocab.tokens) as cap:
        answer = model.generate(ids, images, max_new=8)
    # t.h5 is complete here; had `generate` raised, the trace would be left incomplete (aborted) and the
    # exception would propagate.

While the block runs, the adapter's hooks are attached to the model (PyTorch forward hooks and, for
transformers models, kvscope's attention function registered with transformers' AttentionInterface; all
removed on exit). The first forward of the model is the prefill: it must cover exactly the context
tokens given in `tokens`; each later forward (a KV-cache forward) feeds one or more tokens, each recorded
as one decode step: a forward of n tokens (a question fed after the context, chunked prefill) is decode
steps s .. s+n-1, token j's query attending causally to the cache and tokens 0..j of the forward.
Per layer the bridge records the prefill q [Hq, T, D] and post-RoPE k, v [Hkv, T, D], and per decode step
q [Hq, 1, D] and the appended k, v [Hkv, 1, D], plus the fed token (id, position, text) and ranges
("prefill", "decode N", "layer NNN/attention"). Token roles (context / question / answer / template,
docs/trace-format.md) are optional: `TokenTable.role` for the context, `cap.set_decode_roles(...)` inside
the block for the decode steps. Tensors go to the library as they are: host tensors as host
pointers with their strides (no copy), CUDA tensors as device pointers on the current stream.

Adapters say where a model keeps its attention: `TinyVlmAdapter` (kvscope.tinyvlm: forward hooks on the
rotary embedding and the attention modules) and, in kvscope.hf, transformers LLaMA-family, Qwen2, LLaVA
and Qwen2-VL models (q, k, v as the model's attention function receives them, through
transformers.AttentionInterface).
"""

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

from .capture import Capture, Modality

TokenText = Union[None, Callable[[int], str], Sequence[str]]


class BridgeError(RuntimeError):
    """The model did not run the way the bridge records it (wrong prefill length, a layer that did not run,
    batch > 1), or the capture was aborted."""


# ---- tokens ------------------------------------------------------------------------------------------------
@dataclass
class TokenTable:
    """Labels of the T context tokens (trace /tokens). Lists of length T."""
    modality: List[int]  # kvscope Modality codes: 0 text, 1 vision, 2 audio, 3 special
    position: List[int]
    token_id: List[int]  # -1 where there is none (image patches)
    segment: List[int]  # image index for image tokens; for text, the number of images before it
    grid_row: List[int]  # patch grid row of vision tokens, -1 otherwise
    grid_col: List[int]
    text: Optional[List[Union[str, bytes]]] = None  # per-token text ("" for patches) or None
    role: Optional[List[int]] = None  # per-token role (0 context, 1 question, 2 answer, 3 template) or None

    def __len__(self) -> int:
        return len(self.modality)

    def check(self) -> None:
        n = len(self)
        for name in ("position", "token_id", "segment", "grid_row", "grid_col"):
            if len(getattr(self, name)) != n:
                have = len(getattr(self, name))
                raise ValueError(f"TokenTable.{name} has {have} entries, modality has {n}")
        if self.text is not None and len(self.text) != n:
            raise ValueError(f"TokenTable.text has {len(self.text)} entries, modality has {n}")
        if self.role is not None and len(self.role) != n:
            raise ValueError(f"TokenTable.role has {len(self.role)} entries, modality has {n}")

    @staticmethod
    def from_ids(ids: Sequence[int], token_text: TokenText = None, special_ids: Sequence[int] = (),
                 start_position: int = 0) -> "TokenTable":
        """A text-only context: ids in `special_ids` are labelled special, the rest text; positions count
        from `start_position`, segment 0."""
        ids = [int(i) for i in ids]
        special = set(int(s) for s in special_ids)
        n = len(ids)
        text_of = _text_fn(token_text)
        return TokenTable(
            modality=[Modality.SPECIAL if i in special else Modality.TEXT for i in ids],
            position=list(range(start_position, start_position + n)), token_id=ids, segment=[0] * n,
            grid_row=[-1] * n, grid_col=[-1] * n,
            text=None if text_of is None else [text_of(i) for i in ids])


def _as_text(x):
    return x if isinstance(x, (bytes, bytearray)) else str(x)


def _text_fn(token_text: TokenText) -> Optional[Callable[[int], Union[str, bytes]]]:
    """id -> text (str, or bytes for a byte-level token that is part of a UTF-8 character)."""
    if token_text is None:
        return None
    if callable(token_text):
        return lambda i: _as_text(token_text(int(i)))
    table = token_text
    return lambda i: _as_text(table[int(i)]) if 0 <= int(i) < len(table) else ""


def tinyvlm_prompt(vocab, config, question: str, n_images: int) -> Tuple[List[int], TokenTable]:
    """The tiny VLM's prompt ids (vision positions = -1) and their labels, exactly as `kvcap run` labels them:
    <bos>, <img>, </img>, <sep> special; patches vision with grid (n // G, n % G) and segment = image index;
    question words text with segment = number of images; text = vocab words ("" for patches)."""
    from .tinyvlm.dataset import build_prompt
    from .tinyvlm.vocab import IMAGE_PATCH_ID

    ids = build_prompt(vocab, n_images, question)
    grid = config.vision_config.image_size // config.vision_config.patch_size
    specials = {config.bos_token_id, config.eos_token_id, config.image_start_token_id,
                config.image_end_token_id, config.sep_token_id, 0}
    t = TokenTable([], [], [], [], [], [], [])
    image, patch = 0, 0
    for pos, i in enumerate(ids):
        row = col = -1
        if i == IMAGE_PATCH_ID:
            modality, row, col = Modality.VISION, patch // grid, patch % grid
            patch += 1
        else:
            modality = Modality.SPECIAL if i in specials else Modality.TEXT
        t.modality.append(int(modality))
        t.position.append(pos)
        t.token_id.append(i)
        t.segment.append(image)
        t.grid_row.append(row)
        t.grid_col.append(col)
        t.text.append(vocab.tokens[i] if i >= 0 else "")
        if i == config.image_end_token_id:
            image, patch = image + 1, 0
    return ids, t


# ---- recording ---------------------------------------------------------------------------------------------
class Recorder:
    """Turns the adapters' per-forward, per-layer reports into C API calls, checking the run's shape.
    The first error stops recording (later reports are ignored) and is re-raised when the block ends.

    Adapters call `begin_forward(input_ids)` / `end_forward()` around every forward of the whole model and
    `layer(...)` once per decoder layer and forward."""

    def __init__(self, cap: Capture, num_layers: int, tokens: TokenTable, token_text: TokenText):
        self.cap = cap
        self.num_layers = num_layers
        self.tokens = tokens
        self.T = len(tokens)
        self.text_of = _text_fn(token_text)
        self.prefilled = False
        self.decode_steps = 0
        # Position id of the next decode step: T for models with 1-D positions; None where the model picks
        # the first one (M-RoPE), which must then be at least min_next_position.
        self.next_position: Optional[int] = self.T
        self.min_next_position = self.T
        self.error: Optional[BaseException] = None
        self._in_forward = False
        self._fed_ids: List[int] = []  # the ids of the current decode forward (-1 where not known)
        self._forward_tokens = 0  # tokens of the current decode forward (set by its first layer)
        self._seen: List[bool] = []

    @property
    def active(self) -> bool:
        return self.error is None and self.cap.is_open

    @property
    def in_forward(self) -> bool:
        return self._in_forward

    def seen_any(self) -> bool:
        """Whether a layer of the current forward has been recorded."""
        return any(self._seen)

    def fail(self, message: str) -> None:
        raise BridgeError(f"{self.cap.path}: {message}")

    def _record_error(self, e: BaseException) -> None:
        self.error = self.error or e

    def begin_forward(self, input_ids=None) -> bool:
        """Start of one forward of the whole model; input_ids (any shape) tells the decode steps' tokens.
        Returns False (and records nothing) when not recording or already inside a forward."""
        if not self.active or self._in_forward:
            return False
        try:
            if self.prefilled:
                self._fed_ids = [] if input_ids is None else [int(i) for i in input_ids.reshape(-1)]
                self._forward_tokens = 0
                name = f"decode {self.decode_steps}"
            else:
                name = "prefill"
            self._seen = [False] * self.num_layers
            self._in_forward = True
            self.cap.range_push(name)
        except BaseException as e:
            self._record_error(e)
            raise
        return True

    def end_forward(self, failed: bool = False) -> None:
        """End of the forward begun by begin_forward (failed: it raised)."""
        if not self._in_forward:
            return
        self._in_forward = False
        if self.cap.is_open:
            self.cap.range_pop()
        if failed or not self.active:
            return
        missing = [i for i, seen in enumerate(self._seen) if not seen]
        try:
            if missing:
                phase = f"decode step {self.decode_steps}" if self.prefilled else "the prefill"
                self.fail(f"layers {missing} did not run during {phase}")
            if self.prefilled:
                self.decode_steps += self._forward_tokens
                self.next_position += self._forward_tokens
            self.prefilled = True
        except BaseException as e:
            self.error = e
            raise

    @contextlib.contextmanager
    def forward(self, input_ids=None):
        """begin_forward / end_forward around a block."""
        began = self.begin_forward(input_ids)
        try:
            yield
        except BaseException as e:
            if began:
                self._record_error(e)
                self.end_forward(failed=True)
            raise
        if began:
            self.end_forward()

    def layer(self, layer: int, q, k, v, position: Optional[int] = None, batch: int = 1) -> None:
        """q [Hq, t, D], k/v [Hkv, t, D] (post-RoPE, batch element 0) of the tokens of the current forward;
        `position` is the position id of the forward's last token (decode); `batch` the forward's batch."""
        if not self.active or not self._in_forward:
            return
        try:
            t = int(q.shape[1])
            if batch != 1:
                self.fail(f"layer {layer}: a forward of batch {batch}; the bridge records batch 1")
            if not 0 <= layer < self.num_layers:
                self.fail(f"attention module reported layer {layer}, the model has {self.num_layers}")
            if self._seen[layer]:
                self.fail(f"layer {layer} ran twice in one forward")
            self._seen[layer] = True
            if not self.prefilled:
                if t != self.T:
                    self.fail(f"the prefill forward has {t} tokens but tokens= describes {self.T}")
                self.cap.prefill_layer(layer, q, k, v)
                return
            step = self.decode_steps
            if not any(self._seen[:layer]):  # first layer of this forward: its t fed tokens, steps step..
                if self._fed_ids and len(self._fed_ids) != t:
                    self.fail(f"decode step {step}: the model was fed {len(self._fed_ids)} tokens but layer "
                              f"{layer} got {t}")
                self._forward_tokens = t
                if self.next_position is None:  # the model's first decode position (M-RoPE)
                    if position is None:
                        self.fail(f"decode step {step}: the model's position ids are unknown")
                    self.next_position = int(position) - (t - 1)
                    if self.next_position < self.min_next_position:
                        self.fail(f"decode step {step}: position {self.next_position} is inside the context "
                                  f"(its positions reach {self.min_next_position - 1})")
                first = self.next_position
                last = first + t - 1 if position is None else int(position)  # the last token's position
                if last - (t - 1) != first:
                    self.fail(f"decode step {step}: a forward of {t} tokens at positions {last - (t - 1)}.."
                              f"{last} does not continue the cache at position {first} (a forward "
                              "without the KV cache, e.g. use_cache=False?); generate with the KV cache")
                for j in range(t):
                    fed = self._fed_ids[j] if self._fed_ids else -1
                    text = None if self.text_of is None or fed < 0 else self.text_of(fed)
                    self.cap.decode_token(step + j, fed, first + j, text)
            elif t != self._forward_tokens:
                self.fail(f"decode step {step}: layer {layer} got {t} tokens, layer 0 got {self._forward_tokens}")
            for j in range(t):
                self.cap.decode_layer(layer, step + j, q[:, j:j + 1], k[:, j:j + 1], v[:, j:j + 1])
        except BaseException as e:
            self._record_error(e)
            raise

    def attention_begin(self, layer: int) -> bool:
        if not self.active or not self._in_forward:
            return False
        self.cap.range_push(f"layer {layer:03d}/attention")
        return True

    def attention_end(self) -> None:
        if self.cap.is_open:
            self.cap.range_pop()

    @contextlib.contextmanager
    def attention_range(self, layer: int):
        began = self.attention_begin(layer)
        try:
            yield
        finally:
            if began:
                self.attention_end()


class Hooks:
    """What an adapter attached: PyTorch hook handles and undo functions, all removed by `remove()`."""

    def __init__(self):
        self._undo: List[Callable[[], None]] = []

    def add(self, handle) -> None:
        """A torch.utils.hooks.RemovableHandle (from register_forward_hook and friends)."""
        self._undo.append(handle.remove)

    def on_remove(self, undo: Callable[[], None]) -> None:
        self._undo.append(undo)

    def remove(self) -> None:
        while self._undo:
            self._undo.pop()()


def forward_ids(args, kwargs, name: str = "input_ids"):
    """The ids a model's forward was called with (keyword `name` or the first positional argument)."""
    ids = kwargs.get(name)
    if ids is None and args:
        ids = args[0]
    return ids if hasattr(ids, "reshape") else None


# ---- adapters ----------------------------------------------------------------------------------------------
class Adapter:
    """Where a model family keeps its attention. Subclasses fill `geometry()` and `attach()`."""

    def __init__(self, model):
        self.model = model

    def geometry(self) -> Dict[str, Any]:
        """num_layers, num_q_heads, num_kv_heads, head_dim, rope_theta, model_name."""
        raise NotImplementedError

    def attach(self, recorder: Recorder, hooks: Hooks) -> None:
        raise NotImplementedError

    def hook_model_forward(self, recorder: Recorder, hooks: Hooks, ids_name: str = "input_ids") -> None:
        """Every call of the model is one prefill / decode forward (a forward pre-hook and a forward hook on
        the model; a forward that raises is recorded as the error by the capture block)."""
        def pre(module, args, kwargs):
            recorder.begin_forward(forward_ids(args, kwargs, ids_name))

        def post(module, args, kwargs, output):
            if output is None and recorder.in_forward:  # the forward raised (always_call)
                recorder.error = recorder.error or BridgeError(f"{recorder.cap.path}: the model's forward raised")
                recorder.end_forward(failed=True)
                return
            recorder.end_forward()

        hooks.add(self.model.register_forward_pre_hook(pre, with_kwargs=True))
        hooks.add(self.model.register_forward_hook(post, with_kwargs=True, always_call=True))


class TinyVlmAdapter(Adapter):
    """kvscope.tinyvlm.TinyVlm: post-RoPE q from a forward hook on each layer's `rotary_emb`, the k/v of the
    new tokens from the (k, v) cache the attention module returns (a forward hook on it)."""

    def geometry(self) -> Dict[str, Any]:
        c = self.model.config
        base = c.rope_theta
        if c.rope_scaling and c.rope_scaling.get("type") == "ntk":  # effective base, as kvcap run records
            base = c.rope_theta * float(c.rope_scaling["factor"]) ** (c.head_dim / (c.head_dim - 2))
        return dict(num_layers=c.num_hidden_layers, num_q_heads=c.num_attention_heads,
                    num_kv_heads=c.num_key_value_heads, head_dim=c.head_dim, rope_theta=base,
                    model_name="kvscope-tiny-vlm")

    def attach(self, recorder: Recorder, hooks: Hooks) -> None:
        self.hook_model_forward(recorder, hooks)
        for layer in self.model.model.layers:
            attn = layer.self_attn
            slot: Dict[str, Any] = {}

            def rotary(module, args, output, slot=slot):
                slot["q"], slot["positions"] = output[0], args[2]

            def attention_pre(module, args, idx=attn.layer_idx, slot=slot):
                slot["range"] = recorder.attention_begin(idx)

            def attention(module, args, output, idx=attn.layer_idx, slot=slot):
                if slot.pop("range", False):
                    recorder.attention_end()
                q, pos = slot.pop("q", None), slot.pop("positions", None)
                if recorder.active and q is not None:
                    x, (k, v) = args[0], output[1]
                    t = x.shape[1]
                    recorder.layer(idx, q[0], k[0, :, -t:], v[0, :, -t:],
                                   None if pos is None else int(pos[-1]), batch=x.shape[0])

            hooks.add(attn.rotary_emb.register_forward_hook(rotary))
            hooks.add(attn.register_forward_pre_hook(attention_pre))
            hooks.add(attn.register_forward_hook(attention))


def adapter_for(model) -> Adapter:
    """The adapter of a supported model: the tiny VLM, or a transformers model kvscope.hf supports."""
    from .tinyvlm.model import TinyVlm

    if isinstance(model, TinyVlm):
        return TinyVlmAdapter(model)
    if type(model).__module__.startswith("transformers."):
        from . import hf
        return hf.adapter_for(model)
    raise BridgeError(f"unsupported model {type(model).__name__}: the bridge supports "
                      "kvscope.tinyvlm.TinyVlm and the transformers models of kvscope.hf (LLaMA family, "
                      "Qwen2, LLaVA, Qwen2-VL); pass adapter= for others")


def _model_device_and_dtype(model):
    for p in model.parameters():
        return p.device, p.dtype
    return None, None


# ---- the context manager -----------------------------------------------------------------------------------
class BridgeCapture:
    """What `capture()` yields: the running capture (`capture` is the kvscope.capture.Capture for your own
    ranges, e.g. `with cap.capture.range("vision tower"):`)."""

    def __init__(self, model, path: str, tokens: TokenTable, token_text: TokenText, adapter: Adapter,
                 options: Dict[str, Any]):
        tokens.check()
        self.model, self.path, self.tokens, self.adapter = model, str(path), tokens, adapter
        geometry = adapter.geometry()
        device, dtype = _model_device_and_dtype(model)
        config = dict(dtype=str(dtype).replace("torch.", "") if dtype is not None else "float32",
                      max_decode_steps=4096, profile=True)
        if device is not None and device.type == "cuda":
            import torch
            config["cuda_stream"] = torch.cuda.current_stream(device).cuda_stream
            config["device"] = torch.cuda.get_device_name(device)
        else:
            config["device"] = "cpu"
        if config["dtype"] not in ("float32", "float16", "bfloat16"):
            config["dtype"] = "float32"
        config.update(geometry)
        config.update({k: v for k, v in options.items() if v is not None})
        self.capture = Capture(self.path, context_tokens=len(tokens), **config)
        self._hooks = Hooks()
        try:
            self.capture.set_tokens(tokens.modality, tokens.position, tokens.token_id, tokens.segment,
                                    tokens.grid_row, tokens.grid_col, tokens.text)
            if tokens.role is not None:
                self.capture.set_token_roles(tokens.role)
            self.recorder = Recorder(self.capture, geometry["num_layers"], tokens, token_text)
            adapter.attach(self.recorder, self._hooks)
        except BaseException:
            self._hooks.remove()
            self.capture.abort()
            raise

    @property
    def decode_steps(self) -> int:
        return self.recorder.decode_steps

    @property
    def prefilled(self) -> bool:
        return self.recorder.prefilled

    def set_decode_roles(self, roles: Sequence[int]) -> None:
        """Roles of the decode steps (0 context, 1 question, 2 answer, 3 template), one per step recorded by
        the end of the block; call inside the block."""
        self.capture.set_decode_roles(roles)

    def finish(self, exc: Optional[BaseException]) -> None:
        self._hooks.remove()
        if exc is not None or self.recorder.error is not None:
            self.capture.abort()
            if exc is None:
                raise BridgeError(f"{self.path}: capture aborted (trace left incomplete) after an error "
                                  f"during the run: {self.recorder.error}") from self.recorder.error
            return
        if not self.recorder.prefilled:
            self.capture.abort()
            raise BridgeError(f"{self.path}: the model never ran inside the capture block; trace left "
                              "incomplete")
        self.capture.close()


@contextlib.contextmanager
def capture(model, path: str, *, tokens: TokenTable, token_text: TokenText = None,
            adapter: Optional[Adapter] = None, dtype: Optional[str] = None,
            max_decode_steps: Optional[int] = None, model_name: Optional[str] = None,
            profile: Optional[bool] = None, **config):
    """Records the model's run inside the block into the trace `path` (see the module docstring).

    tokens: labels of the context tokens (the prefill must have exactly len(tokens) tokens).
    token_text: id -> text of decode tokens (a callable or a list such as vocab.tokens); None = no text.
    dtype: element type in the trace (default: the model's parameter dtype).
    max_decode_steps: bound on recorded decode steps (default 4096).
    model_name / profile (default True) and any other kvscope_capture_config field (queue_bytes,
    chunk_tokens, deflate_level, device, creator, ...) go to the capture's configuration.
    On an exception in the block the capture is aborted (the trace stays incomplete) and the exception
    propagates; a run the bridge cannot record raises BridgeError.
    """
    adapter = adapter or adapter_for(model)
    options = dict(dtype=dtype, max_decode_steps=max_decode_steps, model_name=model_name, profile=profile,
                   **config)
    bc = BridgeCapture(model, path, tokens, token_text, adapter, options)
    try:
        yield bc
    except BaseException as e:
        bc.finish(e)
        raise
    bc.finish(None)
