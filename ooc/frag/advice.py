"""What ``ooc frag`` says about the replays: the :class:`~ooc.frag.report_data.Advice` ("what
should I set, and what does it save?", rules in :func:`advise`) and the recommendation
paragraph about virtual addressing (:func:`recommendation`), both made from the numbers of a
:class:`~ooc.frag.report_data.FragReport`.

Apart from the replay (:mod:`ooc.frag.allocator_replay`) and the table
(:mod:`ooc.frag.report`) because these are the decisions and their wording: the rules can
change without touching how anything is measured.
"""

from __future__ import annotations

from typing import Sequence

from vmm.units import format_size

from ooc.frag.report_data import Advice, AllocatorReport, FragReport

__all__ = ["ADVICE_MIN_GAIN", "advise", "pick_best", "recommendation"]

ADVICE_MIN_GAIN = 0.05  # ooc's allocator is advised over a PyTorch setting only if it saves
# this fraction of the baseline's peak more (a setting is one line; ooc changes the program)


def pick_best(reports: Sequence[AllocatorReport]) -> AllocatorReport | None:
    """The virtual allocator to recommend: gets furthest (no OOM first), then the lowest peak;
    within 2% of that peak, the largest chunk (fewest map calls)."""
    virtual = [r for r in reports if r.kind == "virtual"]
    if not virtual:
        return None
    furthest = max(r.events for r in virtual)
    cands = [r for r in virtual if r.events == furthest]
    low = min(r.peak_reserved_bytes for r in cands)
    near = [r for r in cands if r.peak_reserved_bytes <= low * 1.02 + 1]
    return max(near, key=lambda r: (r.chunk_bytes or 0, -r.peak_reserved_bytes))


def advise(rep: FragReport) -> Advice:
    """What to set, and what it saves, for the run of ``rep`` (rules, in order):

    1. the *baseline* is the model of what was recorded: ``expandable_segments:True`` if the
       snapshot's segments are expandable, else ``caching`` (PyTorch's defaults);
    2. a model "gets further" than another if it replays more events (the other ran out of
       memory first); among those that get furthest, the lowest peak reserved wins. The best
       ``PYTORCH_CUDA_ALLOC_CONF`` setting and the best ooc chunk size are found that way;
    3. if the baseline completes: the setting is advised when it lowers the peak; ooc's
       allocator instead when it saves more than the setting by at least
       ``ADVICE_MIN_GAIN`` (5%) of the baseline's peak (a setting is one line, ooc a change
       to the program); nothing when neither lowers the peak;
    4. if the baseline runs out of memory: the setting that completes, else ooc's allocator if
       it completes, else nothing (no allocator fits: the live bytes need swapping).
    """
    t = rep.trace
    base_name = "expandable_segments:True" if t.expandable else "caching"
    base = rep.by_name(base_name)
    rec = t.recorded
    matches = None
    if rec is not None:
        matches = base.peak_reserved_bytes == rec.peak_reserved_bytes
    total = len(t.events)

    def rank(r: AllocatorReport) -> tuple[int, int]:
        return (-r.events, r.peak_reserved_bytes)

    confs = [r for r in rep.allocators if r.kind == "caching" and r is not base]
    conf = min(confs, key=rank) if confs else None
    vmm = rep.by_name(rep.best) if rep.best else None
    peak = base.peak_reserved_bytes
    choice: AllocatorReport | None = None
    if base.completed:
        conf_gain = peak - conf.peak_reserved_bytes if conf is not None and conf.completed else 0
        vmm_gain = peak - vmm.peak_reserved_bytes if vmm is not None and vmm.completed else 0
        if vmm_gain > max(conf_gain, 0) + ADVICE_MIN_GAIN * peak:
            choice = vmm
        elif conf_gain > 0:
            choice = conf
    else:
        for cand in (conf, vmm):
            if cand is not None and cand.events == total and cand.completed:
                choice = cand
                break
    live = base.peak_live_bytes
    if choice is None:
        kind, setting, reserved, saved = "keep", "", None, 0
    elif choice.kind == "virtual":
        kind, reserved = "ooc", choice.peak_reserved_bytes
        setting = f"ooc.OutOfCore(model, optimizer, budget=..., chunk={choice.chunk_bytes})"
        saved = peak - reserved
    else:
        kind, reserved = "alloc_conf", choice.peak_reserved_bytes
        setting = f"PYTORCH_CUDA_ALLOC_CONF={choice.alloc_conf}"
        saved = peak - reserved
    pct = round(100.0 * saved / peak, 1) if peak and choice is not None else 0.0
    return Advice(baseline=base_name, peak_live_bytes=live,
                  recorded_reserved_bytes=rec.peak_reserved_bytes if rec else None,
                  baseline_reserved_bytes=peak, replay_matches_recorded=matches,
                  choice=choice.name if choice else None, kind=kind, setting=setting,
                  reserved_bytes=reserved, saved_bytes=saved, saved_percent=pct,
                  text=_advice_text(rep, base, choice, setting, saved, pct, matches))


