"""DISTCKPT_READ_CACHE: how a load reads the uncached pages of a data file
(distckpt.storage.posix.readcache), read and validated like the other variables."""

from __future__ import annotations

import pytest

from distckpt.config import KNOWN_VARIABLES, load_config
from distckpt.errors import ConfigError
from distckpt.storage.posix import readcache


def test_read_cache_default_and_values():
    assert load_config({}).read_cache == "auto"
    assert load_config({"DISTCKPT_READ_CACHE": ""}).read_cache == "auto"
    for mode in ("auto", "cache", "direct"):
        assert load_config({"DISTCKPT_READ_CACHE": mode}).read_cache == mode
    assert "DISTCKPT_READ_CACHE" in KNOWN_VARIABLES


@pytest.mark.parametrize("raw", ["buffered", "AUTO", "1", "o_direct"])
def test_read_cache_bad_values_are_config_errors(raw):
    with pytest.raises(ConfigError) as info:
        load_config({"DISTCKPT_READ_CACHE": raw})
    assert "DISTCKPT_READ_CACHE" in str(info.value) and "auto, cache, direct" in str(info.value)


def test_auto_reads_through_the_cache_only_what_fits(monkeypatch):
    room = 8 << 30
    monkeypatch.setattr(readcache, "page_cache_room", lambda: room)
    fit = room // readcache.FIT_FRACTION
    assert readcache.reads_through_cache(fit, "auto")
    assert not readcache.reads_through_cache(fit + 1, "auto")
    assert readcache.reads_through_cache(1 << 40, "cache")
    assert not readcache.reads_through_cache(0, "direct")
    with pytest.raises(ValueError):
        readcache.reads_through_cache(0, "sometimes")


def test_auto_without_meminfo_reads_direct(monkeypatch):
    monkeypatch.setattr(readcache, "page_cache_room", lambda: 0)
    assert not readcache.reads_through_cache(1, "auto")


def test_page_cache_room_is_memavailable(monkeypatch):
    monkeypatch.setattr(readcache, "_cgroup_limit", lambda: None)  # a container's limit aside
    readcache._room = None
    with open("/proc/meminfo") as f:
        avail = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    assert abs(readcache.page_cache_room() - avail) < avail // 4 + (256 << 20)


def test_a_memory_cgroup_limit_bounds_the_room(monkeypatch):
    with open("/proc/meminfo") as f:
        avail = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    assert avail > 64 << 20
    readcache._room = None
    monkeypatch.setattr(readcache, "_cgroup_limit", lambda: 64 << 20)
    assert readcache.page_cache_room() == 64 << 20  # the smaller of the two
    readcache._room = None
    monkeypatch.setattr(readcache, "_cgroup_limit", lambda: 1 << 50)
    assert abs(readcache.page_cache_room() - avail) < avail // 4 + (256 << 20)  # MemAvailable
    readcache._room = None


@pytest.mark.parametrize("files, want", [
    ({"/proc/self/cgroup": "0::/job7\n", "/sys/fs/cgroup/job7/memory.max": "1073741824\n"}, 1 << 30),
    ({"/proc/self/cgroup": "0::/job7\n", "/sys/fs/cgroup/job7/memory.max": "max\n"}, None),
    ({"/proc/self/cgroup": "5:cpu:/\n4:memory:/job7\n",
      "/sys/fs/cgroup/memory/job7/memory.limit_in_bytes": "2147483648\n"}, 2 << 30),
    ({"/proc/self/cgroup": "4:memory:/job7\n",
      "/sys/fs/cgroup/memory/job7/memory.limit_in_bytes": "9223372036854771712\n"}, None),
    ({"/proc/self/cgroup": "4:memory:/job7\n"}, None),  # the limit file cannot be read
    ({"/proc/self/cgroup": "garbage\n0::/job7\n", "/sys/fs/cgroup/job7/memory.max": "4096\n"}, 4096),
], ids=("v2", "v2-max", "v1", "v1-unlimited", "unreadable", "malformed-line"))
def test_cgroup_limit_parses_v1_and_v2(monkeypatch, files, want):
    import io

    def fake_open(path, *a, **k):
        if path not in files:
            raise FileNotFoundError(path)
        return io.StringIO(files[path])
    monkeypatch.setattr(readcache, "open", fake_open, raising=False)
    assert readcache._cgroup_limit() == want
