"""TorchRec raw state dicts through plain distckpt.save/load (issue 10 item 2), as TorchRec documents
them for DCP: ``{"model": dmp.state_dict(), "optim": dmp.fused_optimizer.state_dict(), ...}``.

The fused optimizer's state exists only on the ranks owning a table (a table-wise table's other
ranks have no key at all), so this needs the key union. Table-wise, column-wise, row-wise and
data-parallel tables with EXACT_ADAGRAD (pointwise state: it reshards like the weight), 2 -> 1 and
1 -> 2 ranks on other plans. A row-wise optimizer's raw state ([rows * column blocks]) across a
changed column split cannot be resharded exactly: ReshardError naming the TorchRec integration.
"""

from __future__ import annotations

import pytest
import torch

import distckpt
from distckpt import errors
from tests.helpers.distributed import run_ranks

pytest.importorskip("torchrec")
pytest.importorskip("fbgemm_gpu")

from tests.interop import test_torchrec as T  # noqa: E402

OPT = {t: "adagrad" for t in T.ROWS}
OPT["e"] = "rowwise"  # EXACT_ROWWISE_ADAGRAD: its raw state depends on the column split
P_TWO = {"a": "table_wise:1", "b": "column_wise:0,1", "c": "row_wise", "d": "data_parallel",
         "e": "column_wise:0,1", "f": "table_wise:0"}
P_ONE = {"a": "row_wise", "b": "table_wise:0", "c": "column_wise:0,0", "d": "data_parallel",
         "e": "column_wise:0,0", "f": "row_wise"}
P_TWO_OTHER = {"a": "column_wise:1,0", "b": "row_wise", "c": "table_wise:1", "d": "data_parallel",
               "e": "column_wise:1,0", "f": "column_wise:0,1"}
P_TWO_MERGED = dict(P_TWO_OTHER, e="table_wise:0")  # e's 2 column blocks -> 1


def _raw(dmp, dense):
    return {"model": dmp.state_dict(), "optim": dmp.fused_optimizer.state_dict(), "dense_optim": dense.state_dict(),
            "step": 2}


def _apply(dmp, dense, sd):
    dmp.load_state_dict(sd["model"])
    dmp.fused_optimizer.load_state_dict(sd["optim"])
    dense.load_state_dict(sd["dense_optim"])


def _save_two(rank, world, root):
    dmp, dense = T.build(rank, world, P_TWO, opt=OPT)
    for step in range(2):
        T.train(dmp, dense, step, rank, world)
    sd = _raw(dmp, dense)
    owned = sorted(sd["optim"]["state"])
    distckpt.save(sd, f"{root}/two")
    return owned, T.forward_all(dmp, 9, rank, world)


def _one(rank, world, root):
    dmp, dense = T.build(rank, world, P_ONE, opt=OPT)
    sd = _raw(dmp, dense)
    distckpt.load(sd, f"{root}/two")
    _apply(dmp, dense, sd)
    distckpt.save(_raw(dmp, dense), f"{root}/one")
    return T.forward_all(dmp, 9, rank, world)


def _back_to_two(rank, world, root):
    dmp, dense = T.build(rank, world, P_TWO_MERGED, opt=OPT)
    with pytest.raises(errors.DistCkptError) as ei:
        distckpt.load(_raw(dmp, dense), f"{root}/one")
    # Only the rank holding e's state fails; every rank raises its error's class, with ``failures``.
    failures = ei.value.failures if ei.value.failures is not None else {rank: ei.value}
    merged_error = ({r: type(e).__name__ for r, e in failures.items()}, " ".join(str(e) for e in failures.values()))
    dmp, dense = T.build(rank, world, P_TWO_OTHER, opt=OPT)
    sd = _raw(dmp, dense)
    distckpt.load(sd, f"{root}/one")
    _apply(dmp, dense, sd)
    distckpt.save(_raw(dmp, dense), f"{root}/two_again")
    return merged_error, T.forward_all(dmp, 9, rank, world)


def _same(a, b, path=""):
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b), path
    elif isinstance(a, dict):
        assert sorted(a) == sorted(b), (path, sorted(a), sorted(b))
        for k in a:
            _same(a[k], b[k], f"{path}.{k}")
    else:
        assert a == b, path


def test_raw_torchrec_state_dicts_two_to_one_and_back(tmp_path):
    (owned0, out_two), (owned1, _) = run_ranks(_save_two, 2, str(tmp_path), timeout=300)
    # The fused state of table-wise tables exists on their owner only: the ranks' keys differ.
    assert "ebc.embedding_bags.a.weight" in owned1 and "ebc.embedding_bags.a.weight" not in owned0
    assert "ec.embeddings.f.weight" in owned0 and "ec.embeddings.f.weight" not in owned1
    (out_one,) = run_ranks(_one, 1, str(tmp_path), timeout=300)
    (err0, out_back), (err1, _) = run_ranks(_back_to_two, 2, str(tmp_path), timeout=300)
    assert err0 == err1 and set(err0[0].values()) == {"ReshardError"}
    assert "distckpt.integrations.torchrec" in err0[1] and "e.momentum1" in err0[1]
    two, one, back = (distckpt.read(tmp_path / n) for n in ("two", "one", "two_again"))
    _same(two, one)  # every weight and optimizer state tensor, bit for bit, after 2 -> 1
    _same(two, back)  # and after 1 -> 2 on another plan
    assert torch.equal(out_two, out_one) and torch.equal(out_two, out_back)
