"""The examples are part of the product: each runs to the end and prints what it promises, and
so do the Examples in the public docstrings."""
import doctest
import inspect
import os
import pathlib
import re
import subprocess
import sys

import numpy as np
import pytest

import cuflash
from cuflash import api

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


def test_readme_alibi_weights_are_the_examples_output():
    """The README's ALiBi weights picture is what masks_and_alignment.py prints from real calls
    (which the example checks against the float64 reference)."""
    readme = (EXAMPLES.parent / "README.md").read_text()
    block = readme.split("ALiBi leaves visibility alone", 1)[1].split("```\n", 2)[1]
    assert "causal=True" in block and "0.52" in block
    assert block in run_example("masks_and_alignment.py")


@pytest.mark.parametrize("name", ["quickstart.py", "train_tiny_attention.py", "ring_attention.py",
                                  "decode_loop.py"])
def test_example_runs(name):
    assert run_example(name).strip()


PUBLIC = [getattr(cuflash, name) for name in cuflash.__all__ if callable(getattr(cuflash, name))]


def test_api_docstring_examples():
    """Every Examples snippet in cuflash.api runs (on NumPy arrays) and prints what it shows."""
    tests = [t for t in doctest.DocTestFinder().find(api) if t.examples]
    assert {t.name.rsplit(".", 1)[-1] for t in tests} >= {f.__name__ for f in PUBLIC}
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    report = []
    # NumPy's default print options, whatever another test set
    with np.printoptions(precision=8, suppress=False, floatmode="maxprec", legacy=False):
        results = [runner.run(t, out=report.append) for t in tests]
    assert sum(r.attempted for r in results) > 0
    assert sum(r.failed for r in results) == 0, "".join(report)


@pytest.mark.parametrize("fn", PUBLIC, ids=lambda fn: fn.__name__)
def test_api_docstrings_are_numpydoc(fn):
    """Each public function documents every argument, its results, its errors, its rules."""
    doc = inspect.getdoc(fn)
    for section in ("Parameters", "Returns", "Raises", "Notes", "Examples"):
        assert re.search(rf"^{section}\n-+$", doc, re.M), f"{fn.__name__}: no {section} section"
    documented = set(re.findall(r"^(\w+) :", doc, re.M))
    missing = set(inspect.signature(fn).parameters) - documented
    assert not missing, f"{fn.__name__}: arguments without a Parameters entry: {sorted(missing)}"
