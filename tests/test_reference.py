"""Ours and nn.MultiheadAttention against multi-head attention written from its definition (tests/mha_reference.py:
the paper's equations and PyTorch's documented extras, in NumPy float64, backward derived by hand).

For every combination of add_bias_kv, add_zero_attn, the mask kinds and what comes back (weights averaged, per
head, none), SHAPES random shapes: batch 2-10, query and key lengths 2-10, head_dim 3-10, 2-10 heads, kdim and vdim
5-20 (or embed_dim, which takes PyTorch's packed path; then also self-attention, one tensor for query, key and
value, half of the time), bias and batch_first drawn too. Each is built as nn.MultiheadAttention in float64 with
every parameter moved off its init, copied into ours (from_official), and both are run on the same inputs and
masks; outputs, weights, the inputs' gradients and every parameter's gradient (under PyTorch's names) must equal the
reference's to TOL. Masks never block every key of a query (PyTorch gives NaN there, ours 0: test_masks.py).
`python tests/test_reference.py` prints each combination's largest difference, for ours and for PyTorch's.
"""

from __future__ import annotations

import itertools

import mha_reference as ref
import numpy as np
import pytest
import torch
from torch import nn

from mhalab import MultiHeadAttention
from mhalab.nn import official_names

ONE_THREAD = True  # tiny tensors: see conftest.one_thread
SHAPES = 40  # random shapes per combination in the suite; `python tests/test_reference.py` checks WIDE
WIDE = 100
TOL = 1e-9  # float64, values and gradients of order 1
pytestmark = pytest.mark.filterwarnings("ignore:Support for mismatched key_padding_mask:UserWarning")

MASKS = ("none", "key_padding_mask bool", "key_padding_mask float", "attn_mask (L, S) bool",
         "attn_mask (L, S) float", "attn_mask (B*H, L, S) bool", "attn_mask (B*H, L, S) float",
         "attn_mask float + key_padding_mask bool", "causal attn_mask + is_causal")
WEIGHTS = ("averaged", "per head", "none")  # need_weights=True (averaged or not), need_weights=False
COMBOS = list(itertools.product((False, True), (False, True), MASKS, WEIGHTS))


def combo_id(combo) -> str:
    bias_kv, zero_attn, mask, weights = combo
    return f"bias_kv={int(bias_kv)}-zero_attn={int(zero_attn)}-{mask}-weights {weights}"


def pytorch_masks_appended_keys_causally(combo) -> bool:
    """The one combination where nn.MultiheadAttention departs from the definition (see one_shape)."""
    bias_kv, zero_attn, mask, weights = combo
    return mask.startswith("causal") and weights == "none" and (bias_kv or zero_attn)


def draw_masks(rng: np.random.Generator, kind: str, B: int, H: int, L: int, S: int) -> dict:
    """forward's mask arguments of `kind`, as NumPy arrays; one random key stays visible to every query."""
    keep = rng.integers(S)

    def blocked(shape):
        m = rng.random(shape) < 0.4
        m[..., keep] = False
        return m

    def floats(shape):
        return np.where(blocked(shape), -np.inf, rng.standard_normal(shape))

    kinds = {
        "none": {},
        "key_padding_mask bool": {"key_padding_mask": blocked((B, S))},
        "key_padding_mask float": {"key_padding_mask": floats((B, S))},
        "attn_mask (L, S) bool": {"attn_mask": blocked((L, S))},
        "attn_mask (L, S) float": {"attn_mask": floats((L, S))},
        "attn_mask (B*H, L, S) bool": {"attn_mask": blocked((B * H, L, S))},
        "attn_mask (B*H, L, S) float": {"attn_mask": floats((B * H, L, S))},
        "attn_mask float + key_padding_mask bool": {"attn_mask": floats((L, S)), "key_padding_mask": blocked((B, S))},
        "causal attn_mask + is_causal": {"attn_mask": np.triu(np.ones((L, S), dtype=bool), 1)},
    }
    return kinds[kind]


