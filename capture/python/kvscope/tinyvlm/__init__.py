"""kvscope tiny vision-language model ("tiny-shapes").

The normative specification shared with the C++ runner is docs/tiny-vlm.md (mirrored in the
docstrings of the modules here): `rng` (splitmix64), `scene` (procedural images), `vocab` (tokeniser),
`dataset` (question families), `model` (LLaMA decoder + vision tower), `safetensors_io` (format I/O),
`train`, `evaluate`, `export_reference` (reference tensors for the runner-vs-PyTorch test).
"""
