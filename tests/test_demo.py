"""kvplan kv-demo: runs on CPU in seconds and reports sensible round-trip errors."""

import argparse

import torch

from kvplan import demo
from kvplan.formats import V41_FORMAT, V41_FP4_FORMAT, bf16_format


def test_round_trip_figures():
    cpu = torch.device("cpu")
    fp8 = demo.round_trip(V41_FORMAT, 96, 64, cpu)
    fp4 = demo.round_trip(V41_FP4_FORMAT, 96, 64, cpu)
    plain = demo.round_trip(bf16_format(512), 96, 64, cpu)
    assert fp8["bytes_per_token"] == 528 and abs(fp8["compression"] - 1024 / 528) < 1e-9
    assert plain["max_err"] == 0 and plain["compression"] == 1
    # randn inputs: FP8 keeps ~3 mantissa bits, FP4 ~1; errors are bounded by the group amax
    assert 0 < fp8["mean_err"] < 0.03 and fp8["max_err"] < 0.3
    assert fp8["mean_err"] < fp4["mean_err"] < 0.15 and fp4["max_err"] < 1.0
    assert fp8["store_gbps"] > 0 and fp8["load_gbps"] > 0


def test_cli_prints_one_row_per_format(capsys):
    parser = argparse.ArgumentParser()
    demo.add_arguments(parser)
    args = parser.parse_args(["--device", "cpu", "--num-tokens", "70", "--block-size", "16"])
    assert demo.run(args) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 3 + 6  # title, header, rule, one row per format
    assert lines[3].startswith("V4.1 main/SWA cache") and " 528 " in lines[3]
    assert lines[-1].startswith("BF16 x512") and " 0.0000 " in lines[-1]