def reference_params(mha: nn.MultiheadAttention) -> dict:
    """The reference's parameters (Wq ... bias_v) read off PyTorch's module, as float64 NumPy arrays."""
    def np_(t):
        return None if t is None else t.detach().numpy().copy()

    ws = (mha.in_proj_weight.chunk(3) if mha._qkv_same_embed_dim
          else (mha.q_proj_weight, mha.k_proj_weight, mha.v_proj_weight))
    bs = mha.in_proj_bias.chunk(3) if mha.in_proj_bias is not None else (None,) * 3
    p = dict(zip(("Wq", "Wk", "Wv"), map(np_, ws))) | dict(zip(("bq", "bk", "bv"), map(np_, bs)))
    return p | {"Wo": np_(mha.out_proj.weight), "bo": np_(mha.out_proj.bias), "bias_k": np_(mha.bias_k),
                "bias_v": np_(mha.bias_v)}


def reference_grads_by_official_name(g: dict, mha: nn.MultiheadAttention) -> dict:
    """The reference's parameter gradients under nn.MultiheadAttention's parameter names."""
    out = {}
    if mha._qkv_same_embed_dim:
        out["in_proj_weight"] = np.concatenate([g["Wq"], g["Wk"], g["Wv"]])
    else:
        out |= {"q_proj_weight": g["Wq"], "k_proj_weight": g["Wk"], "v_proj_weight": g["Wv"]}
    if "bq" in g:
        out["in_proj_bias"] = np.concatenate([g["bq"], g["bk"], g["bv"]])
    out["out_proj.weight"] = g["Wo"]
    if "bo" in g:
        out["out_proj.bias"] = g["bo"]
    if "bias_k" in g:
        out |= {"bias_k": g["bias_k"], "bias_v": g["bias_v"]}
    return out


