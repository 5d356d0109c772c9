"""Convert a LLaMA-family GGUF file into a Hugging Face model folder (`kvcap import-gguf`).

The folder holds what both kvscope's C++ runner and transformers' LlamaForCausalLM load:
config.json, generation_config.json, model.safetensors (float32, dequantized), tokenizer.json,
tokenizer_config.json (with the chat template), chat_template.jinja and kvscope-import.json (where it
came from). Reading and dequantizing use the PyPI `gguf` package.

llama.cpp's converter permutes the rows of q_proj and k_proj for its RoPE layout; they are permuted
back here (HF and kvscope rotate the two halves of each head, "rotate_half").

    python -m kvscope.gguf_import FILE.gguf -o DIR

Exit status 0 on success, 2 with one line on stderr for a file it cannot convert (another
architecture, an unsupported tensor type or tokenizer, a truncated or corrupt file). The folder is
written under DIR.partial and renamed to DIR only when complete.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys

SUPPORTED_ARCHS = ("llama",)
# GGML tensor types we read: plain floats and every block format gguf.quants can dequantize.
PLAIN_TYPES = ("F32", "F16", "BF16")
QUANT_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
               "IQ4_NL", "IQ4_XS")
# Pre-tokenizers (tokenizer.ggml.pre) and the HF pre_tokenizer each maps to.
GPT2_REGEX = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"


class ImportError_(Exception):
    """A GGUF that cannot be converted; the message is one line naming the problem."""


def _byte_level():
    return {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}


def pre_tokenizer_for(pre: str) -> dict:
    if pre in ("gpt2", "default"):
        return _byte_level()
    if pre == "smollm":
        return {"type": "Sequence", "pretokenizers": [
            {"type": "Digits", "individual_digits": True}, _byte_level()]}
    raise ImportError_(f"unsupported pre-tokenizer tokenizer.ggml.pre = '{pre}' "
                       "(supported: gpt2, smollm)")


def _field(reader, key, default=None, required=True):
    f = reader.fields.get(key)
    if f is None:
        if required:
            raise ImportError_(f"missing metadata key '{key}'")
        return default
    return f.contents()


def _float32_repr(x: float) -> float:
    """The shortest decimal that reads back as the same float32 (1e-05 rather than 9.99999974e-06)."""
    import numpy as np
    return float(np.format_float_positional(np.float32(x), unique=True, trim="-"))


def unpermute_rope_rows(w, n_head: int):
    """Undo llama.cpp's q/k row permutation: [n_head, 2, half, cols] back to [n_head, half, 2, cols]."""
    rows, cols = w.shape
    return w.reshape(n_head, rows // n_head // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)


def _tensor(reader_tensor):
    import numpy as np
    from gguf import GGMLQuantizationType, quants
    t = reader_tensor
    name = t.tensor_type.name
    shape = tuple(int(n) for n in reversed(t.shape.tolist()))  # GGUF lists ne0 (columns) first
    if name in PLAIN_TYPES:
        if name == "BF16":
            arr = quants.dequantize(t.data, GGMLQuantizationType.BF16)
        else:
            arr = np.asarray(t.data)
        arr = arr.astype(np.float32)
    elif name in QUANT_TYPES:
        arr = quants.dequantize(t.data, t.tensor_type).astype(np.float32)
    else:
        raise ImportError_(f"tensor '{t.name}' has unsupported type {name} "
                           f"(supported: {', '.join(PLAIN_TYPES + QUANT_TYPES)})")
    if arr.size != int(np.prod(shape)):
        raise ImportError_(f"tensor '{t.name}': {arr.size} values for shape {list(shape)}")
    arr = arr.reshape(shape)
    if not np.isfinite(arr).all():
        raise ImportError_(f"tensor '{t.name}' holds NaN or infinite values")
    return arr


def _tensor_names(n_layers: int):
    names = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
             "output.weight": "lm_head.weight"}
    per_layer = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
                 "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
                 "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                 "ffn_down": "mlp.down_proj"}
    for i in range(n_layers):
        for g, h in per_layer.items():
            names[f"blk.{i}.{g}.weight"] = f"model.layers.{i}.{h}.weight"
    return names


