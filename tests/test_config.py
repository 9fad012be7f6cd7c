"""Sizes are parsed in one place, with errors that name the flag."""

from __future__ import annotations

import pytest

from lightmem.config import decimal_reading, format_bytes, parse_devices, parse_size


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (0, 0),
        (4096, 4096),
        ("512KiB", 512 * 1024),
        ("1MiB", 1024**2),
        ("2GB", 2 * 1000**3),
        ("1.5GiB", int(1.5 * 1024**3)),
        ("64 MiB", 64 * 1024**2),
        ("100", 100),
        ("3kb", 3000),
    ],
)
def test_sizes_parse_to_exact_bytes(value, expected):
    assert parse_size(value, flag="x") == expected


def test_fractions_are_taken_of_the_given_total():
    assert parse_size(0.25, flag="x", fraction_of=lambda: 1000) == 250
    assert parse_size("50%", flag="x", fraction_of=lambda: 1000) == 500


def test_fraction_without_a_total_is_an_error():
    with pytest.raises(ValueError, match=r"^budget: expected a byte count \(int\), or a string such as"):
        parse_size(0.5, flag="budget")


@pytest.mark.parametrize("value", ["12 parsecs", "", "GiB", True, None, [1], "150%", 1.5])
def test_bad_sizes_name_the_flag_and_the_accepted_forms(value):
    with pytest.raises(ValueError) as error:
        parse_size(value, flag="LightMem(host_budget=...)", fraction_of=lambda: 100)
    message = str(error.value)
    assert message.startswith("LightMem(host_budget=...): expected a byte count (int), or a string such as")
    assert "fraction of available RAM" in message
    assert message.endswith(f"got {value!r}")


@pytest.mark.parametrize(
    ("value", "reading"),
    [
        ("2 GB", "2 GB = 2,000,000,000 bytes (1.86 GiB)"),
        ("64mb", "64mb = 64,000,000 bytes (61.04 MiB)"),
        ("1.5T", "1.5T = 1,500,000,000,000 bytes (1.36 TiB)"),
        ("2GiB", None),
        ("100", None),
        (2_000_000_000, None),
        ("12 parsecs", None),
    ],
)
def test_a_size_in_decimal_units_is_read_back_in_bytes_and_binary_units(value, reading):
    assert decimal_reading(value) == reading


def test_format_bytes_is_binary_and_readable():
    assert format_bytes(512) == "512 B"
    assert format_bytes(1536) == "1.50 KiB"
    assert format_bytes(3 * 1024**3) == "3.00 GiB"


def test_devices_accept_a_single_name_and_reject_unknown_ones():
    assert parse_devices("cpu", flag="d") == ("cpu",)
    with pytest.raises(ValueError, match=r"^d: needs at least one device type"):
        parse_devices((), flag="d")
