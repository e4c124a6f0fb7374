"""The split-KV decode schedule (cuflash/_decode.py), without a GPU: tools/decode_check.py's float64
emulation runs the kernels' algorithm from the Schedule tables alone (every item in launch order
writes its partial to its workspace slot, then the merge rule per row tile) and must reproduce the
dense reference: every visible key in exactly one item, empty items and empty rows handled, for
both kernels' layouts (decode_split's rows per block; decode_tc's 16 rows and 64-key stages) and
every split rule."""
import importlib.util
import pathlib
import zlib

import numpy as np
import pytest

from cuflash import _decode, reference
from cuflash._validate import make_problem

_spec = importlib.util.spec_from_file_location(
    "decode_check", pathlib.Path(__file__).resolve().parent.parent / "tools" / "decode_check.py")
decode_check = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(decode_check)

LAYOUTS = {"simt": dict(rows=None, block_keys=None), "tc": dict(rows=16, block_keys=64)}
SPLITS = [None, 64, 40, "balanced", "balanced-fine"]


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("split", SPLITS, ids=[str(s) for s in SPLITS])
@pytest.mark.parametrize("case", decode_check.CASES, ids=[c[0] for c in decode_check.CASES])
def test_schedule_reproduces_reference(case, split, layout):
    name, c = case
    rng = np.random.default_rng(zlib.crc32(f"{name} {split} {layout}".encode()))
    q, k, v, opts = decode_check.case_inputs(np, rng, dict(c, dtype="float64"))
    p = make_problem(q, k, v, **opts)
    rule = split if isinstance(split, str) else None
    out, lse, s = decode_check.emulate(p, split=None if rule else split, rule=rule,
                                       **LAYOUTS[layout])
    ref_out, ref_lse = reference.attention(q, k, v, return_lse=True, **opts)
    np.testing.assert_allclose(out, ref_out, rtol=0, atol=1e-10)
    assert np.array_equal(np.isinf(lse), np.isinf(ref_lse))
    finite = np.isfinite(ref_lse)
    np.testing.assert_allclose(lse[finite], ref_lse[finite], rtol=0, atol=1e-10)
    # the launch order is a permutation of the workspace slots
    assert sorted(s.launch.tolist()) == list(range(s.items.shape[0]))


def test_split_rules_fill_one_wave():
    """The bench shapes: one wave of resident blocks (264 = 132 SMs x 2), no more."""
    for ext in ([131072] * 8, [32768] * 64, [8192] * 256, [4096] * 512):
        for rule in _decode.SPLIT_RULES.values():
            S = rule(np.array(ext), 264, 64)
            assert S % 64 == 0
            assert sum(-(-e // S) for e in ext) <= max(264, len(ext))
