"""Size and percentage strings: known answers and rejection of bad input with UsageError."""

from __future__ import annotations

import pytest

from vramguard.errors import UsageError
from vramguard.units import format_bytes, parse_percent, parse_size

KiB, MiB, GiB, TiB = 2**10, 2**20, 2**30, 2**40


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (4096, 4096),  # a Python number is bytes; a string needs its unit
        ("0 B", 0),
        ("24G", 24 * GiB),  # the short forms are binary, as ls -h and free -h write them
        ("24 GiB", 24 * GiB),
        ("24GB", 24 * 10**9),  # SI, as GPU vendors write a card's memory
        ("512k", 512 * KiB),
        ("1.5m", 3 * MiB // 2),
        ("2T", 2 * TiB),
        (0, 0),
        (2.6, 3),  # numbers round like strings do ("2.6 B" -> 3), they are not truncated
        ("2.6 B", 3),
        ("17 B", 17),
        ("17b", 17),
        ("512 KiB", 512 * KiB),
        ("12 MiB", 12 * MiB),
        ("12mib", 12 * MiB),
        ("1.5 GiB", 3 * GiB // 2),
        ("2 TiB", 2 * TiB),
        ("1kb", 1000),
        ("1.5GB", 1_500_000_000),
        ("3 MB", 3_000_000),
        ("1 TB", 10**12),
        (".5 KiB", KiB // 2),
        ("  7  MiB  ", 7 * MiB),
        ("+2 KiB", 2 * KiB),
    ],
)
def test_parse_size_known_answers(text: str | int | float, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize(
    "text",
    [
        "",
        "abc",
        "12 XB",
        "12 MiBs",
        "1.2.3 MiB",
        "5%",
        "MiB",
        "- 3 MiB",
        "-3 MiB",
        "-1",
        "0",
        "24",  # no unit: --fit 24 had meant 24 bytes
        " 4096 ",
        "1.5",
        -1,
        -0.5,
        True,
        False,
        float("nan"),
        float("inf"),
        "nan",
        "inf",
        "1" + "0" * 400 + " GiB",  # past a float: was an OverflowError (fuzzing --fit and --cache-max)
    ],
)
def test_parse_size_rejects_bad_input(text: object) -> None:
    with pytest.raises(UsageError):
        parse_size(text)  # type: ignore[arg-type]


def test_parse_size_messages_are_clear() -> None:
    with pytest.raises(UsageError, match=r"'24' has no unit: say e\.g\. '24GiB' \(binary, 2\^30\) or '24GB' \(SI"):
        parse_size("24")
    with pytest.raises(UsageError, match=r"not a size: '12 XB' \(use e\.g\."):
        parse_size("12 XB")
    with pytest.raises(UsageError, match="cannot be negative"):
        parse_size("-3 MiB")


@pytest.mark.parametrize(
    ("n", "signed", "expected"),
    [
        (0, False, "0 B"),
        (0, True, "0 B"),
        (1, False, "1 B"),
        (1023, False, "1023 B"),
        (KiB, False, "1.00 KiB"),
        (1536, False, "1.50 KiB"),
        (3 * MiB, False, "3.00 MiB"),
        (5 * GiB + GiB // 4, False, "5.25 GiB"),
        (7 * TiB, False, "7.00 TiB"),
        (1024 * TiB, False, "1024.00 TiB"),  # TiB is the largest unit
        (-2 * KiB, False, "-2.00 KiB"),
        (-2 * KiB, True, "-2.00 KiB"),
        (2 * KiB, True, "+2.00 KiB"),
        (-5, False, "-5 B"),
    ],
)
def test_format_bytes_known_answers(n: int, signed: bool, expected: str) -> None:
    assert format_bytes(n, signed=signed) == expected


@pytest.mark.parametrize("n", [0, 7, KiB, 3 * KiB // 2, 12 * MiB, 5 * GiB, 3 * TiB])
def test_format_then_parse_round_trips_on_exact_sizes(n: int) -> None:
    assert parse_size(format_bytes(n)) == n


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("3%", 0.03),
        (" 3 % ", 0.03),
        ("0.5%", 0.005),
        ("100%", 1.0),
        ("0%", 0.0),
        ("0.03", 0.03),
        (0.25, 0.25),
        (0, 0.0),
        ("250%", 2.5),
    ],
)
def test_parse_percent_known_answers(text: str | float, expected: float) -> None:
    assert parse_percent(text) == pytest.approx(expected, rel=1e-12, abs=0)


@pytest.mark.parametrize("text", ["", "%", "abc", "3%%", "three%", "-3%", "-0.1", "nan", "inf%", "1e999"])
def test_parse_percent_rejects_bad_input(text: str) -> None:
    with pytest.raises(UsageError, match="percentage"):
        parse_percent(text)
