"""Read-once loads from a real S3 server (SeaweedFS on loopback): replicated state loaded by 3
gloo ranks asks the server for each byte once in the job (DISTCKPT_READ_ONCE=auto turns it on for
an object store), bit-exact; with it off every rank asks for all of it."""

from __future__ import annotations

import pytest

from tests.helpers.distributed import run_ranks
from tests.protocol.test_read_once import _PRELOAD, _model, _zeros

pytestmark = pytest.mark.timeout(300)


def _save(rank, world, url, opts):
    import distckpt
    distckpt.save(_model(), url, storage_options=opts)


def _load(rank, world, url, opts):
    import torch

    import distckpt
    sd = _zeros()
    res = distckpt.load(sd, url, storage_options=opts)
    for k, v in _model().items():
        assert torch.equal(sd[k], v), k
    m = distckpt.restore.load_manifest(url, storage_options=opts)
    size = sum(f.size for f in m.files)
    return res.bytes_read, res.bytes_from_peers, size, res.backend


def test_replicated_load_from_s3_asks_for_each_byte_once(s3_bucket):
    url, opts = s3_bucket.url + "/ro", s3_bucket.storage_options
    run_ranks(_save, 2, url, opts, env={"DISTCKPT_TIMEOUT_S": "60"}, preload=_PRELOAD)
    got = run_ranks(_load, 3, url, opts, env={"DISTCKPT_TIMEOUT_S": "60"}, preload=_PRELOAD)   # auto
    size = got[0][2]
    assert all(b.startswith("fsspec") for *_, b in got), got
    assert sum(r for r, *_ in got) <= 1.05 * size, got
    assert all(p > 0 for _, p, *_ in got), got
    off = run_ranks(_load, 3, url, opts, env={"DISTCKPT_TIMEOUT_S": "60", "DISTCKPT_READ_ONCE": "off"},
                    preload=_PRELOAD)
    assert sum(r for r, *_ in off) >= 0.95 * 3 * size, off
