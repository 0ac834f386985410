"""--user, --group, --initgroups, --umask, --bind-mode, --bind-group (issue 12): resolved once,
in the arbiter, into the ids a worker drops to; a typo is one line (exit 2). Pure."""

from __future__ import annotations

import grp
import os
import pwd
from typing import Any

import pytest

from forkserve.config import ConfigError, parse_args, resolve
from forkserve.workers.base import WorkerSettings


def config(*argv: str) -> Any:
    return resolve(parse_args([*argv, "tests.apps.basic:app"], "test")[0], {})


def test_no_user_no_drop() -> None:
    c = config()
    assert c.worker_identity() is None and c.bind_gid() is None
    assert WorkerSettings.of(c).identity is None


@pytest.mark.skipif(os.geteuid() != 0, reason="naming another user needs root")
def test_a_user_by_name_gets_its_own_group_and_no_supplementary_ones() -> None:
    nobody = pwd.getpwnam("nobody")
    c = config("--user", "nobody")
    assert c.worker_identity() == (nobody.pw_uid, nobody.pw_gid, (nobody.pw_gid,))
    assert WorkerSettings.of(c).identity == c.worker_identity()
    with_groups = config("--user", "nobody", "--initgroups").worker_identity()
    assert with_groups is not None
    assert set(with_groups[2]) == set(os.getgrouplist("nobody", nobody.pw_gid))


@pytest.mark.skipif(os.geteuid() != 0, reason="naming another user needs root")
def test_a_bare_uid_and_a_group_and_the_sockets_group() -> None:
    root_group = grp.getgrgid(0).gr_name
    assert config("--user", "4242", "--group", "4343").worker_identity() == (4242, 4343, (4343,))
    assert config("--group", root_group).bind_gid() == 0  # --bind-group defaults to --group
    assert config("--group", "5", "--bind-group", "6").bind_gid() == 6


@pytest.mark.parametrize("argv, message", [
    (["--user", "no-such-user-here"], "--user: no such user: 'no-such-user-here'"),
    (["--group", "no-such-group-here"], "--group: no such group: 'no-such-group-here'"),
    (["--bind-group", "no-such-group-here"], "--bind-group: no such group: 'no-such-group-here'"),
    (["--umask", "9"], "--umask: expected an octal mode such as 027 or 660, got '9'"),
    (["--bind-mode", "1777"], "--bind-mode: expected an octal mode from 0 to 777, got '1777'"),
])
def test_a_bad_value_is_one_line(argv: list[str], message: str) -> None:
    with pytest.raises(ConfigError) as caught:
        config(*argv)
    assert str(caught.value) == message


@pytest.mark.parametrize("raw, mode", [("027", 0o27), ("0o660", 0o660), ("660", 0o660), ("0", 0)])
def test_modes_are_octal(raw: str, mode: int) -> None:
    assert config("--umask", raw).umask == mode


def test_without_root_another_user_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    monkeypatch.setattr(os, "getegid", lambda: 1000)
    with pytest.raises(ConfigError) as caught:
        config("--user", "0")
    assert str(caught.value) == "--user/--group need root: forkserve runs as uid 1000"


@pytest.mark.parametrize("argv, mode", [([], 0o666), (["--umask", "027"], 0o640),
                                        (["--bind-mode", "600"], 0o600),
                                        (["--bind-mode", "660", "--umask", "077"], 0o660)])
def test_the_mode_of_a_unix_socket(argv: list[str], mode: int) -> None:
    """666 unless told: the inherited umask (022: 755) would lock out a proxy running as
    another user; an explicit --umask narrows it, an explicit --bind-mode is taken as is."""
    from forkserve.arbiter.acquire import unix_mode
    assert unix_mode(config(*argv)) == mode
