"""Train a small attention layer with cuflash.attention_vjp and plain SGD, no framework.

The layer: x -> q, k, v projections -> causal multi-head cuflash.attention -> output projection.
The task: match a fixed random "teacher" layer of the same shape; the student starts from other
random weights. Gradients come from attention_vjp (for the attention) and the chain rule by hand
(for the projections). The printed loss is relative to the target's variance: it starts near 1.

Run: python examples/train_tiny_attention.py   (on CuPy if a GPU is usable, else NumPy)
"""
import numpy as np

import cuflash

B, T, D_MODEL, HEADS = 32, 24, 32, 4  # batch, tokens, model width, heads (head dim 8)
D_HEAD = D_MODEL // HEADS
STEPS, LR = 300, 8.0  # the loss is a mean over B·T·D_MODEL outputs, so its gradients are small
rng = np.random.default_rng(0)
try:  # CuPy when a CUDA GPU is usable, else NumPy
    import cupy
    xp = cupy if cupy.is_available() else np
except ImportError:
    xp = np


def init(scale=1.0):
    """Weights Wq, Wk, Wv, Wo, each (D_MODEL, D_MODEL)."""
    return [xp.asarray(scale * rng.standard_normal((D_MODEL, D_MODEL), dtype=np.float32)
                       / np.sqrt(D_MODEL)) for _ in range(4)]


def split_heads(x):  # (B, T, D_MODEL) -> (B, HEADS, T, D_HEAD), a strided view
    return x.reshape(B, T, HEADS, D_HEAD).swapaxes(1, 2)


def merge_heads(x):  # (B, HEADS, T, D_HEAD) -> (B, T, D_MODEL)
    return x.swapaxes(1, 2).reshape(B, T, D_MODEL)


def layer(weights, x):
    """The layer's output and, for training, a function from d(output) to d(weights)."""
    wq, wk, wv, wo = weights
    heads, vjp = cuflash.attention_vjp(*(split_heads(x @ w) for w in (wq, wk, wv)), causal=True)
    h = merge_heads(heads)

    def backward(dy):
        dh = dy @ wo.T
        dq, dk, dv = (merge_heads(g) for g in vjp(split_heads(dh)))
        flat = x.reshape(-1, D_MODEL)
        return [flat.T @ g.reshape(-1, D_MODEL) for g in (dq, dk, dv)] + \
               [h.reshape(-1, D_MODEL).T @ dy.reshape(-1, D_MODEL)]

    return h @ wo, backward


teacher = init(scale=2.0)  # larger weights: sharper attention patterns to learn
student = init()
print(f"backend: {xp.__name__}; batch {B}, {T} tokens, width {D_MODEL}, {HEADS} heads; SGD lr {LR}")
for step in range(STEPS + 1):
    x = xp.asarray(rng.standard_normal((B, T, D_MODEL), dtype=np.float32))
    target, _ = layer(teacher, x)
    y, backward = layer(student, x)
    err = y - target
    loss = float((err ** 2).mean() / target.var())
    if step % 25 == 0:
        print(f"step {step:4d}   relative loss {loss:.4f}")
    grads = backward(2 * err / (err.size * target.var()))  # d(loss)/dy
    for w, g in zip(student, grads):
        w -= LR * g
