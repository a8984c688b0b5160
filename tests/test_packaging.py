"""The package as users get it: a wheel, installed in a fresh virtual environment, and the comparison command.

The wheel is built from this checkout and installed, without its dependencies, into a new venv that sees the
test environment's packages (torch, transformers, ...) through a path file, not its own copies: installing
them again from the registries took a minute of the suite, and the README's test command already resolves
the package's dependencies, extras included, from the registries on every CI run. The test environment's
editable install of zeroimpl stays invisible there (a path file adds a folder, not the path files in it).
From a folder outside the checkout, the venv's Python must import the public names from the installed
files, install no top-level package but ``zeroimpl``, keep the core free of transformers and the peers, and
run ``zeroimpl-compare --help``.
"""

import os
import subprocess
import sys
import sysconfig
import textwrap
import zipfile

import pytest
import torch

from zeroimpl.integrations.comparison import cli
from zeroimpl.integrations.comparison.harness import Workload
from zeroimpl.integrations.models import batch, build_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

IMPORTS_IN_FRESH_VENV = textwrap.dedent("""
    import os, sys, sysconfig
    import zeroimpl, zeroimpl.checkpoint
    core_pulled = sorted(m for m in sys.modules
                         if m.split(".")[0] in ("transformers", "deepspeed", "fairscale", "accelerate", "lightning",
                                                "trl", "peft")
                         or m.startswith("zeroimpl.integrations"))
    assert not core_pulled, f"the core imported {core_pulled}"
    from zeroimpl import ShardedOptimizer, CPUOffload, CollectiveError, DivergenceError, estimate_memory
    from zeroimpl.checkpoint import save_checkpoint, load_checkpoint
    from zeroimpl.integrations.trainer import ZeroTrainer
    from zeroimpl.integrations.accelerate import prepare
    from zeroimpl.integrations.lightning import ZeroStrategy
    from zeroimpl.integrations.comparison.cli import main
    site = sysconfig.get_paths()["purelib"]
    assert zeroimpl.__file__.startswith(site), zeroimpl.__file__
    top_level = sorted(n for n in os.listdir(site) if os.path.isdir(os.path.join(site, n)) and n.startswith(("zeroimpl", "integrations", "tests")))
    print("top-level:", top_level)
""")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out),
                    ROOT], check=True, capture_output=True, text=True)
    (path,) = [os.path.join(out, name) for name in os.listdir(out) if name.endswith(".whl")]
    return path


def test_wheel_ships_the_package_and_not_the_developer_files(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    top_level = {name.split("/")[0] for name in names if not name.startswith("zeroimpl-")}
    assert top_level == {"zeroimpl"}, top_level
    assert "zeroimpl/integrations/comparison/cli.py" in names
    assert not [name for name in names if name.startswith(("tests/", "benchmarks/", "examples/", "integrations/"))]


def test_wheel_installs_in_a_fresh_venv_and_its_command_runs(wheel, tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = str(venv / "bin" / "python")
    site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    with open(os.path.join(site, "test-environment.pth"), "w") as handle:  # the dependencies, not zeroimpl
        handle.write(sysconfig.get_paths()["purelib"] + "\n")
    install = subprocess.run([sys.executable, "-m", "pip", "--python", python, "install", "-q", "--no-deps", wheel],
                             capture_output=True, text=True)
    assert install.returncode == 0, install.stderr[-3000:]
    outside = tmp_path / "elsewhere"  # not the checkout: only the installed files can be imported
    outside.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    imported = subprocess.run([python, "-c", IMPORTS_IN_FRESH_VENV], cwd=outside, env=env, capture_output=True,
                              text=True)
    assert imported.returncode == 0, imported.stderr[-3000:]
    assert "top-level: ['zeroimpl', 'zeroimpl-0.1.0.dist-info']" in imported.stdout, imported.stdout
    helped = subprocess.run([str(venv / "bin" / "zeroimpl-compare"), "--help"], cwd=outside, env=env,
                            capture_output=True, text=True)
    assert helped.returncode == 0, helped.stderr[-3000:]
    assert "usage: zeroimpl-compare" in helped.stdout and "--model" in helped.stdout and "--only" in helped.stdout


def test_model_directory_is_loaded_with_its_config_and_weights(tmp_path):
    """``--model DIRECTORY``: the saved model's own weights and vocabulary, not a built-in family's."""
    saved = build_model("llama", "tiny")
    with torch.no_grad():
        for p in saved.parameters():
            p.add_(0.5)  # weights no seeded initialisation gives
    saved.save_pretrained(tmp_path / "my-model")
    directory = str(tmp_path / "my-model")
    assert cli.parser().parse_args(["--model", directory]).model == directory
    loaded = build_model(directory)
    assert type(loaded) is type(saved)
    assert all(torch.equal(a, b) for a, b in zip(saved.state_dict().values(), loaded.state_dict().values()))
    ids = Workload(directory, "base").micro_batches(rank=1, step=2)[0]["input_ids"]
    assert ids.max() < saved.config.vocab_size and ids.shape[1] == min(128, saved.config.max_position_embeddings)
    assert loaded(**batch(directory, "base", 0, 0, 0)).loss.isfinite()


def test_model_directory_with_a_config_alone_gets_seeded_weights(tmp_path):
    """``config.json`` without weights (a config written by hand, or ``config.save_pretrained``): the class
    the config names, seeded initial weights equal in every process, in eval mode (no dropout)."""
    build_model("gpt2", "tiny").config.save_pretrained(tmp_path / "config-only")
    first, second = build_model(str(tmp_path / "config-only")), build_model(str(tmp_path / "config-only"))
    assert type(first).__name__ == "GPT2LMHeadModel" and not first.training
    assert all(torch.equal(a, b) for a, b in zip(first.state_dict().values(), second.state_dict().values()))
    assert first(**batch(str(tmp_path / "config-only"), "base", 0, 0, 0)).loss.isfinite()


def test_bad_model_name_is_refused_with_the_fix(capsys):
    with pytest.raises(SystemExit):
        cli.parser().parse_args(["--model", "gpt3"])
    assert "neither one of gpt2, llama, bert, t5 nor a directory with a config.json" in capsys.readouterr().err


def test_command_compares_on_a_model_directory(tmp_path, capsys):
    """The command end to end on a user's saved model: DDP and zeroimpl stage 2 agree, files are written."""
    build_model("bert", "tiny").save_pretrained(tmp_path / "bert")
    out = tmp_path / "out"
    cli.main(["--model", str(tmp_path / "bert"), "--steps", "2", "--only", "zeroimpl stage 2", "--out", str(out)])
    table = (out / "comparison.md").read_text()
    assert sorted(os.listdir(out)) == ["comparison.csv", "comparison.json", "comparison.md", "comparison.png"]
    for name in ("DDP", "zeroimpl stage 2", "zeroimpl stage 2 + offload"):
        assert f"| {name} |" in table, table
    assert table.count("| within tolerance |") == 2, table
    assert f"Command: `zeroimpl-compare --model {tmp_path / 'bert'}" in table
