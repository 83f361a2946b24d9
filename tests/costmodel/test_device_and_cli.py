"""Devices, the measured-constants fit, `import kvpage.costmodel` staying light, and `kvpage plan`."""
import math
import re
import subprocess
import sys

import pytest

from kvpage import cli
from kvpage.costmodel import DEVICE_PRESETS, Device, fit_bandwidth, fit_linear, get_device, measure_this_machine


def test_fit_recovers_a_line_and_clamps_what_noise_makes_impossible():
    fit = fit_linear([0, 1e6, 2e6, 4e6], [1e-5, 1e-5 + 1e-3, 1e-5 + 2e-3, 1e-5 + 4e-3])
    assert fit.intercept_s == pytest.approx(1e-5)
    assert fit.bandwidth == pytest.approx(1e9)
    assert fit(3e6) == pytest.approx(1e-5 + 3e-3)
    through_origin = fit_linear([1, 2], [0.9, 2.1])  # the raw intercept is negative
    assert through_origin.intercept_s == 0.0 and through_origin.bandwidth > 0
    flat = fit_linear([1, 2, 3], [5.0, 4.0, 3.0])  # time falling with size: all overhead
    assert flat.intercept_s == pytest.approx(4.0) and math.isinf(flat.bandwidth)
    with pytest.raises(ValueError):
        fit_linear([1], [1])


def test_bandwidth_fit_on_a_separately_measured_overhead():
    fit = fit_bandwidth([1e6, 2e6], [5e-5 + 1e-3, 5e-5 + 2e-3], intercept_s=5e-5)
    assert (fit.intercept_s, fit.bandwidth) == (5e-5, pytest.approx(1e9))
    assert math.isinf(fit_bandwidth([1e6], [1e-5], intercept_s=1e-4).bandwidth)  # all noise: no size term


def test_the_h100_link_is_50_to_60_times_slower_than_its_memory():
    assert 50 <= get_device("h100").link_to_memory_ratio <= 60  # the seed's figure for PCIe
    assert set(DEVICE_PRESETS) == {"h100", "h200", "a100"}
    with pytest.raises(ValueError, match="device must be one of"):
        get_device("tpu")
    with pytest.raises(ValueError, match="flops_efficiency"):
        Device("x", "x", 1, 1, 1, 1, 0, flops_efficiency=0)


def test_this_machine_is_measured_positive_and_finite():
    this = measure_this_machine()
    for value in (this.memory_bandwidth, this.peak_flops, this.link_bandwidth, this.memory_bytes):
        assert 0 < value < math.inf
    assert this.transfer_overhead_s >= 0 and this.flops_efficiency == 1.0
    assert get_device("this") is this  # measured once per process


def test_importing_the_cost_model_does_not_import_torch():
    code = "import sys, kvpage.costmodel; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_plan_prints_the_seeds_numbers(capsys):
    assert cli.main(["plan", "--model", "llama-3-8b", "--device", "h100", "--context", "8192"]) == 0
    out = capsys.readouterr().out
    for expected in ("131072 B (128 KiB)", "2048 B (2 KiB)", "none: swap is cheaper at every length",
                     "6.89 at every length", "50 requests sharing a 2000-token system prompt", "n=8", "beam 4"):
        assert expected in out, expected
    assert re.search(r"blocks per sequence at 8192 tokens\s+512\n", out)
    assert re.search(r"whole blocks of 16:\s+4 tokens", out)


def test_plan_takes_other_models_devices_and_sizes(capsys):
    assert cli.main(["plan", "--model", "smollm2-135m", "--device", "a100", "--context", "4096", "--block-size",
                     "32", "--dtype", "fp32"]) == 0
    out = capsys.readouterr().out
    assert "46080 B" in out and re.search(r"blocks per sequence at 4096 tokens\s+128\n", out)


def test_plan_bad_model_is_an_error_not_a_crash(capsys):
    assert cli.main(["plan", "--model", "no-such-model"]) == 2
    assert "model must be one of" in capsys.readouterr().err
