"""What ships around the server: the Makefile's install stamps, the units."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def up_to_date(venv: Path, *args: str) -> bool:
    """``make -q install``: whether make would do nothing."""
    r = subprocess.run(
        ["make", "-q", "-C", str(ROOT), f"VENV={venv}", "install", *args],
        capture_output=True,
        text=True,
    )
    return r.returncode == 0


def test_installing_another_mlx_build_is_not_nothing_to_do(tmp_path):
    """README's `make install MLX_EXTRA=cuda` after any earlier install said
    "Nothing to be done": the one stamp did not know which MLX it installed."""
    venv = tmp_path / "venv"
    venv.mkdir()
    (venv / ".installed-cpu").touch()  # a CPU install, newer than every input
    assert up_to_date(venv, "MLX_EXTRA=cpu")
    assert not up_to_date(venv, "MLX_EXTRA=cuda")


def test_a_worker_rank_comes_back_after_its_group_stopped_cleanly():
    """A group stopped from its serving rank (a reboot, a restart to apply a
    setting) exits 0 on every rank: Restart=on-failure left the workers down and
    the group never formed again."""
    unit = (ROOT / "deploy" / "kvwarm-rank.service").read_text()
    assert "\nRestart=always\n" in unit


def test_a_settings_error_is_not_restarted_for_ever(tmp_path):
    """A bad flag or .env value exits 2 at every start: restarted every 5 s it
    never reached systemd's default start limit and looped for good."""
    import os

    env = {**os.environ, "KVWARM_PORT": "not-a-port"}
    r = subprocess.run(
        [str(Path(sys.executable).with_name("kvwarm")), "serve"],
        env=env,
        capture_output=True,
        cwd=tmp_path,
    )
    assert r.returncode == 2
    for unit in ("kvwarm.service", "kvwarm-rank.service"):
        assert "\nRestartPreventExitStatus=2\n" in (ROOT / "deploy" / unit).read_text()


def test_a_plain_make_keeps_the_mlx_build_installed_last(tmp_path):
    """After `make install MLX_EXTRA=cuda`, a plain `make serve` reinstalled the
    CPU build over it (the default extra named another stamp)."""
    venv = tmp_path / "venv"
    venv.mkdir()
    (venv / ".installed-cuda").touch()
    assert up_to_date(venv)
    assert not up_to_date(venv, "MLX_EXTRA=cpu")


def test_an_older_makefiles_dev_stamp_is_no_mlx_build(tmp_path):
    """Before the stamps named their MLX build, the dev tools' stamp was
    .installed-dev: read as the build installed last, it made MLX_EXTRA=dev."""
    venv = tmp_path / "venv"
    venv.mkdir()
    (venv / ".installed").touch()
    (venv / ".installed-dev").touch()
    r = subprocess.run(
        ["make", "-n", "-C", str(ROOT), f"VENV={venv}", "install"], capture_output=True, text=True
    )
    assert "pip_requirements.py dev vision" not in r.stdout
    assert "pip_requirements.py" in r.stdout  # it does install: the build is not known