def _tokenizer_files(reader, arch_config):
    model = _field(reader, "tokenizer.ggml.model")
    if model != "gpt2":
        raise ImportError_(f"unsupported tokenizer model tokenizer.ggml.model = '{model}' "
                           "(supported: gpt2, byte-level BPE)")
    pre = _field(reader, "tokenizer.ggml.pre", "default", required=False)
    tokens = _field(reader, "tokenizer.ggml.tokens")
    types = _field(reader, "tokenizer.ggml.token_type", [1] * len(tokens), required=False)
    merges = _field(reader, "tokenizer.ggml.merges")
    if len(types) != len(tokens):
        raise ImportError_(f"{len(types)} token types for {len(tokens)} tokens")
    bos = _field(reader, "tokenizer.ggml.bos_token_id", None, required=False)
    eos = _field(reader, "tokenizer.ggml.eos_token_id", None, required=False)
    pad = _field(reader, "tokenizer.ggml.padding_token_id", None, required=False)
    unk = _field(reader, "tokenizer.ggml.unknown_token_id", None, required=False)
    add_bos = bool(_field(reader, "tokenizer.ggml.add_bos_token", False, required=False))
    template = _field(reader, "tokenizer.chat_template", None, required=False)
    control = 3  # llama.cpp's TokenType.CONTROL; 4 = USER_DEFINED
    added = []
    for i, (tok, ty) in enumerate(zip(tokens, types)):
        if ty in (control, 4):
            added.append({"id": i, "content": tok, "single_word": False, "lstrip": False, "rstrip": False,
                          "normalized": ty != control, "special": ty == control})
    vocab = {tok: i for i, tok in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise ImportError_("the vocabulary has duplicate tokens")
    tokenizer = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": pre_tokenizer_for(pre),
        "post_processor": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": False,
                           "use_regex": True},
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
                  "ignore_merges": False, "vocab": vocab,
                  "merges": [m.split(" ", 1) for m in merges]},
    }

    def tok_text(i):
        return tokens[i] if i is not None and 0 <= i < len(tokens) else None

    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": add_bos,
        "add_eos_token": False,
        "bos_token": tok_text(bos),
        "eos_token": tok_text(eos),
        "pad_token": tok_text(pad),
        "unk_token": tok_text(unk),
        "clean_up_tokenization_spaces": False,
        "model_max_length": arch_config["max_position_embeddings"],
        "additional_special_tokens": [a["content"] for a in added if a["special"] and
                                      a["id"] not in (bos, eos, pad, unk)],
    }
    if template:
        config["chat_template"] = template
    return tokenizer, config, template, {"bos": bos, "eos": eos, "pad": pad}


