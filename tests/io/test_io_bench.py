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
