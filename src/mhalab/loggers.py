"""Logger set-up that needs code, not just config: wandb that never hangs and resumes its run."""

from __future__ import annotations

import logging
import netrc
import os
from pathlib import Path

log = logging.getLogger("mhalab")


def _has_wandb_key() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    try:
        return netrc.netrc().authenticators("api.wandb.ai") is not None
    except (FileNotFoundError, netrc.NetrcParseError):
        return False


def prepare_wandb(kwargs: dict, ckpt_path: str | None, multirun: bool) -> dict:
    """Fill in what the YAML cannot know: offline mode, the sweep's group, the resumed run id."""
    kwargs = dict(kwargs)
    if not _has_wandb_key() and os.environ.get("WANDB_MODE") != "disabled":
        # no key: log locally (`wandb sync <dir>` uploads later) instead of prompting or hanging
        kwargs["offline"] = True
        log.info("wandb: no API key found, logging offline")
    if multirun and not kwargs.get("group"):
        from hydra.core.hydra_config import HydraConfig

        kwargs["group"] = Path(HydraConfig.get().sweep.dir).name  # all members of one sweep share a group
    if ckpt_path:
        from mhalab.config import checkpoint_meta

        run_id = checkpoint_meta(str(ckpt_path))["mhalab"].get("wandb_id")
        if run_id:
            kwargs.update(id=run_id, resume="allow")  # continue the same wandb run
    return kwargs
