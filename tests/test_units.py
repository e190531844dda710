"""``memfit.parse_bytes``: units, the bare-number rule (units Note 1), and refusals with the fix."""

import pytest

from memfit.units import GiB, MiB, format_bytes, parse_bytes


@pytest.mark.parametrize("text,expected", [
    ("11GiB", 11 * 2**30), ("10.5 GB", 10_500_000_000), ("512MiB", 512 * 2**20),
    ("1kB", 1000), ("2 KiB", 2048), ("1TiB", 2**40), ("11B", 11), ("11 bytes", 11),
    ("0B", 0), ("2000000", 2_000_000), (" 1.5gib ", int(1.5 * 2**30)),
])
def test_units_are_powers_of_ten_or_two(text, expected):
    assert parse_bytes(text) == expected


def test_an_int_is_bytes_by_definition():
    assert parse_bytes(11) == 11 and parse_bytes(0) == 0


def test_zero_is_zero_in_any_unit():
    assert parse_bytes("0") == parse_bytes("0GiB") == parse_bytes(0.0) == 0


@pytest.mark.parametrize("value", ["11", "1", "1048575", 11.0, 0.5])
def test_a_bare_number_under_one_mib_is_refused_with_the_units(value):
    with pytest.raises(ValueError) as e:
        parse_bytes(value)
    msg = str(e.value)
    assert "no unit" in msg and "GiB = 2^30" in msg and "GB = 10^9" in msg and "B'" in msg


def test_a_bare_number_of_at_least_one_mib_is_bytes():
    assert parse_bytes(str(MiB)) == MiB and parse_bytes(float(GiB)) == GiB


@pytest.mark.parametrize("value", [-3, "-3GiB", "-1", -1.0, float("nan"), float("inf"), "1e999GB"])
def test_negative_or_not_finite_is_refused(value):
    with pytest.raises(ValueError, match="negative|finite"):
        parse_bytes(value)


@pytest.mark.parametrize("value", ["ten gigs", "11 GiBs", True, None, [1]])
def test_unreadable_is_refused_with_an_example(value):
    with pytest.raises(ValueError, match="11GiB"):
        parse_bytes(value)


def test_format_bytes():
    assert format_bytes(11 * GiB) == "11.00 GiB" and format_bytes(512) == "512 B"
