"""Placement report: map arithmetic against a per-byte reference, inspect on a real mmap, plot."""

import builtins

import numpy as np
import pytest

from numa_moe.apps.placement_report import (
    analyse_map,
    inspect_checkpoint,
    map_period,
    placement_report,
    plot_placement,
    remote_bytes,
)
from numa_moe.layer.store import ExpertStore
from numa_moe.checkpoints.synthetic import make_checkpoint

PAGE = 4096


def _byte_nodes(page_nodes, offset_bytes, nbytes):
    """Node of every byte of the matrix (reference: expand pages to bytes)."""
    per_byte = np.repeat(np.asarray(page_nodes, dtype=np.int64), PAGE)
    return per_byte[offset_bytes:offset_bytes + nbytes]


def _reference_fractions(rows, cols, page_nodes, offset_bytes, workers, table):
    row_bytes = cols * 2
    owner = _byte_nodes(page_nodes, offset_bytes, rows * row_bytes)
    present = owner >= 0
    naive_worker = np.repeat(np.asarray(workers)[np.searchsorted(
        [j * rows // len(workers) for j in range(1, len(workers))], np.arange(rows), side="right")], row_bytes)
    naive = np.count_nonzero(present & (owner != naive_worker)) / np.count_nonzero(present)
    table_worker = np.full(rows * row_bytes, -1)
    for node, segments in table.segments.items():
        for s in segments:
            for r in range(s.row0, s.row0 + s.row_stride * s.nrows, s.row_stride):
                table_worker[r * row_bytes + 2 * s.k0:r * row_bytes + 2 * s.k1] = node
    assert np.all(table_worker >= 0)
    tab = np.count_nonzero(present & (owner != table_worker)) / np.count_nonzero(present)
    return naive, tab


@pytest.mark.parametrize("case", ["interleave2", "interleave3_phase", "chunks", "random_absent"])
def test_analyse_map_against_per_byte_reference(rng, case):
    rows, cols = int(rng.integers(20, 60)), int(rng.integers(300, 3000))
    offset = int(rng.integers(0, PAGE // 2)) * 2
    n_pages = (offset + rows * cols * 2 - 1) // PAGE + 1
    workers = (0, 1)
    if case == "interleave2":
        pages = np.arange(n_pages) % 2
    elif case == "interleave3_phase":
        workers = (0, 1, 2)
        pages = (np.arange(n_pages) + 1) % 3
    elif case == "chunks":
        pages = np.where(np.arange(n_pages) < int(rng.integers(1, n_pages)), 1, 0)
    else:
        workers = (0, 1, 2, 3)
        pages = rng.integers(-2, 4, n_pages)
        pages[pages == -1] = -2  # -ENOENT: not present
        pages[0] = 1
    placement, table = analyse_map("t", rows, cols, "bf16", pages.astype(np.int32), PAGE, offset, workers)
    table.check()
    naive, tab = _reference_fractions(rows, cols, pages, offset, workers, table)
    assert placement.remote_fraction_naive == pytest.approx(naive, abs=1e-12)
    assert placement.remote_fraction_table == pytest.approx(tab, abs=1e-12)
    assert tab == 0.0
    assert placement.pages_not_present == int(np.count_nonzero(pages < 0))
    assert sum(placement.pages_per_node.values()) + placement.pages_not_present == n_pages
    if case == "interleave2":
        assert placement.period_pages == 2 and not placement.single_node
    if case == "interleave3_phase" and n_pages >= 6:
        assert placement.period_pages == 3


def test_remote_bytes_simple():
    # pages: node 0, node 1, node 0; bytes [1000, 9000) for worker 0 -> remote = page 1 entirely
    assert remote_bytes(np.array([1000]), np.array([9000]), 0, np.array([0, 1, 0]), PAGE, 0) == (4096, 8000)
    # with a 100-byte offset the same range shifts by 100 bytes into the pages
    assert remote_bytes(np.array([0]), np.array([4000]), 1, np.array([0, 1]), PAGE, 100) == (3996 - 0, 4000)


def test_map_period_against_brute_force(rng):
    for _ in range(200):
        n = int(rng.integers(1, 40))
        if rng.random() < 0.5:
            base = rng.integers(0, 3, int(rng.integers(1, 6)))
            seq = np.resize(base, n)
        else:
            seq = rng.integers(0, 3, n)
        brute = next((p for p in range(1, n // 2 + 1) if np.array_equal(seq[p:], seq[:n - p])), None)
        if len(set(seq.tolist())) == 1:
            brute = 1
        assert map_period(seq) == brute, seq



def test_map_period_finds_periods_longer_than_a_short_prefix(rng):
    """A map of node-sized chunks (period of thousands of pages) with the same node at
    the start of every page run: many candidate periods survive any short-prefix
    filter, so the finder must still check them all (the segment module's does)."""
    period = int(rng.integers(9000, 12000))
    chunk = np.zeros(period, dtype=np.int32)
    chunk[-int(rng.integers(1, 50)):] = 1
    seq = np.tile(chunk, 3)
    assert map_period(seq) == period
    seq[-1] = 2  # one moved page: no longer periodic
    assert map_period(seq) is None

@pytest.fixture
def checkpoint_dir(tmp_path, rng):
    return make_checkpoint(tmp_path / "ck", "deepseek-v3", 1, 3, int(rng.integers(1 << 31)),
                           hidden_size=256, intermediate_size=192, progress=False)


def test_inspect_page_cache_mmap(checkpoint_dir):
    report = inspect_checkpoint(checkpoint_dir, nodes=2, touch="all")
    assert len(report.tensors) == 3 * 3  # routed only: shared experts and routers left out
    for t in report.tensors:
        assert t.pages_not_present == 0
        assert t.single_node  # one NUMA node here
        assert t.remote_fraction_table == 0.0
        assert t.remote_fraction_naive == pytest.approx(0.5)  # node 1's half is all remote
        assert t.page_nodes is not None and len(t.page_nodes) == t.n_pages
    assert report.totals()["single_node_tensors"] == 9
    text = report.format_text()
    assert "remote reads: naive row split 50.0%" in text
    everything = inspect_checkpoint(checkpoint_dir, nodes=1, include_all=True, tensor="shared_experts")
    assert {t.name.split(".")[-2] for t in everything.tensors} == {"gate_proj", "up_proj", "down_proj"}
    with pytest.raises(ValueError, match="no tensor matches"):
        inspect_checkpoint(checkpoint_dir, tensor="*.nothing.*")


def test_inspect_touch_none_reports_unmapped_pages(checkpoint_dir):
    report = inspect_checkpoint(checkpoint_dir, nodes=1, touch="none", tensor=r"experts\.0\.")
    # this process never mapped the pages: move_pages sees them as not present
    assert all(t.pages_not_present == t.n_pages for t in report.tensors)
    assert all(t.remote_fraction_naive is None for t in report.tensors)
    # no page present: neither "single node" nor periodic multi-node
    assert all(not t.single_node and "not resident (no page present)" in t.line() for t in report.tensors)
    totals = report.totals()
    assert totals["not_resident_tensors"] == len(report.tensors)
    assert totals["single_node_tensors"] == 0 and totals["periodic_tensors"] == 0
    assert f"not resident {len(report.tensors)}, single-node 0" in report.format_text()


def test_store_report_and_plot(checkpoint_dir, tmp_path):
    store = ExpertStore.load(checkpoint_dir, progress=False)
    report = placement_report(store)
    assert len(report.tensors) == 3
    for t in report.tensors:
        assert t.pages_not_present == 0 and t.remote_fraction_table == 0.0
        assert any("matches the map" in note for note in t.notes)
    path = tmp_path / "p.png"
    assert plot_placement(report, path) == 3
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_x_axis_says_what_its_values_are(checkpoint_dir, tmp_path, monkeypatch):
    import matplotlib.figure

    report = inspect_checkpoint(checkpoint_dir, nodes=1, touch="all", tensor=r"experts\.0\.")
    saved = []
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", lambda fig, *a, **k: saved.append(fig))
    plot_placement(report, tmp_path / "p.png")
    (ax,) = saved[0].axes
    # every strip spans 0..1 whatever its page count: the label must say fraction, not pages
    assert ax.get_xlim() == (0.0, 1.0)
    assert "fraction of its pages" in ax.get_xlabel()


def test_plot_without_matplotlib(checkpoint_dir, tmp_path, monkeypatch):
    report = inspect_checkpoint(checkpoint_dir, nodes=1, tensor=r"experts\.0\.")
    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name.startswith("matplotlib"):
            raise ImportError("No module named 'matplotlib'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    with pytest.raises(RuntimeError, match=r"plotting needs matplotlib: pip install 'numa-moe\[plot\]'"):
        plot_placement(report, tmp_path / "x.png")
