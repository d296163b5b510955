import os

import pytest

# Every test sees the configuration the run was started with, never a cached one from another test.
@pytest.fixture(autouse=True)
def _fresh_config():
    from distckpt.config import get_config
    get_config.cache_clear()
    yield
    get_config.cache_clear()


def open_fds() -> dict[int, str]:
    """The fds this process has open right now: {fd: target}."""
    out = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            out[int(name)] = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            pass
    return out