def one_shape(rng: np.random.Generator, combo) -> dict[str, float]:
    """Draw a shape, run the reference, PyTorch's module and ours; {"official": diff, "ours": diff}, each the
    largest |difference| from the reference over everything compared (asserting presence and shapes)."""
    bias_kv, zero_attn, mask_kind, weights = combo
    B, L, S = (int(n) for n in rng.integers(2, 11, 3))
    H, d = int(rng.integers(2, 11)), int(rng.integers(3, 11))
    E = H * d
    packed = rng.random() < 0.5
    kdim, vdim = (E, E) if packed else (int(n) for n in rng.integers(5, 21, 2))
    self_attn = packed and rng.random() < 0.5
    if self_attn:
        S = L
    bias, batch_first = bool(rng.random() < 0.5), bool(rng.random() < 0.5)

    # the CPU generator alone: torch.manual_seed also queues CUDA's lazy seeding with a stack trace, a quarter of
    # this file's time over 10,800 shapes (these tensors are on the CPU: the same draws)
    torch.default_generator.manual_seed(int(rng.integers(2**31)))
    theirs = nn.MultiheadAttention(E, H, bias=bias, add_bias_kv=bias_kv, add_zero_attn=zero_attn, kdim=kdim,
                                   vdim=vdim, batch_first=batch_first, dtype=torch.float64)
    with torch.no_grad():  # off the init (zero biases), so no gradient is trivially equal
        for p in theirs.parameters():
            p.add_(0.2 * torch.randn_like(p))
    ours = MultiHeadAttention.from_official(theirs)

    x_q = rng.standard_normal((B, L, E))
    x_k, x_v = (x_q, x_q) if self_attn else (rng.standard_normal((B, S, kdim)), rng.standard_normal((B, S, vdim)))
    masks = draw_masks(rng, mask_kind, B, H, L, S)
    need = weights != "none"
    g_out = rng.standard_normal((B, L, E))
    g_w = rng.standard_normal((B, L, S + bias_kv + zero_attn) if weights == "averaged"
                              else (B, H, L, S + bias_kv + zero_attn)) if need else None

    def reference(masks: dict) -> dict:
        """What the definition gives: output, weights, input and parameter gradients (PyTorch's names)."""
        p = reference_params(theirs)
        out, A, cache = ref.forward(x_q, x_k, x_v, p, H, add_zero_attn=zero_attn, **masks)
        g_A = None if g_w is None else (np.broadcast_to(g_w[:, None] / H, A.shape) if weights == "averaged"
                                        else g_w)
        g = ref.backward(g_out, g_A, p, cache)
        want = {"output": out}
        if need:
            want["weights"] = A.mean(1) if weights == "averaged" else A
        if self_attn:
            want["grad query"] = g["x_q"] + g["x_k"] + g["x_v"]
        else:
            want |= {"grad query": g["x_q"], "grad key": g["x_k"], "grad value": g["x_v"]}
        return want | {f"grad {n}": v for n, v in reference_grads_by_official_name(g, theirs).items()}

    want = dict.fromkeys(("ours", "official"), reference(masks))  # (read only: one computation for both)
    if pytorch_masks_appended_keys_causally(combo):
        # nn.MultiheadAttention's need_weights=False path drops the causal attn_mask for SDPA's is_causal, applied
        # after bias_k / the zero key are appended: it blocks them too, where the definition (and its own
        # need_weights=True path) keeps them visible. Ours keeps the definition. This pins what PyTorch does.
        S2 = S + bias_kv + zero_attn
        want["official"] = reference(masks | {"attn_mask": np.triu(np.ones((L, S2), dtype=bool), 1)})

    call = {name: torch.from_numpy(m) for name, m in masks.items()}
    call |= {"need_weights": need, "average_attn_weights": weights == "averaged",
             "is_causal": mask_kind.startswith("causal")}
    diffs = {}
    for name, module in (("official", theirs), ("ours", ours)):
        module.zero_grad()
        leaves = [torch.tensor(x if batch_first else x.transpose(1, 0, 2), requires_grad=True)
                  for x in ((x_q,) if self_attn else (x_q, x_k, x_v))]
        q, k, v = leaves * 3 if self_attn else leaves
        out, w = module(q, k, v, **call)
        out = out if batch_first else out.transpose(0, 1)
        assert (w is None) == (not need), name
        loss = (out * torch.from_numpy(g_out)).sum() + (0 if w is None else (w * torch.from_numpy(g_w)).sum())
        loss.backward()
        grads = [x.grad if batch_first else x.grad.transpose(0, 1) for x in leaves]
        got = {"output": out, "grad query": grads[0]}
        if need:
            got["weights"] = w
        if not self_attn:
            got |= {"grad key": grads[1], "grad value": grads[2]}
        got |= {f"grad {n}": torch.cat([q.grad for q in ps]) for n, ps in official_names(module).items()}
        assert got.keys() == want[name].keys(), (name, sorted(got), sorted(want[name]))
        worst = 0.0
        for key, value in want[name].items():
            have = got[key].detach().numpy()
            assert have.shape == value.shape, (name, key, have.shape, value.shape)
            diff = float(np.abs(have - value).max())
            assert diff <= TOL, f"{name}, {key}: max |diff| {diff:.3g} (B={B} L={L} S={S} H={H} d={d} " \
                                f"kdim={kdim} vdim={vdim} bias={bias} batch_first={batch_first} self={self_attn})"
            worst = max(worst, diff)
        diffs[name] = worst
    return diffs


def largest_differences(combo, shapes: int = SHAPES) -> dict[str, float]:
    rng = np.random.default_rng(COMBOS.index(combo))
    per_shape = [one_shape(rng, combo) for _ in range(shapes)]
    return {name: max(d[name] for d in per_shape) for name in ("official", "ours")}


