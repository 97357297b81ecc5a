"""Multi-head attention in NumPy (float64), forward and backward, from the paper's equations and PyTorch's
documented extras: the reference that tests/test_reference.py holds ours and nn.MultiheadAttention to.

Vaswani et al. (2017), section 3.2:
    Attention(Q, K, V) = softmax(Q K^T / sqrt(d_k)) V
    MultiHead(Q, K, V) = Concat(head_1, ..., head_h) W^O,  head_i = Attention(Q W_i^Q, K W_i^K, V W_i^V)
with nn.MultiheadAttention's documented extras (torch.nn.MultiheadAttention's docstring):
  * biases on the four projections (bias=True);
  * kdim / vdim: W^K takes kdim inputs, W^V vdim inputs;
  * add_bias_kv: a learned key bias_k and value bias_v appended to the keys and values (after projection);
  * add_zero_attn: then a zero key and value appended (zero in every head);
  * key_padding_mask (B, S) and attn_mask (L, S) or (B*H, L, S): bool (True = may not attend) or float (added to
    the scores); the appended keys are visible to every query (an attn_mask as wide as all the keys, appended
    ones included, covers them too: how PyTorch's module applies is_causal in one case, see test_reference);
  * the returned weights: the softmax, per head (B, H, L, S') or averaged over heads (B, L, S').
Batch-first throughout: x (B, L, E). Weights are in PyTorch's layout: W (out, in), y = x W^T + b.

The backward pass is derived by hand (the chain rule through each line of forward), not by autograd, so that
PyTorch's autograd is checked against something it did not compute; gradients_by_finite_differences checks
the derivation itself.
"""

from __future__ import annotations

import numpy as np

PARAMS = ("Wq", "Wk", "Wv", "Wo", "bq", "bk", "bv", "bo", "bias_k", "bias_v")


def additive(mask: np.ndarray | None) -> np.ndarray | None:
    """bool (True = blocked) -> -inf / 0; float as it is."""
    if mask is None or mask.dtype != bool:
        return mask
    return np.where(mask, -np.inf, 0.0)


def forward(x_q, x_k, x_v, p: dict, num_heads: int, add_zero_attn=False, key_padding_mask=None, attn_mask=None):
    """x_q (B, L, E), x_k (B, S, kdim), x_v (B, S, vdim); p: PARAMS (a bias or bias_k/v None when absent).
    Returns (out (B, L, E), A (B, H, L, S') per head, cache for backward)."""
    B, L, E = x_q.shape
    S = x_k.shape[1]
    H, d = num_heads, E // num_heads

    def lin(x, w, b):
        return x @ w.T + (0.0 if b is None else b)

    q, k, v = lin(x_q, p["Wq"], p["bq"]), lin(x_k, p["Wk"], p["bk"]), lin(x_v, p["Wv"], p["bv"])  # (B, *, E)
    extra = 0
    if p.get("bias_k") is not None:  # (B, S, E) -> (B, S + 1, E)
        k = np.concatenate([k, np.broadcast_to(p["bias_k"], (B, 1, E))], axis=1)
        v = np.concatenate([v, np.broadcast_to(p["bias_v"], (B, 1, E))], axis=1)
        extra += 1
    if add_zero_attn:
        k = np.concatenate([k, np.zeros((B, 1, E))], axis=1)
        v = np.concatenate([v, np.zeros((B, 1, E))], axis=1)
        extra += 1
    S2 = S + extra

    M = np.zeros((B, H, L, S2))  # the additive mask; appended keys get 0 (visible)
    am = additive(attn_mask)
    if am is not None:  # (L, S) or (B*H, L, S); S' wide, it covers the appended keys too
        am = am.reshape(B, H, L, -1) if am.ndim == 3 else am[None, None]  # (B*H, ...) is batch-major
        M[..., :am.shape[-1]] += am
    kpm = additive(key_padding_mask)
    if kpm is not None:
        M[..., :S] += kpm[:, None, None, :]

    def heads(t):  # (B, n, E) -> (B, H, n, d)
        return t.reshape(B, -1, H, d).transpose(0, 2, 1, 3)

    qh, kh, vh = heads(q), heads(k), heads(v)
    scores = qh @ kh.transpose(0, 1, 3, 2) / np.sqrt(d) + M  # (B, H, L, S')
    z = np.exp(scores - scores.max(-1, keepdims=True))
    A = z / z.sum(-1, keepdims=True)  # softmax over the keys
    O = (A @ vh).transpose(0, 2, 1, 3).reshape(B, L, E)  # heads merged: (B, L, E)
    out = lin(O, p["Wo"], p["bo"])
    cache = {"x": (x_q, x_k, x_v), "qh": qh, "kh": kh, "vh": vh, "A": A, "O": O, "H": H, "d": d, "S": S,
             "bias_kv": p.get("bias_k") is not None}
    return out, A, cache


