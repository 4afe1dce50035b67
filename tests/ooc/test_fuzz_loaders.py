"""Issue 7, bad input: the loaders of user files fail with their one documented error, always.

Loaders: ``VariableSequence.from_json`` (traces) and ``Schedule.from_json`` (plans) may raise
only :class:`~scheduler.errors.SequenceFormatError`; ``ooc.frag.inputs.load`` (memory snapshots,
trace/plan JSON, CSV) only :class:`~ooc.frag.inputs.FragInputError` or another ``OOCError``
subclass (:class:`~ooc.frag.safe_pickle.UnsafePickleError` for a pickle asking for code).
Anything else (a ``KeyError``, a ``TypeError`` deep in a loader, a hang) is a bug.

Inputs are derived from valid files: byte mutations (flips, truncation, insertion,
deletion, splices), structural mutations of the parsed JSON or snapshot (a value replaced by
one of another type, a key dropped, a list emptied or repeated, numbers made huge, negative,
fractional or boolean), the wrong schema or version, hostile pickles, and random bytes and
random JSON. A seeded loop makes 10,000+ inputs (the same ones on every run); hypothesis adds
its own on top. Each input is tiny, so the whole file runs in seconds.
"""

from __future__ import annotations

import copy
import io
import json
import os
import pickle
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import scheduler
from ooc.frag.inputs import FragInputError
from ooc.frag.inputs import load as frag_load
from scheduler.errors import SequenceFormatError
from scheduler.ir import Cost, Variable, VariableSequence, build_sequence
from scheduler.ir import Kind
from scheduler.schedule import Schedule
from vmm.errors import OOCError

SEED = 7
ROUNDS = {"sequence": 3000, "schedule": 3000, "snapshot": 2500, "frag-json": 800, "csv": 800}


# -- valid files to start from ----------------------------------------------------------------


def _valid_sequence() -> VariableSequence:
    kinds = [Kind.PARAM, Kind.ACTIVATION, Kind.ACTIVATION, Kind.GRAD, Kind.OPTIMIZER_STATE]
    variables = [Variable(0, 4096, Kind.PARAM, "w", live_in=True, live_out=True)]
    variables += [Variable(i, 4096 * (i % 3 + 1), kinds[i % 5], f"v{i}") for i in range(1, 6)]
    functions = [("fwd0", [(0, "r"), (1, "w")], Cost(flops=10, seconds=1e-3)),
                 ("fwd1", [(1, "r"), (2, "w")], Cost(flops=10, bytes=100)),
                 ("bwd1", [(2, "r"), (1, "r"), (3, "w")], Cost(seconds=2e-3)),
                 ("bwd0", [(3, "r"), (0, "r"), (4, "w")], Cost()),
                 ("opt", [(4, "r"), (0, "w"), (5, "w")], Cost())]
    return build_sequence(functions, variables, {"model": "fuzz"})


SEQ = _valid_sequence()
PLAN = scheduler.plan(SEQ, budget=3 * 4096 * 3, window=4096, policy="window")
SEQ_DOC = SEQ.to_dict()
PLAN_DOC = PLAN.to_dict()
SNAPSHOT = {
    "segments": [{"device": 0, "address": 0x7000, "total_size": 1 << 20, "stream": 0,
                  "segment_type": "large", "allocated_size": 4096, "active_size": 4096,
                  "requested_size": 4000,
                  "blocks": [{"address": 0x7000, "size": 4096, "requested_size": 4000,
                              "state": "active_allocated", "frames": []},
                             {"address": 0x8000, "size": (1 << 20) - 4096, "requested_size": 0,
                              "state": "inactive", "frames": []}]}],
    "device_traces": [[
        {"action": "segment_alloc", "addr": 0x7000, "size": 1 << 20, "stream": 0, "time_us": 1},
        {"action": "alloc", "addr": 0x7000, "size": 4000, "stream": 0, "time_us": 2},
        {"action": "alloc", "addr": 0x9000, "size": 8000, "stream": 0, "time_us": 3},
        {"action": "free_requested", "addr": 0x9000, "size": 8000, "stream": 0, "time_us": 4},
        {"action": "free_completed", "addr": 0x9000, "size": 8000, "stream": 0, "time_us": 5},
        {"action": "oom", "size": 1 << 30, "device_free": 1 << 20, "stream": 0, "time_us": 6},
    ]],
    "allocator_settings": {"max_split_size": -1},
}
CSV = b"time,action,address,bytes\n0,alloc,0x1000,4096\n1,alloc,0x3000,100\n2,free,0x1000,4096\n"


