"""wandb set-up: the key found where wandb finds it, offline within seconds when the server is unreachable,
the sweep's group and the checkpoint's run id."""

from __future__ import annotations

import json
import logging
import socket
import time

import pytest
import torch
from conftest import compose_train

from mhalab.train import loggers
from mhalab.train.loggers import _has_wandb_key, prepare_wandb
from mhalab.train.run import run

KEY = "local-" + "k" * 40  # the shape wandb accepts (40+ characters after the prefix)
WANDB_VARS = ("WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE", "WANDB_BASE_URL", "WANDB_MODE", "WANDB_CONFIG_DIR",
              "WANDB_DIR", "WANDB_INIT_TIMEOUT", "NETRC", "HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY", "http_proxy", "https_proxy", "no_proxy")


@pytest.fixture(autouse=True)
def wandb_env(tmp_path, monkeypatch):
    """Nothing from the developer's machine: no key, netrc, settings file, mode or proxy; HOME and cwd are tmp.

    setenv before delenv makes monkeypatch restore each variable afterwards even when it was unset, which
    also undoes the WANDB_MODE=dryrun that Lightning's offline WandbLogger writes into os.environ."""
    for var in WANDB_VARS:
        monkeypatch.setenv(var, "")
        monkeypatch.delenv(var)
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(tmp_path)
    return home


def write_netrc(path, machine, key=KEY):
    path.write_text(f"machine {machine}\n  login user\n  password {key}\n")
    path.chmod(0o600)
    return path


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # nothing listens there once the socket is closed


def test_key_is_found_in_the_netrc_file_named_by_NETRC_for_the_base_urls_host(tmp_path, monkeypatch):
    monkeypatch.setenv("NETRC", str(write_netrc(tmp_path / "creds", "wandb.example.org")))
    monkeypatch.setenv("WANDB_BASE_URL", "https://wandb.example.org")
    assert _has_wandb_key()


def test_key_is_not_found_for_another_host(tmp_path, monkeypatch, wandb_env):
    monkeypatch.setenv("NETRC", str(write_netrc(tmp_path / "creds", "wandb.example.org")))
    monkeypatch.setenv("WANDB_BASE_URL", "https://other.example.org")
    assert not _has_wandb_key()
    monkeypatch.delenv("WANDB_BASE_URL")  # wandb's default server is not wandb.example.org either
    assert not _has_wandb_key()
    write_netrc(wandb_env / ".netrc", "other.example.org")  # $NETRC wins over ~/.netrc
    monkeypatch.setenv("WANDB_BASE_URL", "https://other.example.org")
    assert not _has_wandb_key()


def test_key_is_found_in_home_netrc_for_the_server_wandb_login_host_saved(monkeypatch, wandb_env):
    """`wandb login --host URL` saves base_url in ~/.config/wandb/settings and the key under URL's host."""
    write_netrc(wandb_env / ".netrc", "wandb.example.org")
    assert not _has_wandb_key()  # the default server has no entry
    settings = wandb_env / ".config" / "wandb" / "settings"
    settings.parent.mkdir(parents=True)
    settings.write_text("[default]\nbase_url = https://wandb.example.org\n")
    assert _has_wandb_key()
    assert loggers._base_url(loggers._wandb_settings()) == "https://wandb.example.org"


def test_wandb_is_offline_without_a_key_and_resumes_the_checkpoints_run(tmp_path):
    ckpt = tmp_path / "last.ckpt"
    torch.save({"mhalab": {"wandb_id": "abc123"}, "hyper_parameters": {}}, ckpt)
    kwargs = prepare_wandb({"project": "mhalab", "group": None}, str(ckpt), multirun=False)
    assert kwargs["offline"] is True and kwargs["id"] == "abc123" and kwargs["resume"] == "allow"
    assert "id" not in prepare_wandb({"project": "mhalab"}, None, multirun=False)


