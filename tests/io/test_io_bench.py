"""The I/O benchmark runs end to end (tiny size), reports every row, and leaves no file behind."""

import io
import os

from distckpt import bench


def test_parse_size():
    assert bench.parse_size("1G") == 1 << 30
    assert bench.parse_size("256M") == 256 << 20
    assert bench.parse_size("4096") == 4096
    assert bench.parse_size("1GiB") == 1 << 30


def test_run_io_bench_small(tmp_path):
    out = io.StringIO()
    result = bench.run_io_bench(tmp_path, 8 << 20, repeat=2, baseline="loop", out=out)
    rows = result["rows"]
    assert set(rows) == {"uring", bench.ZERO_COPY, "pwrite", "buffered", "O_DIRECT pwrite loop"}
    assert all(r["median_mbps"] > 0 and len(r["seconds"]) == 2 for r in rows.values())
    assert rows["O_DIRECT pwrite loop"]["ratio"] == 1.0
    text = out.getvalue()
    assert "| uring (aligned src, zero-copy)  |" in text and "vs baseline" in text
    assert os.listdir(tmp_path) == []


def _bench_module():
    import importlib.util
    import sys
    here = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "launch", "bench")
    spec = importlib.util.spec_from_file_location("bench_harness", os.path.join(here, "bench.py"))
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("bench_harness", mod)
    spec.loader.exec_module(mod)
    return mod, here


def test_a_baseline_child_runs_the_other_checkout_or_refuses(tmp_path):
    """launch/bench's --baseline-repo child imports distckpt from the other checkout, and says
    so; one that would import this checkout instead (it did, silently, until the harness put the
    other checkout first) is refused rather than timed as the baseline."""
    import shutil

    import pytest

    import distckpt
    harness, here = _bench_module()
    other = tmp_path / "other"
    shutil.copytree(os.path.dirname(distckpt.__file__), other / "distckpt",
                    ignore=shutil.ignore_patterns("__pycache__"))
    work = tmp_path / "work"
    work.mkdir()
    argv = [str(work), "--serve", "--size", "8M", "--small", "2", "--large", "1"]
    child = harness.BaselineChild(os.path.join(here, "bench_save.py"), "BENCH_SAVE_REPO", str(other), argv)
    try:
        assert child.call("save")["s"] > 0
    finally:
        child.close()
    empty = tmp_path / "empty"   # no distckpt there: the child would fall back to this checkout's
    empty.mkdir()
    with pytest.raises(RuntimeError, match="imported distckpt from .* not from"):
        harness.BaselineChild(os.path.join(here, "bench_save.py"), "BENCH_SAVE_REPO", str(empty), argv)