def test_the_seed_files_are_valid(tmp_path):
    p = tmp_path / "s.json"
    p.write_text(json.dumps(SEQ_DOC))
    assert VariableSequence.from_json(p).to_dict() == SEQ_DOC
    p.write_text(json.dumps(PLAN_DOC))
    assert Schedule.from_json(p).to_dict() == PLAN_DOC
    for name, data in [("a.pickle", pickle.dumps(SNAPSHOT)), ("a.csv", CSV), ("p.json", p.read_bytes())]:
        q = tmp_path / name
        q.write_bytes(data)
        assert frag_load(q).events


# -- mutations -------------------------------------------------------------------------------


_WEIRD = [None, True, False, 0, -1, 1 << 70, -(1 << 70), 0.5, -0.0, 1e308, float("nan"), float("inf"),
          "", "x", "r", "w", "\x00", "é" * 3, [], [None], [[1, "r"]], [1, 2, 3], {}, {"a": 1},
          {"schema": "ooc.sequence"}]


def _mutate_obj(obj, rng: random.Random, depth: int = 0):
    """One random structural change somewhere in a JSON-like object (returns the new object)."""
    if isinstance(obj, dict) and obj and rng.random() < 0.8:
        key = rng.choice(list(obj))
        out = dict(obj)
        r = rng.random()
        if r < 0.15:
            del out[key]
        elif r < 0.25:
            out[rng.choice(["extra", "", key + "_", "0"])] = rng.choice(_WEIRD)
        elif r < 0.5 and depth < 6:
            out[key] = _mutate_obj(obj[key], rng, depth + 1)
        else:
            out[key] = rng.choice(_WEIRD) if rng.random() < 0.7 else _random_json(rng, 2)
        return out
    if isinstance(obj, list) and obj and rng.random() < 0.8:
        out = list(obj)
        i = rng.randrange(len(out))
        r = rng.random()
        if r < 0.15:
            del out[i]
        elif r < 0.25:
            out.insert(i, copy.deepcopy(out[rng.randrange(len(out))]))
        elif r < 0.3:
            out = []
        elif r < 0.6 and depth < 6:
            out[i] = _mutate_obj(out[i], rng, depth + 1)
        else:
            out[i] = rng.choice(_WEIRD)
        return out
    if isinstance(obj, bool):
        return rng.choice([not obj, 1, "true", None])
    if isinstance(obj, int):
        return rng.choice([-obj, obj + 1, obj - 1, -1, 0, 1 << 63, 1 << 100, float(obj) + 0.5, str(obj), True])
    if isinstance(obj, float):
        return rng.choice([-obj, float("nan"), float("inf"), 1, str(obj), 1e300])
    if isinstance(obj, str):
        return rng.choice(["", obj + "x", obj[:-1], obj.upper(), 7, None, "\x00"])
    return rng.choice(_WEIRD)


def _random_json(rng: random.Random, depth: int):
    r = rng.random()
    if depth <= 0 or r < 0.4:
        return rng.choice(_WEIRD)
    if r < 0.7:
        return [_random_json(rng, depth - 1) for _ in range(rng.randrange(4))]
    return {rng.choice(["schema", "version", "variables", "functions", "id", "nbytes", "kind", "uses",
                        "before", "after", "sequence", "budget", rng.choice("abc")]): _random_json(rng, depth - 1)
            for _ in range(rng.randrange(5))}


def _mutate_bytes(data: bytes, rng: random.Random) -> bytes:
    b = bytearray(data)
    for _ in range(rng.choice([1, 1, 2, 3, 8])):
        r = rng.random()
        if not b:
            b = bytearray(rng.randbytes(rng.randrange(1, 64)))
        elif r < 0.3:
            b[rng.randrange(len(b))] = rng.randrange(256)
        elif r < 0.5:
            del b[rng.randrange(len(b)):]          # truncated
        elif r < 0.65:
            i = rng.randrange(len(b))
            b[i:i] = rng.randbytes(rng.randrange(1, 16))
        elif r < 0.8:
            i = rng.randrange(len(b))
            del b[i:i + rng.randrange(1, 32)]
        elif r < 0.9:
            i, j = sorted(rng.randrange(len(b)) for _ in range(2))
            b[i:i] = b[i:j][:64]                    # splice a piece again
        else:
            b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
    return bytes(b)


