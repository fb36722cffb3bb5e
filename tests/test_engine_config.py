"""The engine's settings: requests are admitted in arrival order (`--schedule-policy` takes only fcfs, as SGLang's
flag is expected to exist), settings that no longer exist are unknown ones, and the environment switches are
declared once (minisrv/env.py), typed, and read nowhere else."""
from __future__ import annotations

import argparse
import ast
from pathlib import Path

import pytest

from minisrv import env
from minisrv.config import EngineConfig
from minisrv.kernels.cpu_build import cache_dir

PACKAGE = Path(__file__).resolve().parent.parent / "minisrv"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    EngineConfig.add_cli_args(p)
    return p


def test_schedule_policy_is_fcfs_only(capsys):
    assert EngineConfig.from_args(_parser().parse_args([])).schedule_policy == "fcfs"
    assert EngineConfig.from_args(_parser().parse_args(["--schedule-policy", "fcfs"])).schedule_policy == "fcfs"
    with pytest.raises(SystemExit):
        _parser().parse_args(["--schedule-policy", "lpm"])
    assert "invalid choice: 'lpm'" in capsys.readouterr().err
    with pytest.raises(ValueError, match="schedule_policy must be one of \\('fcfs',\\)"):
        EngineConfig(schedule_policy="lpm")


@pytest.mark.parametrize("flag,setting", [("--decode-gemm", "decode_gemm"),
                                          ("--debug-fail-on-token", "fail_on_token")])
def test_settings_that_no_longer_exist_are_unknown(flag, setting, capsys):
    with pytest.raises(SystemExit):
        _parser().parse_args([flag, "1"])
    assert "unrecognized arguments" in capsys.readouterr().err
    with pytest.raises(TypeError, match=setting):
        EngineConfig(**{setting: 1})


def test_env_switches_typed_with_defaults(monkeypatch):
    switches = [v for v in vars(env).values() if isinstance(v, env.EnvSwitch)]
    assert {s.name for s in switches} == {"MINISRV_CACHE_DIR", "MINISRV_KERNEL_CACHE", "MINISRV_TORCH_SAMPLING"}
    for s in switches:
        monkeypatch.delenv(s.name, raising=False)
        assert s.get() == s.default and s.meaning
    monkeypatch.setenv("MINISRV_TORCH_SAMPLING", "1")
    assert env.TORCH_SAMPLING.get() is True
    monkeypatch.setenv("MINISRV_TORCH_SAMPLING", "0")
    assert env.TORCH_SAMPLING.get() is False
    monkeypatch.setenv("MINISRV_KERNEL_CACHE", "/tmp/kernels-here")
    assert cache_dir() == Path("/tmp/kernels-here")
    monkeypatch.setenv("MINISRV_KERNEL_CACHE", "")  # empty: the default place
    monkeypatch.setenv("XDG_CACHE_HOME", "/tmp/xdg")
    assert cache_dir() == Path("/tmp/xdg/minisrv/cpu_kernels")


def test_no_module_reads_a_minisrv_variable_but_env():
    """A MINISRV_ name passed to any call (os.environ.get, getenv, ...) only in env.py, where each is declared."""
    readers = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Call, ast.Subscript)):
                args = node.args if isinstance(node, ast.Call) else [node.slice]
                if any(isinstance(a, ast.Constant) and str(a.value).startswith("MINISRV_") for a in args):
                    readers.append(path.relative_to(PACKAGE).as_posix())
    assert set(readers) == {"env.py"}
