"""The prefill's causal attention in float64 numpy, for the tests that write a policy's score in Python (a
kvscope.stages scorer gets a layer view: q [Hq, T, D], k [Hkv, T, D], position [T], group_size)."""
import numpy as np


def causal_attention(layer, first_query: int = 0) -> np.ndarray:
    """softmax(q k^T / sqrt(D)) of the queries first_query.. over every key they see by position, each kv
    head's keys repeated over its query-head group: [Hq, T - first_query, T]."""
    q = layer.q[:, first_query:, :].astype(np.float64)
    k = np.repeat(layer.k.astype(np.float64), layer.group_size, axis=0)
    logits = q @ k.transpose(0, 2, 1) / np.sqrt(layer.head_dim)
    visible = layer.position[None, :] <= layer.position[first_query:, None]
    logits = np.where(visible, logits, -np.inf)
    p = np.exp(logits - logits.max(axis=-1, keepdims=True))
    return p / p.sum(axis=-1, keepdims=True)