def _dumps(obj, rng: random.Random) -> bytes:
    return json.dumps(obj, allow_nan=True).encode() if rng.random() < 0.9 else \
        json.dumps(obj, indent=1, ensure_ascii=False, allow_nan=True).encode("utf-8", "surrogatepass")


# -- hostile pickles ----------------------------------------------------------------------------


def _hostile_pickles() -> list[bytes]:
    """Pickles that would run code, import modules or read persistent ids if loaded with pickle."""
    class Evil:
        def __reduce__(self):
            return (os.system, ("touch /tmp/ooc-fuzz-pwned",))

    class Pid(pickle.Pickler):
        def persistent_id(self, obj):
            return "storage" if isinstance(obj, str) and obj == "tensor" else None

    buf = io.BytesIO()
    Pid(buf).dump({"segments": [], "device_traces": [["tensor"]]})
    return [
        pickle.dumps({"segments": [], "device_traces": [[Evil()]]}, protocol=p) for p in range(0, 6)
    ] + [
        buf.getvalue(),
        b"cos\nsystem\n(S'true'\ntR.",                          # protocol 0 GLOBAL + REDUCE
        b"\x80\x04\x95\x1d\x00\x00\x00\x00\x00\x00\x00\x8c\x08builtins\x94\x8c\x04eval\x94\x93\x94.",
        b"\x80\x02cbuiltins\n__import__\nq\x00X\x02\x00\x00\x00osq\x01\x85q\x02Rq\x03.",
        b"\x80\x02cstruct\npack\nq\x00.",                         # a module's function
        pickle.dumps({"segments": [], "device_traces": [[]], "x": copy.deepcopy}),
    ]


# -- running one input --------------------------------------------------------------------------


def _expect(loader, path, allowed) -> str:
    """Run ``loader(path)``; return "ok" or the error type's name; fail on anything else."""
    try:
        loader(path)
    except allowed as e:
        msg = str(e).strip()
        assert msg and "\n" not in msg and len(msg) < 2000, f"not one clear line: {msg!r}"
        return type(e).__name__
    except BaseException as e:  # noqa: BLE001 - the point of the test
        raise AssertionError(f"{loader.__qualname__}({path.name}) raised {type(e).__name__}: {e}\n"
                             f"input: {path.read_bytes()[:400]!r}") from e
    return "ok"


def _cases(rng: random.Random, kind: str):
    """Yield (file name, bytes) inputs of one kind."""
    for k in range(ROUNDS[kind]):
        r = rng.random()
        if kind in ("sequence", "schedule", "frag-json"):
            doc = SEQ_DOC if kind == "sequence" or (kind == "frag-json" and k % 2) else PLAN_DOC
            if r < 0.55:
                obj = doc
                for _ in range(rng.choice([1, 1, 1, 2, 4])):
                    obj = _mutate_obj(obj, rng)
                data = _dumps(obj, rng)
            elif r < 0.8:
                data = _mutate_bytes(json.dumps(doc).encode(), rng)
            elif r < 0.9:
                data = _dumps(_random_json(rng, 4), rng)
            elif r < 0.95:
                other = dict(doc, version=rng.choice([0, 2, "1", None, 1.0 + 1e-9]))
                data = _dumps(other, rng) if rng.random() < 0.5 else _dumps(dict(doc, schema="ooc.other"), rng)
            else:
                data = rng.randbytes(rng.randrange(0, 200))
            yield ("t.json", data)
        elif kind == "snapshot":
            if r < 0.5:
                obj = SNAPSHOT
                for _ in range(rng.choice([1, 1, 2, 3])):
                    obj = _mutate_obj(obj, rng)
                data = pickle.dumps(obj, protocol=rng.randrange(0, 6))
            elif r < 0.9:
                data = _mutate_bytes(pickle.dumps(SNAPSHOT, protocol=rng.randrange(2, 6)), rng)
            else:
                data = b"\x80" + rng.randbytes(rng.randrange(0, 200))
            yield ("s.pickle", data)
        else:
            if r < 0.6:
                data = _mutate_bytes(CSV, rng)
            elif r < 0.8:
                lines = CSV.split(b"\n")
                i = rng.randrange(len(lines))
                lines[i] = rng.choice([b"", b"1,alloc", b"x,alloc,0x1,1", b"1,free,0x99,4", b"1,alloc,0x1,-5",
                                       b"1,alloc,zz,1", b"1,resize,0x1,1", b'"1,alloc', b"1,alloc,0x1,1e400",
                                       b"nan,alloc,0x5,1", b"1,alloc,0x1000,4096"])
                data = b"\n".join(lines)
            else:
                data = rng.randbytes(rng.randrange(0, 200)).replace(b"\x80", b"")
            yield ("c.csv", data)


