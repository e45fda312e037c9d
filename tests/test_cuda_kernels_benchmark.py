"""``benchmarks/cuda_kernels.py``'s command line, on the CPU: the decode points and variants it
takes, and the errors that name what is wrong."""

import argparse

import pytest

from benchmark_modules import benchmark_module

cuda_kernels = benchmark_module("cuda_kernels")


def test_points_parse_as_sequences_by_context():
    assert cuda_kernels.parse_points("256x128, 64x4096") == [(256, 128), (64, 4096)]


@pytest.mark.parametrize("text", ["256", "0x128", "256x0", "ax1", "12x", "256x128,"])
def test_a_malformed_point_is_named(text):
    bad = text.split(",")[-1].strip()
    with pytest.raises(argparse.ArgumentTypeError, match=f"'{bad}' is not a decode point"):
        cuda_kernels.parse_points(text)


def test_variants_without_a_sweep_are_refused(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cuda_kernels.main(["--variants", "w4_l8_p1024_pv_tc"])
    assert exit_info.value.code == 2
    assert "--variants selects among the variants of --sweep" in capsys.readouterr().err