def backward(g_out, g_A, p: dict, cache: dict) -> dict:
    """Gradients of sum(out * g_out) + sum(A * g_A) (g_A (B, H, L, S') or None) with respect to the three inputs
    ("x_q", "x_k", "x_v") and every parameter present in p."""
    x_q, x_k, x_v = cache["x"]
    qh, kh, vh, A, O, H, d, S = (cache[n] for n in ("qh", "kh", "vh", "A", "O", "H", "d", "S"))
    B, L, E = g_out.shape
    g = {"Wo": g_out.reshape(-1, E).T @ O.reshape(-1, E)}  # out = O Wo^T + bo
    if p["bo"] is not None:
        g["bo"] = g_out.sum((0, 1))
    gO = (g_out @ p["Wo"]).reshape(B, L, H, d).transpose(0, 2, 1, 3)  # (B, H, L, d)
    gA = gO @ vh.transpose(0, 1, 3, 2)  # O = A V
    if g_A is not None:
        gA = gA + g_A
    gvh = A.transpose(0, 1, 3, 2) @ gO  # (B, H, S', d)
    gs = A * (gA - (gA * A).sum(-1, keepdims=True))  # softmax's Jacobian
    gqh = gs @ kh / np.sqrt(d)  # scores = q k^T / sqrt(d) + M
    gkh = gs.transpose(0, 1, 3, 2) @ qh / np.sqrt(d)

    def merge(t):  # (B, H, n, d) -> (B, n, E)
        return t.transpose(0, 2, 1, 3).reshape(B, -1, E)

    gq, gk, gv = merge(gqh), merge(gkh), merge(gvh)
    if cache["bias_kv"]:  # key S is bias_k (the zero key, if any, follows it and has no parameter)
        g["bias_k"], g["bias_v"] = gk[:, S].sum(0)[None, None], gv[:, S].sum(0)[None, None]
    gk, gv = gk[:, :S], gv[:, :S]
    for name, x, gy in (("q", x_q, gq), ("k", x_k, gk), ("v", x_v, gv)):  # y = x W^T + b
        g[f"W{name}"] = gy.reshape(-1, E).T @ x.reshape(-1, x.shape[-1])
        if p[f"b{name}"] is not None:
            g[f"b{name}"] = gy.sum((0, 1))
        g[f"x_{name}"] = gy @ p[f"W{name}"]
    return g


def loss(x_q, x_k, x_v, p, num_heads, g_out, g_A, **kw) -> float:
    out, A, _ = forward(x_q, x_k, x_v, p, num_heads, **kw)
    return float((out * g_out).sum() + (0.0 if g_A is None else (A * g_A).sum()))


def gradients_by_finite_differences(x_q, x_k, x_v, p, num_heads, g_out, g_A, eps=1e-6, **kw) -> dict:
    """Central differences of `loss`, element by element: the check of backward's derivation (small shapes)."""
    xs = {"x_q": x_q, "x_k": x_k, "x_v": x_v}
    out = {}
    for name, t in [*xs.items(), *((n, p[n]) for n in PARAMS if p.get(n) is not None)]:
        grad = np.zeros_like(t)
        for i in np.ndindex(t.shape):
            old = t[i]
            t[i] = old + eps
            up = loss(xs["x_q"], xs["x_k"], xs["x_v"], p, num_heads, g_out, g_A, **kw)
            t[i] = old - eps
            down = loss(xs["x_q"], xs["x_k"], xs["x_v"], p, num_heads, g_out, g_A, **kw)
            t[i] = old
            grad[i] = (up - down) / (2 * eps)
        out[name] = grad
    return out
