"""The examples are part of the product: each runs to the end and prints what it promises."""
import os
import pathlib
import subprocess
import sys

import pytest

EXAMPLES = pathlib.Path(__file__).resolve().parent.parent / "examples"


def run_example(name):
    env = dict(os.environ)
    env["PYTHONPATH"] = str(EXAMPLES.parent) + os.pathsep + env.get("PYTHONPATH", "")
    done = subprocess.run([sys.executable, str(EXAMPLES / name)], capture_output=True, text=True,
                          timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def test_masks_and_alignment_reproduces_the_worked_example():
    out = run_example("masks_and_alignment.py")
    assert "0.830" in out and "1.170" in out


@pytest.mark.parametrize("name", ["quickstart.py", "train_tiny_attention.py"])
def test_example_runs(name):
    assert run_example(name).strip()
