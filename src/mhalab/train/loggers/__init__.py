"""Logger set-up that needs code, not just config: the optional packages a logger needs, and wandb that never
hangs and resumes its run.

wandb with an API key but no way to reach its server does not fall back to offline by itself: wandb.init()
waits for `init_timeout` (90 s) and then raises. So before a run starts, `prepare_wandb` looks for the key the
way wandb does (WANDB_API_KEY, else the netrc file for the server's host) and, with a key, tries a TCP
connection to the server (or to the proxy wandb would use) for a few seconds; unreachable -> offline.
"""

from __future__ import annotations

import importlib.util
import ipaddress
import logging
import netrc
import os
import socket
import threading
import urllib.request
from pathlib import Path
from urllib.parse import urlsplit

log = logging.getLogger("mhalab")

REACH_TIMEOUT_S = 3.0  # the whole reachability check (name lookup included) gives up after this
FALLBACK_BASE_URL = "https://api.wandb.ai"  # for wandb versions whose settings cannot be read as below
QUIET_MODES = {"offline", "dryrun", "disabled"}  # modes in which wandb does not talk to the server
# loggers whose package is an optional extra of mhalab (pyproject.toml): class name -> (module, extra)
OPTIONAL = {"WandbLogger": ("wandb", "wandb"), "TensorBoardLogger": ("tensorboard", "tensorboard")}


def check_installed(logger_cfg: dict) -> None:
    """Each configured logger's package is importable; else one ConfigError naming the extra to install
    (before any data is read: mhalab.train.config.validate calls this)."""
    from mhalab.errors import ConfigError

    for name, c in (logger_cfg or {}).items():
        cls = str((c or {}).get("_target_", "")).rsplit(".", 1)[-1]
        if cls in OPTIONAL and importlib.util.find_spec(OPTIONAL[cls][0]) is None:
            module, extra = OPTIONAL[cls]
            raise ConfigError(f"logger={name} needs the {module} package, which is not installed; "
                              f"pip install 'mhalab[{extra}]' (or pip install {module}), or use logger=csv.")


def _wandb_settings():
    """wandb's settings loaded the way `wandb.setup()` loads them, or None where this wandb version differs.

    Settings files first (~/.config/wandb/settings, or $WANDB_CONFIG_DIR/settings, then ./wandb/settings;
    `wandb login --host` and `wandb offline` write there), then the WANDB_* variables over them."""
    try:
        import wandb

        settings = wandb.Settings(quiet=True)  # quiet: wandb.init() prints "Loading settings from" itself
        config_dir = os.environ.get("WANDB_CONFIG_DIR")
        settings.settings_system = str(Path(config_dir).expanduser() / "settings" if config_dir
                                       else Path("~", ".config", "wandb", "settings").expanduser())
        settings.update_from_system_settings()
        settings.update_from_env_vars(dict(os.environ))
        return settings
    except Exception as e:  # noqa: BLE001 -- an older wandb, or settings wandb.init() rejects and explains
        log.debug("wandb: cannot read wandb's settings (%s); using the environment only", e)
        return None


def _base_url(settings=None) -> str:
    if settings is not None:
        return settings.base_url
    return os.environ.get("WANDB_BASE_URL") or FALLBACK_BASE_URL


def _netrc_path() -> Path:
    """The netrc file wandb and requests read: $NETRC, else ~/.netrc, else ~/_netrc.

    (Python's `netrc.netrc()` without an argument reads ~/.netrc only and ignores $NETRC.)"""
    if os.environ.get("NETRC"):
        return Path(os.environ["NETRC"]).expanduser()
    for name in (".netrc", "_netrc"):
        if (path := Path("~", name).expanduser()).exists():
            return path
    return Path("~", ".netrc").expanduser()


def _netrc_has_key(base_url: str) -> bool:
    try:
        from wandb.errors import Error as WandbError
        from wandb.sdk.lib.wbauth import read_netrc_auth  # what wandb.init() itself calls
    except ImportError:  # older wandb
        read_netrc_auth = None
    if read_netrc_auth is not None:
        try:
            return read_netrc_auth(host=base_url) is not None
        except (WandbError, ValueError, TypeError) as e:  # a malformed key or URL: wandb.init() will say so
            log.debug("wandb: reading the netrc file: %s", e)
            return True
    machine = urlsplit(base_url).netloc  # host[:port], as `wandb login` writes it
    try:
        creds = netrc.netrc(str(_netrc_path())).authenticators(machine)
    except (OSError, netrc.NetrcParseError):
        return False
    return bool(creds and creds[2])


def _has_wandb_key(settings=None) -> bool:
    """Whether wandb.init() will find credentials without prompting: the variables, else the netrc file's
    entry for the server's host (the host of WANDB_BASE_URL or of the settings file's base_url)."""
    if os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return True
    if settings is None:
        settings = _wandb_settings()
    if settings is not None and (settings.api_key or getattr(settings, "identity_token_file", None)):
        return True
    return _netrc_has_key(_base_url(settings))


