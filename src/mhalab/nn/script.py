"""TorchScript: what torch.jit.script compiles for our attention, layer and stack.

    torch.jit.script(ours)        # PyTorch's module holding ours' very parameters, compiled
    torch.jit.script(model)       # the same for each of ours inside a model (TorchScript's __prepare_scriptable__)
    torch.export.export(model, (x,))   # ours itself, traced: also variants, unpad=True, per-head weights

Our forwards take Python objects TorchScript has no type for (Unpadding, a kernel module chosen at build time),
so TorchScript cannot compile them. Ours computes nn.MultiheadAttention's / nn.TransformerEncoderLayer's /
nn.TransformerEncoder's function, so each of ours has `__prepare_scriptable__`, the hook torch.jit.script calls on
every module before compiling, returning PyTorch's module that holds the same parameter and submodule objects
(`to_official(share=True)`): the script module computes ours' numbers, and trains and loads with the model.
What PyTorch's modules cannot express is refused with one ScriptError naming torch.export, which traces ours.
TorchScript puts the returned module into the parent module it was found in: a model holding ours, once
scripted, holds PyTorch's modules there, with the same parameters (so the same numbers); script a copy
(copy.deepcopy) to keep ours in it.
"""

from __future__ import annotations


class ScriptError(RuntimeError):
    """torch.jit.script of one of ours that PyTorch's module cannot stand in for (a RuntimeError, as
    TorchScript's own failures are)."""


def refuse(what: str, why: str, fix: str) -> ScriptError:
    """The one-line refusal: what was scripted, what PyTorch's module cannot express, the fixes."""
    return ScriptError(f"torch.jit.script compiles PyTorch's {what} in place of ours, which cannot express {why}; "
                       f"{fix}, or use torch.export.export(model, args), which compiles ours as it is.")
