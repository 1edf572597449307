"""A tier file someone else could have planted is never mapped (issue 35): the name of the file follows
from a public model config, so the server must not start on, and a client must not map, a file that is
not a regular file of this user with no access for anyone else. Each case below was mapped before."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from host_tier.arena import KEY_BYTES, Arena, TierFileRefused

FP = bytes(range(KEY_BYTES))


def _planted(path: Path, mode: int, uid: int | None = None) -> None:
    """A valid tier file of the right geometry, as a planter would make it, then given ``mode``/``uid``."""
    Arena.create(path, 4096, 4, FP).close()
    os.chmod(path, mode)
    if uid is not None:
        os.chown(path, uid, -1)


def test_a_tier_file_open_to_others_is_refused_by_server_and_client(tmp_path: Path) -> None:
    path = tmp_path / "tier"
    _planted(path, 0o666)
    with pytest.raises(TierFileRefused, match="mode 0666"):
        Arena.create(path, 4096, 4, FP)
    with pytest.raises(TierFileRefused, match="mode 0666"):
        Arena.open(path)


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another user needs root (CI and the dev hosts run as root)")
def test_a_tier_file_of_another_user_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "tier"
    _planted(path, 0o600, uid=65534)
    with pytest.raises(TierFileRefused, match="owned by uid 65534"):
        Arena.create(path, 4096, 4, FP)
    with pytest.raises(TierFileRefused, match="owned by uid 65534"):
        Arena.open(path)


def test_a_symbolic_link_in_place_of_the_tier_file_is_refused(tmp_path: Path) -> None:
    target = tmp_path / "elsewhere"
    _planted(target, 0o600)
    link = tmp_path / "tier"
    link.symlink_to(target)
    with pytest.raises(TierFileRefused):
        Arena.create(link, 4096, 4, FP)
    with pytest.raises(TierFileRefused):
        Arena.open(link)


def test_the_tier_makes_its_file_private_and_reopens_its_own(tmp_path: Path) -> None:
    path = tmp_path / "tier"
    arena = Arena.create(path, 4096, 4, FP)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and path.stat().st_uid == os.geteuid()
    assert arena.write(1, b"k" * KEY_BYTES, b"block")
    arena.close()
    again = Arena.create(path, 4096, 4, FP)  # a restart keeps its own blocks
    assert again.read(1, b"k" * KEY_BYTES) == b"block"
    again.close()