LOADERS = {
    "sequence": (VariableSequence.from_json, SequenceFormatError),
    "schedule": (Schedule.from_json, SequenceFormatError),
    "snapshot": (frag_load, OOCError),
    "frag-json": (frag_load, OOCError),
    "csv": (frag_load, OOCError),
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", list(ROUNDS))
def test_mutated_inputs_raise_only_the_documented_error(tmp_path, kind):
    rng = random.Random(f"{SEED}-{kind}")
    loader, allowed = LOADERS[kind]
    outcomes: dict[str, int] = {}
    for k, (name, data) in enumerate(_cases(rng, kind)):
        path = tmp_path / f"{k % 8}-{name}"
        path.write_bytes(data)
        outcome = _expect(loader, path, allowed)
        outcomes[outcome] = outcomes.get(outcome, 0) + 1
    assert sum(outcomes.values()) == ROUNDS[kind]
    # the mutations must reach past the first check: some inputs fail, some still load
    assert len(outcomes) >= 2, outcomes


def test_fuzz_volume_is_at_least_ten_thousand_inputs():
    assert sum(ROUNDS.values()) + HYPOTHESIS_EXAMPLES >= 10_000


def test_hostile_pickles_are_refused_without_running_anything(tmp_path):
    marker = "/tmp/ooc-fuzz-pwned"
    if os.path.exists(marker):
        os.unlink(marker)
    for k, data in enumerate(_hostile_pickles()):
        path = tmp_path / f"h{k}.pickle"
        path.write_bytes(data)
        assert _expect(frag_load, path, OOCError) != "ok"
        with pytest.raises(OOCError, match="refused|not a|truncated|missing"):
            frag_load(path)
    assert not os.path.exists(marker), "a hostile pickle ran code"


@pytest.mark.parametrize("loader", [VariableSequence.from_json, Schedule.from_json])
def test_truncated_and_foreign_files_give_one_clear_line(tmp_path, loader):
    doc = SEQ_DOC if loader == VariableSequence.from_json else PLAN_DOC
    path = tmp_path / "f.json"
    cases = {
        "truncated": json.dumps(doc)[: len(json.dumps(doc)) // 2],
        "version": json.dumps(dict(doc, version=99)),
        "schema": json.dumps(dict(doc, schema="something.else")),
        "types": json.dumps(dict(doc, functions={"0": 1}) if "functions" in doc else dict(doc, before=7)),
        "empty": "",
    }
    words = {"truncated": "not a JSON file", "version": "version 99 is not supported",
             "schema": "not an", "types": "expected", "empty": "not a JSON file"}
    for what, text in cases.items():
        path.write_text(text)
        with pytest.raises(SequenceFormatError, match=words[what]) as err:
            loader(path)
        assert "\n" not in str(err.value), what
        assert str(path) in str(err.value), f"{what}: the message names the file"


# -- hypothesis on top: random documents with the right top-level shape -------------------------

HYPOTHESIS_EXAMPLES = 600

_json = st.recursive(
    st.none() | st.booleans() | st.integers(-(1 << 70), 1 << 70) | st.floats() | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
        st.sampled_from(["id", "nbytes", "kind", "name", "uses", "seconds", "flops", "bytes", "live_in",
                         "x", "variables", "functions", "sequence", "before", "after"]), inner, max_size=5),
    max_leaves=20)


@settings(max_examples=HYPOTHESIS_EXAMPLES // 2, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(variables=_json, functions=_json, meta=_json)
def test_hypothesis_sequence_documents(tmp_path_factory, variables, functions, meta):
    doc = {"schema": SEQ_DOC["schema"], "version": SEQ_DOC["version"], "variables": variables,
           "functions": functions, "meta": meta}
    try:
        VariableSequence.from_dict(doc)
    except SequenceFormatError:
        pass


@settings(max_examples=HYPOTHESIS_EXAMPLES // 2, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(field=st.sampled_from(["before", "after", "initial_resident", "budget", "window", "policy",
                              "sequence"]), value=_json)
def test_hypothesis_schedule_documents(field, value):
    doc = dict(PLAN_DOC, **{field: value})
    try:
        Schedule.from_dict(doc)
    except SequenceFormatError:
        pass
