import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import DEMO_CORPUS
from wbrag_ray.cli import COMMANDS, main


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_help_on_every_subcommand(command, capsys):
    with pytest.raises(SystemExit) as e:
        main([command, "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "usage: wbrag" in out
    if command not in ("status", "logs", "stop", "report", "inspect", "data", "doctor"):  # a job, a run, data, a node: no config
        assert "--set" in out


def test_console_script_is_installed():
    """The `wbrag` entry point pyproject.toml declares, as the install put it beside this interpreter."""
    script = Path(sys.executable).parent / "wbrag"
    assert script.is_file(), f"no console script at {script}: reinstall the package (pip install -e .)"
    out = subprocess.run([str(script), "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.startswith("usage: wbrag") and "ingest" in out.stdout and "demo" in out.stdout


def test_config_errors_exit_2_with_the_key(tmp_path, capsys):
    assert main(["ingest", str(tmp_path / "r"), "--set", "ingest.shard_byte=5"]) == 2
    err = capsys.readouterr().err
    assert "ingest.shard_byte" in err and "ingest.shard_bytes" in err


def test_ingest_without_corpus_says_what_to_pass(tmp_path, capsys):
    assert main(["ingest", str(tmp_path / "r")]) == 2
    assert "--corpus" in capsys.readouterr().err


def test_embed_before_ingest_names_the_missing_stage(tmp_path, capsys):
    from wbrag_ray.config import load_config
    from wbrag_ray.run import RunFolder

    RunFolder(str(tmp_path / "r")).bind_config(load_config())
    assert main(["embed", str(tmp_path / "r")]) == 2
    assert "wbrag ingest" in capsys.readouterr().err


def test_unreachable_ray_address_is_a_clear_error(tmp_path):
    # a fresh process: this session's tests already hold a local Ray
    out = subprocess.run(
        [sys.executable, "-m", "wbrag_ray.cli", "ingest", str(tmp_path / "r"), "--corpus", str(DEMO_CORPUS),
         "--address", "127.0.0.1:1"], capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 2
    assert "cannot reach the Ray cluster at ray.address='127.0.0.1:1'" in out.stderr


def test_methods_grid_refuses_flags_it_cannot_combine_with(tmp_path, capsys):
    base = ["eval", str(tmp_path / "run"), "--dataset", str(tmp_path / "qa.jsonl"), "--methods-grid"]
    assert main([*base, "--grid"]) == 2
    assert "two grids" in capsys.readouterr().err
    assert main([*base, "--writeback"]) == 2
    assert "every trained write-back version" in capsys.readouterr().err
    assert main([*base[:-1], "--same-writeback"]) == 2
    assert "add --methods-grid" in capsys.readouterr().err
    assert main([*base, "--same-writeback"]) == 2  # no writeback.train to write back from
    assert "writeback.train" in capsys.readouterr().err
