"""Hardware presets: the figures the GPU-scale claims rest on, and overrides that fail loudly."""

from __future__ import annotations

import pytest

from scheduler.hardware import PRESETS, Hardware, HardwareError, hardware
from vmm.errors import OOCError

GiB = 1 << 30


def test_required_presets_exist() -> None:
    for name in ("v100-16gb-nvlink", "a100-40gb-pcie4", "h100-80gb-pcie5", "cpu-edge"):
        hw = hardware(name)
        assert isinstance(hw, Hardware) and hw.name == name and hw.description


def test_paper_machine_figures() -> None:
    hw = hardware("v100-16gb-nvlink")
    assert hw.device_bytes == 16 * GiB
    assert hw.peak_flops == 15.7e12  # FP32, the paper trains ResNet-50 in FP32
    assert hw.mem_bandwidth == 900e9
    assert hw.h2d_bandwidth == hw.d2h_bandwidth == 50e9  # NVLink, each direction
    assert hw.full_duplex and hw.tier == "host"


def test_link_speeds_rank_as_the_hardware_does() -> None:
    assert hardware("a100-40gb-pcie4").h2d_bandwidth == 25e9
    assert hardware("h100-80gb-pcie5").h2d_bandwidth == 50e9
    assert hardware("h100-80gb-pcie5").device_bytes == 80 * GiB
    edge = hardware("cpu-edge")
    assert edge.tier == "storage" and not edge.full_duplex
    assert edge.h2d_bandwidth < hardware("a100-40gb-pcie4").h2d_bandwidth
    assert 1 * GiB <= edge.device_bytes <= 16 * GiB


def test_unknown_preset_lists_the_presets() -> None:
    with pytest.raises(HardwareError) as err:
        hardware("tpu-v9")
    for name in PRESETS:
        assert name in str(err.value)
    assert isinstance(err.value, OOCError) and isinstance(err.value, ValueError)


def test_overrides_by_keyword() -> None:
    hw = hardware("v100-16gb-nvlink", device_bytes="15GiB", h2d_bandwidth=12e9)
    assert hw.device_bytes == 15 * GiB and hw.h2d_bandwidth == 12e9
    assert hw.d2h_bandwidth == 50e9  # untouched
    assert hardware("v100-16gb-nvlink").device_bytes == 16 * GiB  # presets are not mutated
    assert hardware(hw) is hw  # a Hardware passes through


def test_storage_bandwidth_sets_both_directions_of_a_storage_tier() -> None:
    hw = hardware("cpu-edge", storage_bandwidth=250e6)
    assert hw.h2d_bandwidth == hw.d2h_bandwidth == 250e6
    hw = hardware("cpu-edge", storage_bandwidth=250e6, d2h_bandwidth=100e6)
    assert (hw.h2d_bandwidth, hw.d2h_bandwidth) == (250e6, 100e6)
    with pytest.raises(HardwareError, match="not storage"):
        hardware("a100-40gb-pcie4", storage_bandwidth=1e9)


@pytest.mark.parametrize("kw, words", [
    ({"hbm_bytes": 1}, "unknown field(s) hbm_bytes"),
    ({"h2d_bandwidth": 0}, "h2d_bandwidth must be a positive number"),
    ({"peak_flops": -1.0}, "peak_flops must be a positive number"),
    ({"link_latency_s": -1e-6}, "link_latency_s must be >= 0"),
    ({"tier": "tape"}, "tier must be"),
])
def test_bad_overrides_say_what(kw, words) -> None:
    with pytest.raises(HardwareError) as err:
        hardware("v100-16gb-nvlink", **kw)
    assert words in str(err.value)


def test_transfer_time_is_latency_plus_bytes_over_bandwidth() -> None:
    hw = hardware("v100-16gb-nvlink")
    assert hw.transfer_s(50_000_000_000, to_device=True) == pytest.approx(1.0 + 10e-6)
    assert hw.transfer_s(0, to_device=False) == pytest.approx(10e-6)
    slow_out = hardware("cpu-edge", h2d_bandwidth=2e9, d2h_bandwidth=1e9)
    assert slow_out.transfer_s(1e9, to_device=False) > slow_out.transfer_s(1e9, to_device=True)


def test_to_dict_is_plain_data() -> None:
    import json

    d = hardware("h100-80gb-pcie5").to_dict()
    assert json.loads(json.dumps(d)) == d
    assert d["name"] == "h100-80gb-pcie5" and d["device_bytes"] == 80 * GiB
