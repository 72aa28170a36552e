"""Where a step's device sits idle, and what the host was doing meanwhile: profile_step.py --timeline.

The step's device work (kernels, copies, memsets) and the host's CUDA runtime calls (launches, copies,
synchronizations), both as spans (start, end, name) in microseconds on one clock, as torch.profiler records them.
Every interval with no device work running, of at least `min_us`, becomes a gap listing the runtime calls that
started inside it: a gap spent in cudaStreamSynchronize is the device waiting on itself; a gap with a few quick
launches after a long silence is host code (Python, validation, planning) that ran while the device had nothing
queued. No torch here, so the tests run without it.
"""

from __future__ import annotations


def idle_gaps(device, host, min_us=10.0):
    """-> [(start, length, [(host start, duration, name) ...])] for each interval of at least min_us between
    device spans (overlapping spans merged; nothing before the first or after the last), with the host calls that
    started inside it."""
    host = sorted(host)
    gaps, busy_until, h = [], None, 0
    for start, end, _ in sorted(device):
        if busy_until is not None and start - busy_until >= min_us:
            while h < len(host) and host[h][0] < busy_until:  # calls before the gap (both lists in time order)
                h += 1
            calls = []
            while h < len(host) and host[h][0] < start:
                h0, h1, name = host[h]
                calls.append((h0, h1 - h0, name))
                h += 1
            gaps.append((busy_until, start - busy_until, calls))
        busy_until = end if busy_until is None else max(busy_until, end)
    return gaps


def report(device, host, min_us=10.0, most=12):
    """The timeline's text: the span of the device work and its idle time, then the `most` longest gaps
    (offsets from the first device span) with the host calls inside each."""
    if not device:
        return "no device work recorded"
    first = min(s for s, _, _ in device)
    last = max(e for _, e, _ in device)
    gaps = idle_gaps(device, host, min_us)
    idle = sum(length for _, length, _ in gaps)
    lines = [f"device work from 0 to {last - first:.0f} us: {idle:.0f} us idle in {len(gaps)} gaps of >= {min_us:g} us"]
    for start, length, calls in sorted(gaps, key=lambda g: -g[1])[:most]:
        lines.append(f"  at {start - first:9.0f} us: {length:7.0f} us idle, {len(calls)} runtime calls")
        for h0, dur, name in calls:
            lines.append(f"      {h0 - first:9.0f} +{dur:7.0f} us  {name}")
    return "\n".join(lines)
