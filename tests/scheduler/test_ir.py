"""The IR: lifetimes, in-core peak, and JSON files that fail loudly and precisely."""

from __future__ import annotations

import json

import pytest

from scheduler import Cost, Kind, SequenceFormatError, Variable, VariableSequence, build_sequence


def _seq() -> VariableSequence:
    return build_sequence(
        [("a", [(0, "w")], Cost(flops=10)), ("b", [(0, "r"), (1, "w")], Cost()),
         ("c", [(1, "r"), (2, "r")], Cost(seconds=0.5))],
        [Variable(0, 10, Kind.ACTIVATION), Variable(1, 20, Kind.ACTIVATION),
         Variable(2, 5, Kind.PARAM, live_in=True, live_out=True)])


def test_live_bytes_follow_eager_lifetimes() -> None:
    seq = _seq()
    # f0: param + v0; f1: param + v0 + v1 (v0 dies after f1); f2: param + v1.
    assert seq.live_bytes == (15, 35, 25)
    assert seq.in_core_peak_bytes == 35
    assert seq.working_set_bytes(1) == 30


def test_json_round_trip(tmp_path) -> None:
    seq = _seq()
    path = tmp_path / "t.json"
    seq.to_json(path)
    assert VariableSequence.from_json(path) == seq


def test_what_the_program_held_past_its_last_use_is_apart_from_eager_lifetimes(tmp_path) -> None:
    """``held_to`` (a recorder saw the storage die later) leaves ``live_bytes`` as eager
    PyTorch has them and is its own figure, of the variables asked for; files keep it."""
    base = _seq()
    v0 = base.variables[0]
    held = VariableSequence(base.functions, {**base.variables, 0: Variable(v0.id, v0.nbytes, v0.kind, v0.name,
                                                                           held_to=2)}, {})
    assert held.live_bytes == base.live_bytes
    assert held.held_after_use_sized(lambda n: n) == (0, 0, 10)   # v0's last use is f1
    assert held.held_after_use_sized(lambda n: 2 * n) == (0, 0, 20)
    assert held.held_after_use_sized(lambda n: n, lambda var: var.kind is not v0.kind) == (0, 0, 0)
    path = tmp_path / "held.json"
    held.to_json(path)
    assert VariableSequence.from_json(path) == held and "held_to" not in json.dumps(base.to_dict())


@pytest.mark.parametrize(
    "mutate, words",
    [
        (lambda d: d.update(schema="other"), "not an ooc.sequence file"),
        (lambda d: d.update(version=99), "version 99 is not supported"),
        (lambda d: d["functions"][1]["uses"].append([42, "r"]), "functions[1] (b).uses[2]: unknown variable 42"),
        (lambda d: d["functions"][0]["uses"].__setitem__(0, [0, "x"]), "functions[0].uses[0]"),
        (lambda d: d["variables"][0].update(kind="weights"), "variables[0].kind"),
        (lambda d: d["variables"][1].pop("nbytes"), "variables[1]: missing field 'nbytes'"),
        (lambda d: d["functions"][0]["uses"].__setitem__(0, [0, "r"]), "read before anything writes it"),
        (lambda d: d["variables"][1].update(held_to="late"), "variables[1].held_to: expected a function index"),
    ],
)
def test_malformed_files_say_what_and_where(tmp_path, mutate, words) -> None:
    data = _seq().to_dict()
    mutate(data)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(SequenceFormatError) as err:
        VariableSequence.from_json(path)
    assert words in str(err.value)


def test_not_json_and_missing(tmp_path) -> None:
    bad = tmp_path / "x.json"
    bad.write_bytes(b"\x80\x00 not json")
    with pytest.raises(SequenceFormatError, match="not a JSON file"):
        VariableSequence.from_json(bad)
    with pytest.raises(SequenceFormatError, match="no such file"):
        VariableSequence.from_json(tmp_path / "missing.json")


def test_sizes_print_without_exponents_and_parse_both_unit_families() -> None:
    from scheduler import format_size, parse_size

    assert format_size(1010 << 20) == "1010 MiB"
    assert format_size(1536) == "1.5 KiB"
    assert format_size(3 << 30) == "3 GiB"
    assert parse_size("16GiB") == 16 << 30 and parse_size("16 GB") == 16 * 10**9
    for bad in ("sixteen", "0", "-5", "16 GBs", 0, -1, True):
        with pytest.raises(ValueError):
            parse_size(bad)
