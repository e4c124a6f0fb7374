"""cuflash._kernels.device_info: the one place the kernel choices read device properties from
(compute capability for the forward tiles, opt-in shared memory for the tensor-core paths, SM count
for the decode split). Checked without a GPU against a stand-in for CuPy's device queries."""
import pytest

cupy = pytest.importorskip("cupy")

from cuflash import _kernels  # noqa: E402


class _FakeDevice:
    current = 0
    props = {0: ("80", 166912, 108), 1: ("90", 232448, 132)}

    def __init__(self, i=None):
        self.id = _FakeDevice.current if i is None else i
        cc, smem, _ = self.props[self.id]
        self.compute_capability = cc
        self.attributes = {"MaxSharedMemoryPerBlockOptin": smem}


def test_device_info_reads_and_caches_per_device(monkeypatch):
    calls = []

    def props(i):
        calls.append(i)
        return {"multiProcessorCount": _FakeDevice.props[i][2]}

    monkeypatch.setattr(cupy.cuda, "Device", _FakeDevice)
    monkeypatch.setattr(cupy.cuda.runtime, "getDeviceProperties", props)
    monkeypatch.setattr(_kernels, "_device_infos", {})
    _FakeDevice.current = 1
    assert _kernels.device_info() == (90, 232448, 132)
    assert _kernels.device_info(0) == (80, 166912, 108)
    assert _kernels.device_info(1) is _kernels.device_info()   # cached, not queried again
    assert calls == [1, 0]
    assert isinstance(_kernels.device_info().cc, int)