def _proxy(url: str, settings=None) -> str | None:
    """The proxy wandb's Go core would connect through for `url`: settings, else $HTTPS_PROXY / $HTTP_PROXY
    (minus $NO_PROXY); Go never proxies loopback addresses."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    try:
        if host == "localhost" or ipaddress.ip_address(host).is_loopback:
            return None
    except ValueError:
        pass
    if settings is not None and (proxy := getattr(settings, f"{parts.scheme}_proxy", None)):
        return proxy
    if urllib.request.proxy_bypass_environment(host):
        return None
    return urllib.request.getproxies_environment().get(parts.scheme)


def _host_port(url: str) -> tuple[str, int]:
    parts = urlsplit(url if "://" in url else f"http://{url}")
    return parts.hostname or "", parts.port or (443 if parts.scheme == "https" else 80)


def _unreachable(host: str, port: int, timeout: float | None = None) -> str | None:
    """None if a TCP connection to host:port opens within `timeout` seconds, else why not.

    The connection is tried in a daemon thread so that a stuck name lookup (which no socket timeout
    bounds) cannot hold the caller past the timeout either."""
    timeout = REACH_TIMEOUT_S if timeout is None else timeout
    result: list[str | None] = []

    def attempt():
        try:
            socket.create_connection((host, port), timeout=timeout).close()
            result.append(None)
        except socket.gaierror as e:
            result.append(f"cannot resolve the host: {e.strerror or e}")
        except OSError as e:
            result.append(e.strerror or str(e) or type(e).__name__)

    thread = threading.Thread(target=attempt, name="wandb-reachability", daemon=True)
    thread.start()
    thread.join(timeout)
    return result[0] if result else f"no connection within {timeout:g} s"


def _wandb_dir(kwargs: dict) -> Path:
    """Where the run's files go: <save_dir>/wandb (WandbLogger passes save_dir, default ".", as wandb's dir)."""
    root = kwargs.get("save_dir", ".") or kwargs.get("dir") or os.environ.get("WANDB_DIR") or "."
    root = Path(root).expanduser().absolute()
    return root / (".wandb" if (root / ".wandb").exists() else "wandb")


def _go_offline(kwargs: dict) -> None:
    kwargs["offline"] = True
    if kwargs.get("log_model"):  # WandbLogger refuses offline together with log_model
        kwargs["log_model"] = False
        log.warning("wandb: offline, so checkpoints are not uploaded (log_model set to false)")


def prepare_wandb(kwargs: dict, ckpt_path: str | None, multirun: bool) -> dict:
    """Fill in what the YAML cannot know: offline mode, the sweep's group, the resumed run id."""
    kwargs = dict(kwargs)
    settings = _wandb_settings()
    env_mode = os.environ.get("WANDB_MODE", "").strip().lower()
    mode = (settings.mode if settings is not None else env_mode) or "online"
    if mode != "disabled" and not kwargs.get("offline"):
        if not _has_wandb_key(settings):
            # no key: log locally (`wandb sync <dir>` uploads later) instead of prompting or hanging
            _go_offline(kwargs)
            log.info("wandb: no API key found, logging offline to %s", _wandb_dir(kwargs))
        elif mode not in QUIET_MODES:
            insist = (f"WANDB_MODE={env_mode}" if env_mode in {"online", "run", "shared"}
                      else "offline=false was given" if "offline" in kwargs else None)
            _check_server(kwargs, settings, insist)
    if multirun and not kwargs.get("group"):
        from hydra.core.hydra_config import HydraConfig

        kwargs["group"] = Path(HydraConfig.get().sweep.dir).name  # all members of one sweep share a group
    if ckpt_path:
        from mhalab.train import checkpoint

        run_id = checkpoint.meta(ckpt_path)["mhalab"].get("wandb_id")
        if run_id:
            kwargs.update(id=run_id, resume="allow")  # continue the same wandb run
    return kwargs


def _check_server(kwargs: dict, settings, insist: str | None) -> None:
    """With a key: go offline if the server (or the proxy to it) does not accept a TCP connection.

    `insist`: why the user wants online regardless (WANDB_MODE=online, or an explicit offline=false) -- then
    only warn."""
    url = _base_url(settings)
    proxy = _proxy(url, settings)
    host, port = _host_port(proxy or url)
    if not host or (reason := _unreachable(host, port)) is None:
        return
    what = f"{host}:{port}" + (f" (the proxy to {url})" if proxy else "")
    if insist:
        timeout = getattr(settings, "init_timeout", 90.0) if settings is not None else 90.0
        log.warning("wandb: %s is unreachable (%s); %s, so staying online: wandb.init() will retry for about "
                    "%g s (init_timeout, WANDB_INIT_TIMEOUT) and then fail", what, reason, insist, timeout)
        return
    _go_offline(kwargs)
    wandb_dir = _wandb_dir(kwargs)
    log.warning("wandb: %s is unreachable (%s); logging offline to %s, upload later with `wandb sync %s`",
                what, reason, wandb_dir, wandb_dir)



def finish(loggers, exit_code: int = 0) -> None:
    """End each W&B run this process started, so its record is complete on disk (an offline run can be read and
    synced) and the next run of a sweep in this process starts its own: Lightning's WandbLogger leaves the run
    open until the process exits."""
    for lg in loggers:
        run = getattr(lg, "_experiment", None) if type(lg).__name__ == "WandbLogger" else None
        if run is not None:
            run.finish(exit_code=exit_code)