def test_wandb_with_a_key_goes_offline_within_seconds_when_the_server_is_unreachable(tmp_path, monkeypatch,
                                                                                     caplog):
    port = closed_port()
    monkeypatch.setenv("WANDB_API_KEY", KEY)
    monkeypatch.setenv("WANDB_BASE_URL", f"http://127.0.0.1:{port}")
    caplog.set_level(logging.WARNING, logger="mhalab")
    start = time.monotonic()
    kwargs = prepare_wandb({"project": "mhalab", "save_dir": str(tmp_path / "run"), "log_model": True}, None,
                           multirun=False)
    assert time.monotonic() - start < 5
    assert kwargs["offline"] is True
    assert kwargs["log_model"] is False  # WandbLogger refuses offline with log_model
    [line] = [r.getMessage() for r in caplog.records if "unreachable" in r.getMessage()]
    wandb_dir = tmp_path / "run" / "wandb"
    assert line.startswith(f"wandb: 127.0.0.1:{port} is unreachable (")
    assert line.endswith(f"logging offline to {wandb_dir}, upload later with `wandb sync {wandb_dir}`")


def test_wandb_stays_online_when_the_user_insists_but_warns(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("WANDB_API_KEY", KEY)
    monkeypatch.setenv("WANDB_BASE_URL", f"http://127.0.0.1:{closed_port()}")
    caplog.set_level(logging.WARNING, logger="mhalab")
    assert prepare_wandb({"project": "mhalab", "offline": False}, None, multirun=False)["offline"] is False
    monkeypatch.setenv("WANDB_MODE", "online")
    assert "offline" not in prepare_wandb({"project": "mhalab"}, None, multirun=False)
    assert sum("unreachable" in r.getMessage() and "staying online" in r.getMessage()
               for r in caplog.records) == 2
    caplog.clear()
    for mode in ("offline", "disabled"):  # no server needed: not checked, not changed
        monkeypatch.setenv("WANDB_MODE", mode)
        assert "offline" not in prepare_wandb({"project": "mhalab"}, None, multirun=False)
    assert not caplog.records


def test_wandb_with_a_key_and_a_reachable_server_is_not_forced_offline(monkeypatch, caplog):
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        monkeypatch.setenv("WANDB_API_KEY", KEY)
        monkeypatch.setenv("WANDB_BASE_URL", f"http://127.0.0.1:{server.getsockname()[1]}")
        caplog.set_level(logging.WARNING, logger="mhalab")
        kwargs = prepare_wandb({"project": "mhalab"}, None, multirun=False)
    assert "offline" not in kwargs and not caplog.records


def test_reachability_check_is_bounded_even_when_the_name_lookup_hangs(monkeypatch):
    monkeypatch.setattr(loggers, "REACH_TIMEOUT_S", 0.3)

    def stuck_lookup(*args, **kwargs):
        time.sleep(2)
        raise socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")

    monkeypatch.setattr(loggers.socket, "create_connection", stuck_lookup)
    start = time.monotonic()
    reason = loggers._unreachable("wandb.example.org", 443)
    assert time.monotonic() - start < 1.5 and reason == "no connection within 0.3 s"


def test_the_check_goes_to_the_proxy_wandb_would_use(monkeypatch):
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy.example.org:3128")
    monkeypatch.setenv("NO_PROXY", "internal.example.org")
    assert loggers._proxy("https://api.wandb.ai") == "http://proxy.example.org:3128"
    assert loggers._host_port("http://proxy.example.org:3128") == ("proxy.example.org", 3128)
    assert loggers._proxy("https://internal.example.org") is None
    assert loggers._proxy("http://127.0.0.1:8080") is None  # loopback is never proxied
    assert loggers._host_port("https://api.wandb.ai") == ("api.wandb.ai", 443)


@pytest.mark.slow
def test_wandb_offline_run_resumes_with_the_same_run_id(tmp_path, toy_data_dir, monkeypatch):
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb"))
    first = compose_train(["logger=wandb", "max_epochs=1", "test_after_fit=false"], tmp_path / "a",
                          toy_data_dir, tmp_path / "cache")
    run(first)
    resumed = compose_train(["logger=wandb", "max_epochs=2", "test_after_fit=false", f"ckpt_path={tmp_path / 'a'}"],
                            tmp_path / "b", toy_data_dir, tmp_path / "cache")
    run(resumed)
    a = json.loads((tmp_path / "a" / "metrics.json").read_text())
    b = json.loads((tmp_path / "b" / "metrics.json").read_text())
    assert a["wandb_id"] and a["wandb_id"] == b["wandb_id"]