@pytest.mark.parametrize("combo", COMBOS, ids=[combo_id(c) for c in COMBOS])
def test_ours_and_pytorchs_attention_equal_the_definition_on_random_shapes(combo):
    diffs = largest_differences(combo)
    assert max(diffs.values()) <= TOL


@pytest.mark.parametrize("combo", [(True, True, "attn_mask float + key_padding_mask bool", "per head"),
                                   (False, False, "attn_mask (B*H, L, S) bool", "averaged")],
                         ids=["bias_kv, zero_attn, two masks", "batch x heads mask, averaged"])
def test_the_references_backward_equals_finite_differences(combo):
    """The reference's hand-derived gradients against central differences of its own forward (small shapes)."""
    bias_kv, zero_attn, mask_kind, weights = combo
    rng = np.random.default_rng(0)
    B, L, S, H, d, kdim, vdim = 2, 3, 4, 2, 3, 5, 7
    E = H * d
    p = {n: rng.standard_normal(s) for n, s in (("Wq", (E, E)), ("Wk", (E, kdim)), ("Wv", (E, vdim)), ("Wo", (E, E)),
                                               ("bq", E), ("bk", E), ("bv", E), ("bo", E))}
    p |= {"bias_k": rng.standard_normal((1, 1, E)), "bias_v": rng.standard_normal((1, 1, E))} if bias_kv else \
        {"bias_k": None, "bias_v": None}
    x_q, x_k, x_v = rng.standard_normal((B, L, E)), rng.standard_normal((B, S, kdim)), rng.standard_normal((B, S, vdim))
    masks = draw_masks(rng, mask_kind, B, H, L, S)
    out, A, cache = ref.forward(x_q, x_k, x_v, p, H, add_zero_attn=zero_attn, **masks)
    g_out = rng.standard_normal(out.shape)
    g_A = rng.standard_normal(A.shape)
    if weights == "averaged":
        g_A = np.broadcast_to(g_A.mean(1, keepdims=True), A.shape).copy()
    analytic = ref.backward(g_out, g_A, p, cache)
    numeric = ref.gradients_by_finite_differences(x_q, x_k, x_v, p, H, g_out, g_A, add_zero_attn=zero_attn, **masks)
    assert analytic.keys() == numeric.keys()
    for name in numeric:
        assert np.abs(analytic[name] - numeric[name]).max() < 1e-6, name


def test_pytorchs_two_paths_disagree_on_appended_keys_under_is_causal_and_ours_keeps_the_definition():
    """add_zero_attn + a causal mask with is_causal=True: PyTorch's need_weights=False path blocks the zero key for
    every query but the last ones, its need_weights=True path (and the definition) keeps it visible; ours gives the
    latter in both paths. This is the one place a swapped model computes other numbers (README)."""
    torch.manual_seed(0)
    theirs = nn.MultiheadAttention(8, 2, add_zero_attn=True, batch_first=True, dtype=torch.float64)
    ours = MultiHeadAttention.from_official(theirs)
    x = torch.randn(3, 5, 8, dtype=torch.float64)
    causal = torch.ones(5, 5, dtype=torch.bool).triu(1)
    kw = {"attn_mask": causal, "is_causal": True}
    pt_fast, pt_slow = theirs(x, x, x, need_weights=False, **kw)[0], theirs(x, x, x, need_weights=True, **kw)[0]
    assert (pt_fast - pt_slow).abs().max() > 1e-2
    for need in (False, True):
        assert (ours(x, x, x, need_weights=need, **kw)[0] - pt_slow).abs().max() < 1e-12


if __name__ == "__main__":
    torch.set_num_threads(1)
    print(f"| combination | nn.MultiheadAttention | mhalab | ({WIDE} random shapes each, float64) |")
    print("|---|---|---|")
    for c in COMBOS:
        d = largest_differences(c, WIDE)
        print(f"| {combo_id(c)} | {d['official']:.1e} | {d['ours']:.1e} |")
