"""Workload strings and size lists: the one parser every plan and record goes through."""

import pytest
from locks_toolkit.harness.workload import Workload, format_size, parse_size, parse_size_list
from locks_toolkit.kernels.config import ConfigError


@pytest.mark.parametrize("text,tokens", [("16k", 16384), ("128K", 131072), ("1m", 1048576), ("4000", 4000),
                                         (" 32k ", 32768), (7, 7)])
def test_parse_size(text, tokens):
    assert parse_size(text) == tokens


@pytest.mark.parametrize("text", ["", "k", "16kb", "-4", "0", "1.5k", "16 k"])
def test_parse_size_rejects(text):
    with pytest.raises(ConfigError, match="size"):
        parse_size(text)


@pytest.mark.parametrize("tokens", [1, 1000, 1024, 16384, 131072, 1048576, 3 * 1048576, 1536])
def test_format_size_round_trips(tokens):
    assert parse_size(format_size(tokens)) == tokens


@pytest.mark.parametrize("text,expected", [
    ("1q1s32k", Workload(1, 1, 32768)),
    ("q1s32k", Workload(1, 1, 32768)),
    ("32q1s128k", Workload(32, 1, 131072)),
    ("8q4s1m", Workload(8, 4, 1048576)),
    ("3q1s1000", Workload(3, 1, 1000)),
])
def test_parse_workload(text, expected):
    parsed = Workload.parse(text)
    assert parsed == expected
    assert Workload.parse(parsed.name) == parsed


@pytest.mark.parametrize("text", ["1s32k", "q1", "2q2k_32q1s1k", "0q1s1k", "xq1s1k"])
def test_parse_workload_rejects(text):
    with pytest.raises(ConfigError):
        Workload.parse(text)


def test_size_list_keeps_order_and_rejects_repeats():
    assert parse_size_list("32k, 16k,128k") == (32768, 16384, 131072)
    with pytest.raises(ConfigError, match="repeats"):
        parse_size_list("16k,16384")
    with pytest.raises(ConfigError, match="empty"):
        parse_size_list(" , ")
