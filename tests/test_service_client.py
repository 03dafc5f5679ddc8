"""The service client's flags: a bad one exits 2 naming the flag, before any call is made.

In-process (`main([...])`): no server is needed, since each refusal comes before the channel
would be used.
"""
from __future__ import annotations

import pytest

from tenax.orchestrator.cli.main import main

COMMANDS = [["status"], ["status", "some-job"], ["watch", "some-job"], ["cancel", "some-job"],
            ["scale", "some-job", "--nodes", "1"]]


@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf", "abc"])
@pytest.mark.parametrize("command", COMMANDS)
def test_a_timeout_that_is_not_a_positive_number_is_a_bad_flag(command, value, capsys):
    with pytest.raises(SystemExit) as exit_:
        main([*command, "--server", "127.0.0.1:1", f"--timeout={value}"])
    assert exit_.value.code == 2
    assert "--timeout" in capsys.readouterr().err


def test_an_unreadable_tls_ca_is_a_bad_flag_not_a_traceback(tmp_path, capsys):
    for path in (tmp_path, tmp_path / "missing.pem"):  # a directory, then nothing there
        assert main(["status", "--server", "127.0.0.1:1", "--tls-ca", str(path)]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("error: --tls-ca: cannot read") and str(path) in err, err
        assert len(err.splitlines()) == 1, err


def test_a_positive_timeout_reaches_the_call(capsys):
    """Nothing listens on port 1: the call itself fails (exit 1), the flag was fine."""
    assert main(["status", "--server", "127.0.0.1:1", "--timeout", "2.5"]) == 1
    err = capsys.readouterr().err
    assert "UNAVAILABLE" in err and "is `tenax serve` running at that address" in err, err


def test_a_ray_tmpdir_too_long_for_rays_sockets_is_passed_over(monkeypatch, tmp_path) -> None:
    """Ray's socket paths (< 108 bytes) go below the embedded Ray's temp dir: a RAY_TMPDIR
    that leaves them no room would fail `ray.init`, so the system temp dir is used then."""
    from tenax.orchestrator.service.submission import ray_temp_parent

    monkeypatch.setenv("RAY_TMPDIR", "/tmp/tx")
    assert ray_temp_parent() == "/tmp/tx"
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path / ("x" * 40)))
    assert ray_temp_parent() is None
    monkeypatch.delenv("RAY_TMPDIR")
    assert ray_temp_parent() is None
