"""tools/step_timeline.py on fabricated spans: the idle gaps between device work and the host calls inside them.
Needs no GPU and no torch."""

import os
import sys

TOOLS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tools")
sys.path.insert(0, TOOLS)

import step_timeline as st  # noqa: E402

# Two kernels that overlap (one gap-free busy span 0-150), a gap 150-400 with a synchronization and a launch in it,
# a 5 us gap (below the threshold), and a last kernel.
DEVICE = [(100, 150, "gemm"), (0, 120, "scan"), (400, 500, "dz"), (505, 600, "merge")]
HOST = [(390, 395, "cudaLaunchKernel"), (140, 300, "cudaStreamSynchronize"), (10, 12, "cudaLaunchKernel"),
        (502, 503, "cudaLaunchKernel")]


def test_gaps_merge_overlapping_spans_and_list_the_calls_inside():
    gaps = st.idle_gaps(DEVICE, HOST, min_us=10)
    assert len(gaps) == 1
    start, length, calls = gaps[0]
    assert (start, length) == (150, 250)
    # The synchronization started before the gap (at 140): only calls that start inside it are listed.
    assert calls == [(390, 5, "cudaLaunchKernel")]


def test_the_threshold_decides_which_intervals_are_gaps():
    assert [g[:2] for g in st.idle_gaps(DEVICE, HOST, min_us=5)] == [(150, 250), (500, 5)]
    assert st.idle_gaps(DEVICE, HOST, min_us=300) == []
    assert st.idle_gaps([], HOST) == []


def test_report_gives_offsets_from_the_first_device_span():
    text = st.report(DEVICE, HOST, min_us=10)
    assert text.splitlines()[0] == "device work from 0 to 600 us: 250 us idle in 1 gaps of >= 10 us"
    assert "at       150 us:     250 us idle, 1 runtime calls" in text
    assert "cudaLaunchKernel" in text
    assert st.report([], HOST) == "no device work recorded"
