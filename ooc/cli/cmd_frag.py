"""``ooc frag INPUT``: fragmentation diagnostics for a recorded (or planned) run.

Replays the allocations of INPUT (a PyTorch memory snapshot from
``torch.cuda.memory._dump_snapshot``, an ooc trace or plan JSON, or a CSV of
``time,action,address,bytes``) through a model of PyTorch's caching allocator and through
virtual addressing at several chunk sizes; prints peaks, fragmentation, the OOM point and a
recommendation (``--json``: one JSON object). ``--plot`` draws the timeline,
``--export-snapshot`` writes a replay for pytorch.org/memory_viz.

Snapshots are read with an allow-listing unpickler: a pickle that asks to import or call
anything is refused and nothing in it runs.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

PROGRESS_MIN_EVENTS = 100_000  # smaller inputs replay in well under a second: no bar
PROGRESS_MIN_BYTES = 16 << 20  # snapshots above ~250k trace entries take seconds to load


def register(subparsers: Any) -> None:
    from ooc.cli.args import SIZE_HELP, nonnegative_int, output_file, size

    p = subparsers.add_parser(
        "frag", help="fragmentation diagnostics: caching allocator vs virtual addressing",
        description="Replay the allocations of a PyTorch memory snapshot, an ooc trace/plan or a "
                    "CSV (time,action,address,bytes) through PyTorch's caching allocator model "
                    "and through virtual addressing with fixed-size chunks; report peaks, "
                    "fragmentation and what would have changed.", epilog=SIZE_HELP)
    p.add_argument("input", metavar="INPUT", help="snapshot .pickle, ooc trace/plan .json, or .csv")
    p.add_argument("--chunks", default="2MiB,20MiB,40MiB", metavar="SIZES", type=_chunk_list,
                   help="virtual-addressing chunk sizes, comma-separated multiples of 2 MiB "
                        "(default: 2MiB,20MiB,40MiB)")
    p.add_argument("--alloc-conf", default=None, metavar="LINES", type=_alloc_confs,
                   help="PYTORCH_CUDA_ALLOC_CONF settings to model beside PyTorch's defaults, "
                        "separated by ';', e.g. 'expandable_segments:True;max_split_size_mb:256' "
                        "(default: " + ";".join(_default_confs()) + "; 'none': only the defaults)")
    p.add_argument("--device-memory", metavar="SIZE", type=size,
                   help="device memory to replay against, e.g. 16GiB (default: what the snapshot "
                        "says: estimated at its recorded OOM; else unlimited)")
    p.add_argument("--device", type=nonnegative_int, metavar="N",
                   help="which device's trace of a multi-device snapshot (default: the longest)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.add_argument("--plot", metavar="PNG", type=output_file(".png"), help="write a timeline of live/reserved/mapped bytes")
    p.add_argument("--export-snapshot", metavar="PICKLE", type=output_file(),
                   help="write the replay as a PyTorch memory snapshot (for pytorch.org/memory_viz)")
    p.add_argument("--export-allocator", default="caching", metavar="WHICH", type=_export_allocator,
                   help="the replay --export-snapshot writes: 'caching' (default) or a chunk size "
                        "such as 20MiB (virtual addressing)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.set_defaults(run=run)


def _default_confs() -> tuple[str, ...]:
    from ooc.frag.report import DEFAULT_CONFS

    return DEFAULT_CONFS


def _alloc_confs(text: str) -> list[str]:
    """``--alloc-conf``: PYTORCH_CUDA_ALLOC_CONF lines separated by ';', each checked."""
    from vmm.alloc_conf import AllocConf, AllocConfError

    if text.strip().lower() == "none":
        return []
    out: list[str] = []
    for part in text.split(";"):
        if not part.strip():
            continue
        try:
            line = AllocConf.parse(part).line()
        except AllocConfError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
        if line and line not in out:
            out.append(line)
    if not out and text.strip():
        raise argparse.ArgumentTypeError(f"{text!r}: give settings such as expandable_segments:True, "
                                         f"or 'none'")
    return out


def _chunks(text: str) -> list[int]:
    """Chunk sizes, comma-separated, each a multiple of the mapping granularity."""
    from vmm.errors import OOCError
    from vmm.units import format_size, parse_size

    from ooc.frag.report import GRANULARITY

    out: list[int] = []
    for part in text.split(","):
        if not part.strip():
            continue
        c = parse_size(part, what="--chunks")
        if c % GRANULARITY:
            lo = max(GRANULARITY, c // GRANULARITY * GRANULARITY)
            raise OOCError(f"--chunks: {part.strip()} is not a multiple of the "
                           f"{format_size(GRANULARITY)} mapping granularity; use "
                           f"{format_size(lo)} or {format_size(lo + GRANULARITY)}")
        if c not in out:
            out.append(c)
    if not out:
        raise OOCError("--chunks: give at least one chunk size, e.g. 20MiB")
    return out


def _chunk_list(text: str) -> list[int]:
    """``--chunks`` as an argparse type."""
    from vmm.errors import OOCError

    try:
        return _chunks(text)
    except OOCError as exc:
        raise argparse.ArgumentTypeError(_problem(exc)) from None


def _export_allocator(text: str) -> int | None:
    """``--export-allocator``: None for 'caching', else one chunk size (20MiB or vmm-20MiB)."""
    from vmm.errors import OOCError

    which = text.strip()
    if which.lower() == "caching":
        return None
    if which.lower().startswith("vmm-"):
        which = which[len("vmm-"):]
    try:
        chunks = _chunks(which)
    except OOCError as exc:
        raise argparse.ArgumentTypeError(
            f"{text!r} is neither 'caching' nor a chunk size such as 20MiB ({_problem(exc)})") from None
    if len(chunks) != 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give one chunk size, e.g. 20MiB")
    return chunks[0]


def _problem(exc: Exception) -> str:
    """An error of ``_chunks`` without its "--chunks:" prefix (argparse names the flag)."""
    return getattr(exc, "problem", None) or str(exc).removeprefix("--chunks: ")


def _load(args: argparse.Namespace, frag: Any) -> Any:
    """``frag.load`` with a byte progress bar for large snapshots (a 1M-event one is ~60 MB)."""
    import os

    bar = None

    def progress(done: int, total: int) -> None:
        nonlocal bar
        if bar is None:
            from tqdm import tqdm

            bar = tqdm(total=total, unit="B", unit_scale=True, file=sys.stderr, disable=None,
                       desc="ooc frag: load", leave=False)
        bar.update(done - bar.n)

    big = not args.no_progress and os.path.isfile(args.input) and \
        os.path.getsize(args.input) > PROGRESS_MIN_BYTES
    try:
        return frag.load(args.input, device=args.device, progress=progress if big else None)
    finally:
        if bar is not None:
            bar.close()


def run(args: argparse.Namespace) -> int:
    from vmm.errors import OOCError
    from vmm.units import format_size

    from ooc import frag

    # Parsed and checked by the parser: chunk sizes, device memory, output files.
    chunks, device_memory, export_chunk = args.chunks, args.device_memory, args.export_allocator
    largest = max(chunks + ([export_chunk] if export_chunk and args.export_snapshot else []))
    if device_memory is not None and device_memory < largest:
        raise OOCError(f"--device-memory {format_size(device_memory)} holds not one "
                       f"{format_size(largest)} chunk; give more device memory or smaller "
                       f"--chunks / --export-allocator")

    trace = _load(args, frag)
    n = len(trace.events)
    bar = None
    if not args.no_progress and n > PROGRESS_MIN_EVENTS:
        from tqdm import tqdm

        # disable=None: tqdm turns itself off when stderr is not a terminal.
        # The PyTorch settings replayed (at most one more than asked for: the baseline).
        n_confs = len(args.alloc_conf if args.alloc_conf is not None else _default_confs()) + 1
        bar = tqdm(total=n * (1 + n_confs + len(chunks)), unit="ev", unit_scale=True, file=sys.stderr,
                   disable=None, desc="ooc frag: replay", leave=False)

    def progress(done: int) -> None:
        if bar is not None:
            bar.update(done - bar.n)

    try:
        confs = args.alloc_conf if args.alloc_conf is not None else _default_confs()
        rep = frag.analyze(trace, chunks=chunks, device_memory=device_memory, progress=progress,
                           confs=confs)
    finally:
        if bar is not None:
            bar.close()

    written: list[str] = []
    if args.plot:
        frag.plot_timeline(rep, args.plot)
        written.append(f"timeline: {args.plot}")
    export = None
    if args.export_snapshot:
        export = frag.export_snapshot(trace, args.export_snapshot, chunk_bytes=export_chunk,
                                      device_memory=rep.device_memory)
        oom = f", ends at its OOM (event {export.oom_event:,})" if export.oom_event is not None else ""
        written.append(f"snapshot ({export.allocator}, {export.entries:,} trace entries{oom}): "
                       f"{export.path}; open it at https://pytorch.org/memory_viz")

    if args.json:
        out = rep.to_dict()
        out["plot"] = args.plot
        out["export_snapshot"] = None if export is None else {
            "path": export.path, "allocator": export.allocator, "entries": export.entries,
            "oom_event": export.oom_event}
        print(json.dumps(out, indent=1, sort_keys=False))
    else:
        print(frag.format_table(rep))
        for w in written:
            print(w)
    return 0
