"""The one size parser: what each unit means, and that a fraction of a byte is refused."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vmm.units import UNITS_HELP, SizeError, parse_size


@pytest.mark.parametrize("text, nbytes", [
    ("16G", 16 * 10**9), ("16GB", 16 * 10**9), ("16 gb", 16 * 10**9),
    ("16GiB", 16 << 30), ("16Gi", 16 << 30), ("16gib", 16 << 30),
    ("512MiB", 512 << 20), ("512M", 512 * 10**6), ("2KiB", 2048), ("2K", 2000),
    ("1.5GiB", 3 << 29), ("1.1GB", 1_100_000_000), ("15.25GiB", 61 << 28),
    ("0.3MiB", 314572),  # with a unit: rounded down to whole bytes
    ("4096", 4096), ("4096B", 4096), ("2.0", 2),
])
def test_decimal_and_binary_units_are_distinct_and_exact(text, nbytes):
    assert parse_size(text) == nbytes


@pytest.mark.parametrize("text", ["1.5", "0.5", "1.5B", "4096.5"])
def test_a_fraction_of_a_byte_is_an_error_not_a_rounded_byte_count(text):
    with pytest.raises(SizeError) as err:
        parse_size(text, what="--budget")
    message = str(err.value)
    assert message.startswith("--budget: ") and "fraction of a byte" in message
    assert "2^30" in message and "10^9" in message  # it says what GiB and GB mean
    assert err.value.problem == message.removeprefix("--budget: ")


@pytest.mark.parametrize("text", ["sixteen", "16 GBs", "", "-5", "0", "0GiB", "1e9", "16 G B"])
def test_words_zero_and_negatives_name_what_was_parsed(text):
    with pytest.raises(SizeError, match="^budget: "):
        parse_size(text, what="budget")


def test_the_help_sentence_states_both_unit_families():
    assert "16G = 16GB = 16*10^9" in UNITS_HELP and "16GiB = 16*2^30" in UNITS_HELP


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet="0123456789.kKmMgGtTiIbB -e", max_size=12))
def test_any_text_is_a_positive_byte_count_or_a_size_error(text):
    try:
        n = parse_size(text)
    except SizeError as exc:
        assert exc.problem and "\n" not in str(exc)
        return
    assert isinstance(n, int) and n >= 1