def _advice_text(rep: FragReport, base: AllocatorReport, choice: AllocatorReport | None,
                 setting: str, saved: int, pct: float, matches: bool | None) -> str:
    rec = rep.trace.recorded
    what = ("PyTorch's defaults" if base.name == "caching"
            else f"PYTORCH_CUDA_ALLOC_CONF={base.name}")
    parts = []
    if rec is not None and matches:
        parts.append(f"The replay of {what} reproduces the recorded peak reserved "
                     f"({format_size(rec.peak_reserved_bytes)}).")
    elif rec is not None:
        parts.append(f"The replay of {what} peaks at {format_size(base.peak_reserved_bytes)} "
                     f"reserved where the run recorded {format_size(rec.peak_reserved_bytes)} "
                     f"(other streams or memory outside the trace are not modelled).")
    if choice is None:
        if base.completed:
            parts.append(f"Keep {what}: no modelled setting lowers its peak of "
                         f"{format_size(base.peak_reserved_bytes)} reserved for "
                         f"{format_size(base.peak_live_bytes)} live.")
        else:
            parts.append(f"No modelled setting or chunk size fits this run on the "
                         f"{_gib(rep.device_memory)} device: {_swap_advice(rep)}.")
        return " ".join(parts)
    label = f"Set {setting}" if choice.kind == "caching" else         f"Use ooc's allocator with {format_size(choice.chunk_bytes or 0)} chunks ({setting})"
    if base.completed:
        parts.append(f"{label}: this run then peaks at {format_size(choice.peak_reserved_bytes)} "
                     f"reserved instead of {format_size(base.peak_reserved_bytes)} "
                     f"({format_size(saved)} or {pct:g}% less, for "
                     f"{format_size(base.peak_live_bytes)} live; at most "
                     f"{format_size(choice.max_unused_bytes)} reserved but unused instead of "
                     f"{format_size(base.max_unused_bytes)}).")
    else:
        parts.append(f"{label}: the whole run then fits on the {_gib(rep.device_memory)} "
                     f"device, peaking at {format_size(choice.peak_reserved_bytes)} reserved, "
                     f"where {what} runs out of memory at event "
                     f"{base.oom.event if base.oom else base.events:,}.")
    return " ".join(parts)



def _gib(n: int | None) -> str:
    return "-" if n is None else format_size(n)


def _pct(part: int, whole: int) -> str:
    return f"{100.0 * part / whole:.0f}%" if whole else "-"


def _swap_advice(rep: FragReport) -> str:
    """What to do when the live bytes alone exceed the device: swap, with the budget to give.
    A last step, not a pointer to another diagnosis (``ooc simulate`` sends allocator trouble
    here; this must not send it back)."""
    below = f" below {format_size(rep.device_memory)}" if rep.device_memory else ""
    if rep.trace.kind == "schedule":
        return f"re-plan the step with a lower budget (`ooc plan TRACE --budget SIZE`{below})"
    if rep.trace.kind == "sequence":
        return f"swap: plan this trace with `ooc plan {rep.trace.name} --budget SIZE`{below}"
    return (f"swap: train with ooc.OutOfCore(model, optimizer, budget=...){below}, or trace the "
            f"step (`ooc trace` or ooc.trace) and plan it with `ooc plan TRACE --budget SIZE`{below}")


