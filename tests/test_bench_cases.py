"""benchmarks/cases.py needs no GPU: the benchmark's visible-pair and FLOP counts (its TFLOP/s)
against brute-force NumPy counts, its labels unique, and each case set's implementations (the
det set: cuflash against cuflash-det alone), by the module's own self-test."""
import importlib.util
import pathlib


def _cases():
    path = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "cases.py"
    spec = importlib.util.spec_from_file_location("bench_cases", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_bench_cases_self_test(capsys):
    assert _cases().self_test(), capsys.readouterr().out
