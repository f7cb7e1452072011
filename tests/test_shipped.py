"""What the package says about itself, and its shipped models by name, from any directory (subprocesses)."""

from __future__ import annotations

import importlib
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
import torch

import mixtral_infer
from mixtral_infer import Tokenizer, generate, load_model
from mixtral_infer.checkpoint.loading import save_consolidated
from mixtral_infer.errors import CheckpointError
from mixtral_infer.shipped import SHIPPED_MODELS, resolve_model_folder, shipped_models

REPO = Path(__file__).resolve().parents[1]


def run_module(*args, cwd, stdin=None):
    """``python -m mixtral_infer ARGS`` in ``cwd``, where the repository is not on the import path."""
    return subprocess.run(
        [sys.executable, "-m", "mixtral_infer", *args], cwd=cwd, input=stdin, capture_output=True, text=True, timeout=120
    )


def test_version_from_the_installed_metadata():
    assert mixtral_infer.__version__ == metadata.version("mixtral_infer")
    assert re.fullmatch(r"\d+\.\d+\.\d+.*", mixtral_infer.__version__)
    pyproject = (REPO / "pyproject.toml").read_text()
    assert f'version = "{mixtral_infer.__version__}"' in pyproject


def test_version_falls_back_to_pyproject_when_not_installed(monkeypatch):
    import mixtral_infer._version as version_module

    def not_installed(name):
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "version", not_installed)
    try:
        assert importlib.reload(version_module).__version__ == f"{metadata.distribution('mixtral_infer').version}+source"
    finally:
        monkeypatch.undo()
        importlib.reload(version_module)


def test_dash_dash_version_through_python_dash_m_and_the_console_script(tmp_path):
    result = run_module("--version", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"mixtral-infer {metadata.version('mixtral_infer')}\n"
    script = Path(sys.executable).parent / "mixtral-infer"
    if script.is_file():  # the console script installed beside this interpreter
        installed = subprocess.run([str(script), "-V"], cwd=tmp_path, capture_output=True, text=True, timeout=60)
        assert installed.stdout == result.stdout


def test_models_command_lists_the_shipped_models(tmp_path):
    assert sorted(shipped_models()) == ["tiny-mistral", "tiny-mixtral"]
    result = run_module("models", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("tiny-mistral: dim 128, 4 layers, dense, window 32")
    assert lines[1].startswith("tiny-mixtral (default): dim 128, 4 layers, 4 experts top-2, window 32")
    assert str(SHIPPED_MODELS / "tiny-mixtral") in lines[1]
    help_text = run_module("--help", cwd=tmp_path)
    assert "models" in help_text.stdout + help_text.stderr


def test_from_folder_takes_a_shipped_name_and_a_folder_on_disk_wins(tmp_path, monkeypatch):
    by_name = load_model("tiny-mistral", device="cpu")
    by_path = load_model(SHIPPED_MODELS / "tiny-mistral", device="cpu")
    assert by_name.args == by_path.args and by_name.args.moe is None
    for (name, a), b in zip(by_name.state_dict().items(), by_path.state_dict().values()):
        assert torch.equal(a, b), name
    assert Tokenizer.from_folder("tiny-mistral").path == SHIPPED_MODELS / "tiny-mistral" / "tokenizer.model"
    # A folder of the same name in the working directory is taken first.
    monkeypatch.chdir(tmp_path)
    import dataclasses

    from conftest import random_model

    local = dataclasses.replace(by_name.args, n_layers=1)
    save_consolidated(random_model(local), tmp_path / "tiny-mistral")
    assert resolve_model_folder("tiny-mistral") == Path("tiny-mistral")
    assert load_model("tiny-mistral", device="cpu").args.n_layers == 1
    with pytest.raises(CheckpointError, match="tiny-nothing: model folder not found"):
        load_model("tiny-nothing")


def test_demo_by_name_from_another_directory(tmp_path):
    result = run_module("demo", "tiny-mistral", "--max_tokens", "12", "--temperature", "0", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    model = load_model("tiny-mistral", max_batch_size=1, device="cpu")
    tokenizer = Tokenizer.from_folder("tiny-mistral")
    generated, _ = generate([tokenizer.encode("In the beginning")], model, max_tokens=12, eos_id=tokenizer.eos_id)
    assert result.stdout.splitlines()[0] == "In the beginning" + (" " if tokenizer.id_to_piece(generated[0][0]).startswith("\u2581") else "") + tokenizer.decode(generated[0])
    assert "loaded " + str(SHIPPED_MODELS / "tiny-mistral") in result.stderr


def test_readme_python_snippet_runs_from_another_directory(tmp_path):
    readme = (REPO / "README.md").read_text()
    blocks = [b.split("```", 1)[0] for b in readme.split("## Python API", 1)[1].split("```python\n")[1:]]
    assert "LLM(" in blocks[0]  # the high-level API first
    high = subprocess.run([sys.executable, "-c", blocks[0]], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert high.returncode == 0 and high.stdout.splitlines()[0].startswith("And God said"), high.stderr
    snippet = next(b for b in blocks if "load_model(folder" in b)
    snippet += "\nprint(repr(tokenizer.decode(generated[0])))\nprint(float(scores.sum()))\n"
    result = subprocess.run([sys.executable, "-c", snippet], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert len(result.stdout.splitlines()[0].split()) >= 5  # the printed completion
    assert float(result.stdout.splitlines()[-1]) < 0  # a sum of log-probabilities


def test_installed_wheel_runs_the_shipped_models_by_name_from_another_directory(tmp_path):
    """The newcomer path from an installed package: the wheel carries the models, and names find them."""
    import shutil

    source = tmp_path / "source"  # built from a copy, so no build/ folder is left in the repository
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copyfile(REPO / name, source / name)
    shutil.copytree(REPO / "mixtral_infer", source / "mixtral_infer", ignore=shutil.ignore_patterns("__pycache__"))
    wheel = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", str(source), "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path / "wheel")],
        capture_output=True, text=True, timeout=300,
    )
    assert wheel.returncode == 0, wheel.stderr
    site = tmp_path / "site"
    install = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(site), *map(str, (tmp_path / "wheel").glob("*.whl"))],
        capture_output=True, text=True, timeout=300,
    )
    assert install.returncode == 0, install.stderr
    env = {**__import__("os").environ, "PYTHONPATH": str(site)}
    work = tmp_path / "elsewhere"
    work.mkdir()
    check = "import mixtral_infer; print(mixtral_infer.__file__); print(mixtral_infer.__version__)"
    where = subprocess.run([sys.executable, "-c", check], cwd=work, env=env, capture_output=True, text=True, timeout=120)
    assert where.stdout.splitlines() == [str(site / "mixtral_infer" / "__init__.py"), metadata.version("mixtral_infer")]
    demo = subprocess.run(
        [sys.executable, "-m", "mixtral_infer", "demo", "tiny-mistral", "--max_tokens", "8"], cwd=work, env=env,
        capture_output=True, text=True, timeout=120,
    )
    assert demo.returncode == 0, demo.stderr
    assert f"loaded {site / 'mixtral_infer' / 'shipped' / 'tiny-mistral'}" in demo.stderr
    assert demo.stdout.startswith("In the beginning")