def recommendation(rep: FragReport) -> str:
    """One paragraph: what virtual addressing would change for this run, in numbers."""
    caching = rep.by_name("caching")
    best = rep.by_name(rep.best) if rep.best else None
    n = len(rep.trace.events)
    rec_oom = rep.trace.ooms[0] if rep.trace.ooms else None
    parts: list[str] = []
    if best is None:
        return "No virtual-addressing allocator was replayed (give --chunks)."
    chunk_txt = f"{format_size(best.chunk_bytes or 0)} chunks"
    cap_txt = f"the {format_size(rep.device_memory)} device" if rep.device_memory else "an unlimited device"

    # The recorded OOM, if any: what the caching model says about it, and whether chunks fit it.
    if rec_oom is not None:
        at = caching.at_recorded_oom
        reason = ""
        if at is not None:
            unused = at.reserved_bytes - at.live_bytes
            reason = (f" With {format_size(at.reserved_bytes)} reserved for {format_size(at.live_bytes)} "
                      f"live, {format_size(unused)} ({_pct(unused, at.reserved_bytes)}) was reserved "
                      f"but not in use and the largest free block was {_gib(at.largest_free_bytes)}.")
        parts.append(f"The recorded run ran out of memory at event {rec_oom.index:,} asking for "
                     f"{format_size(rec_oom.nbytes)}.{reason}")
        if caching.recorded_oom_fits is False and caching.oom is not None \
                and caching.oom.event == rec_oom.index:
            parts.append("The caching model fails at the same request, so the model reproduces "
                         "the crash.")
        elif caching.recorded_oom_fits:
            parts.append(f"The caching model fits that request on {cap_txt}, so part of the "
                         f"recorded reserve was held elsewhere (other streams, other pools, or "
                         f"memory outside PyTorch).")
        if best.recorded_oom_fits:
            parts.append(f"With {chunk_txt} the request fits: the OOM at event {rec_oom.index:,} "
                         f"would not have happened.")
        elif best.recorded_oom_fits is False:
            parts.append(f"Even with {chunk_txt} the request does not fit: the live bytes "
                         f"themselves exceed the device, so fragmentation is not the (only) "
                         f"cause; reduce what is live: a smaller batch, or {_swap_advice(rep)}.")

    # Peaks.
    if caching.completed and best.completed:
        saved = caching.peak_reserved_bytes - best.peak_reserved_bytes
        if saved > 0:
            parts.append(
                f"With {chunk_txt} this run peaks at {format_size(best.peak_reserved_bytes)} mapped "
                f"instead of {format_size(caching.peak_reserved_bytes)} reserved by the caching "
                f"allocator ({format_size(saved)} or {_pct(saved, caching.peak_reserved_bytes)} "
                f"less, for {format_size(caching.peak_live_bytes)} live), at the cost of "
                f"{best.map_calls:,} map and {best.unmap_calls:,} unmap calls over {n:,} events.")
        else:
            parts.append(
                f"The caching allocator already peaks at {format_size(caching.peak_reserved_bytes)} "
                f"for {format_size(caching.peak_live_bytes)} live; {chunk_txt} would peak at "
                f"{format_size(best.peak_reserved_bytes)}: virtual addressing saves nothing here.")
        if caching.peak_live_bytes and saved <= 0.05 * caching.peak_reserved_bytes and saved > 0:
            parts.append("Fragmentation is low in this run; the saving is small.")
    elif not caching.completed and best.completed:
        oom = caching.oom
        assert oom is not None
        if rec_oom is None or oom.event != rec_oom.index or not best.recorded_oom_fits:
            parts.append(
                f"On {cap_txt} the caching allocator runs out of memory at event {oom.event:,} "
                f"({format_size(caching.oom_request or 0)} requested, "
                f"{format_size(oom.reserved_bytes - oom.live_bytes)} reserved but not in use, "
                f"largest free block {_gib(oom.largest_free_bytes)}); with {chunk_txt} the whole "
                f"run fits, peaking at {format_size(best.peak_reserved_bytes)} mapped for "
                f"{format_size(best.peak_live_bytes)} live.")
        else:
            parts.append(f"The whole run then fits, peaking at "
                         f"{format_size(best.peak_reserved_bytes)} mapped for "
                         f"{format_size(best.peak_live_bytes)} live.")
    elif not best.completed:
        oom = best.oom
        assert oom is not None
        if rec_oom is None or oom.event != rec_oom.index:
            parts.append(
                f"On {cap_txt} even {chunk_txt} run out of memory at event {oom.event:,} with "
                f"{format_size(oom.live_bytes)} live: the run needs more memory than the device "
                f"has whatever the allocator: {_swap_advice(rep)}.")

    # Chunk size trade-off across the other virtual allocators.
    others = sorted((r for r in rep.allocators if r.kind == "virtual" and r is not best),
                    key=lambda r: r.chunk_bytes or 0)
    done = [r for r in others if r.completed]
    if done and best.completed:
        alt = min(done, key=lambda r: r.peak_reserved_bytes)
        diff = best.peak_reserved_bytes - alt.peak_reserved_bytes
        if diff > 0:
            parts.append(f"{format_size(alt.chunk_bytes or 0)} chunks would save "
                         f"{format_size(diff)} more but make {alt.map_calls:,} map calls "
                         f"instead of {best.map_calls:,}.")
    if others and best.completed:
        desc = []
        for r in others:
            if r.completed:
                desc.append(f"{format_size(r.chunk_bytes or 0)} chunks peak at "
                            f"{format_size(r.peak_reserved_bytes)} ({r.map_calls:,} map calls)")
            else:
                desc.append(f"{format_size(r.chunk_bytes or 0)} chunks run out of memory at event "
                            f"{r.oom.event if r.oom else r.events:,}")
        parts.append(f"Other chunk sizes: {'; '.join(desc)}. Each allocation wastes less than "
                     f"one chunk, so larger chunks cost memory and save map calls.")
    return " ".join(parts)