def convert(path: str, out_dir: str, progress=None) -> dict:
    """Converts `path` into `out_dir`; returns the config written. Raises ImportError_."""
    import numpy as np
    from gguf import GGUFReader

    if not os.path.isfile(path):
        raise ImportError_(f"{path}: no such file")
    try:
        reader = GGUFReader(path, "r")
    except Exception as e:  # the gguf package raises ValueError/struct.error/etc. for bad files
        raise ImportError_(f"not a readable GGUF file ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})")
    arch = _field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHS:
        raise ImportError_(f"unsupported architecture '{arch}' (supported: {', '.join(SUPPORTED_ARCHS)})")
    k = arch + "."
    n_layers = int(_field(reader, k + "block_count"))
    hidden = int(_field(reader, k + "embedding_length"))
    n_head = int(_field(reader, k + "attention.head_count"))
    n_kv = int(_field(reader, k + "attention.head_count_kv", n_head, required=False))
    head_dim = int(_field(reader, k + "attention.key_length", hidden // n_head, required=False))
    rope_dim = int(_field(reader, k + "rope.dimension_count", head_dim, required=False))
    if rope_dim != head_dim:
        raise ImportError_(f"partial RoPE ({rope_dim} of {head_dim} dims) is not supported")
    if _field(reader, k + "rope.scaling.type", "none", required=False) not in ("none", None):
        raise ImportError_("RoPE scaling in the GGUF is not supported")
    tensors = {t.name: t for t in reader.tensors}
    embd = tensors.get("token_embd.weight")
    if embd is None:
        raise ImportError_("missing tensor 'token_embd.weight'")
    vocab_size = int(embd.shape[1])
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": int(_field(reader, k + "feed_forward_length")),
        "num_hidden_layers": n_layers,
        "num_attention_heads": n_head,
        "num_key_value_heads": n_kv,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": int(_field(reader, k + "context_length")),
        "rms_norm_eps": _float32_repr(_field(reader, k + "attention.layer_norm_rms_epsilon")),
        "rope_theta": _float32_repr(_field(reader, k + "rope.freq_base", 10000.0, required=False)),
        "rope_scaling": None,
        "attention_bias": False,
        "mlp_bias": False,
        "vocab_size": vocab_size,
        "tie_word_embeddings": "output.weight" not in tensors,
        "torch_dtype": "float32",
    }
    tokenizer, tok_config, template, ids = _tokenizer_files(reader, cfg)
    if len(tokenizer["model"]["vocab"]) != vocab_size:
        raise ImportError_(f"{len(tokenizer['model']['vocab'])} tokens but token_embd has {vocab_size} rows")
    for key in ("bos", "eos", "pad"):
        if ids[key] is not None:
            cfg[f"{key}_token_id"] = int(ids[key])

    names = _tensor_names(n_layers)
    unknown = sorted(set(tensors) - set(names) - {"rope_freqs.weight"})
    if unknown:
        raise ImportError_(f"unexpected tensor '{unknown[0]}' for a {arch} model "
                           f"({len(unknown)} unknown)")
    missing = sorted(set(names) - set(tensors) - {"output.weight"})
    if missing:
        raise ImportError_(f"missing tensor '{missing[0]}'")
    # Tensors are dequantized and written one at a time (memory: the largest tensor, not the model).
    plan = [(g, h) for g, h in names.items() if g in tensors]
    header = {"__metadata__": {"format": "pt"}}
    offset = 0
    for g, h in plan:
        shape = [int(n) for n in reversed(tensors[g].shape.tolist())]
        size = 4 * int(np.prod(shape))
        header[h] = {"dtype": "F32", "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the data starts 8-byte aligned

    tmp = out_dir.rstrip("/") + ".partial"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    types = {}
    try:
        with open(os.path.join(tmp, "model.safetensors"), "wb") as f:
            f.write(len(blob).to_bytes(8, "little"))
            f.write(blob)
            for i, (g, h) in enumerate(plan):
                t = tensors[g]
                arr = _tensor(t)
                if ".attn_q." in g:
                    arr = unpermute_rope_rows(arr, n_head)
                elif ".attn_k." in g:
                    arr = unpermute_rope_rows(arr, n_kv)
                f.write(np.ascontiguousarray(arr, dtype="<f4").tobytes())
                types[t.tensor_type.name] = types.get(t.tensor_type.name, 0) + 1
                if progress:
                    progress(i + 1, len(plan))
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise

    def dump(name, obj):
        with open(os.path.join(tmp, name), "w", encoding="utf-8") as f:
            json.dump(obj, f, ensure_ascii=False, indent=1)
            f.write("\n")

    dump("config.json", cfg)
    gen = {k2: cfg[k2] for k2 in ("bos_token_id", "eos_token_id", "pad_token_id") if k2 in cfg}
    dump("generation_config.json", gen)
    dump("tokenizer.json", tokenizer)
    dump("tokenizer_config.json", tok_config)
    if template:
        with open(os.path.join(tmp, "chat_template.jinja"), "w", encoding="utf-8") as f:
            f.write(template)
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    dump("kvscope-import.json", {"source": os.path.basename(path), "sha256": h.hexdigest(),
                                 "gguf_name": _field(reader, "general.name", "", required=False),
                                 "tensor_types": types, "converter": "kvscope.gguf_import"})
    if os.path.isdir(out_dir):
        shutil.rmtree(out_dir)
    os.replace(tmp, out_dir)
    return cfg


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="kvcap import-gguf", description=__doc__.split("\n\n")[0])
    ap.add_argument("file", help="the .gguf file")
    ap.add_argument("-o", "--output", required=True, help="model folder to write")
    ap.add_argument("-q", "--quiet", action="store_true", help="no progress on stderr")
    a = ap.parse_args(argv)

    tty = sys.stderr.isatty()

    def progress(done, total):
        # A bar redrawn in place on a terminal; in a log, one line per tenth.
        if a.quiet or not (tty or done == total or done * 10 // total != (done - 1) * 10 // total):
            return
        bar = "#" * (done * 30 // total)
        print(f"{chr(13) if tty else ''}kvcap import-gguf: tensors [{bar:<30}] {done}/{total}",
              end="" if tty else "\n", file=sys.stderr, flush=True)

    try:
        cfg = convert(a.file, a.output, progress)
    except ImportError_ as e:
        if not a.quiet and tty:
            print("", file=sys.stderr)
        print(f"kvcap import-gguf: {a.file}: {e}", file=sys.stderr)
        return 2
    if not a.quiet and tty:
        print("", file=sys.stderr)
    print(f"wrote {a.output}: {cfg['architectures'][0]}, {cfg['num_hidden_layers']} layers, "
          f"{cfg['num_attention_heads']}/{cfg['num_key_value_heads']} heads x {cfg['head_dim']}, "
          f"vocab {cfg['vocab_size']}, tied embeddings {str(cfg['tie_word_embeddings']).lower()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
