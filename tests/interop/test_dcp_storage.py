"""distckpt as DCP's storage layer (distckpt.integrations.dcp): ``dcp.save`` / ``dcp.load`` /
``dcp.async_save`` with DistCkptStorageWriter / DistCkptStorageReader on real gloo ranks.

DCP's planner decides the layout; what is written is a distckpt checkpoint (verify, read and
distckpt.load understand it), nothing is visible before DCP's ``finish``, failures are distckpt's
typed errors (inside DCP's CheckpointException), and loading runs no code from the checkpoint.
The FSDP2 + HF Llama comparison against DCP's FileSystemWriter at 2 -> 1 and 3 ranks is in
test_fsdp2_hf.py (the same job, a third way of saving)."""

from __future__ import annotations

import io
import os
import random
import re
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

import distckpt
from distckpt.errors import ChecksumMismatchError, ConfigError, PickleNotAllowedError
from distckpt.integrations.dcp import DistCkptStorageReader, DistCkptStorageWriter
from tests.helpers.distributed import free_port, run_ranks


def _failure(exc: CheckpointException) -> BaseException:
    """The one exception type every rank of a failed dcp.save/load raised (DCP wraps them)."""
    kinds = {type(e) for e, _tb in exc.failures.values()}
    assert len(kinds) == 1, kinds
    return next(iter(exc.failures.values()))[0]


def _state(rank: int, world: int, seed: int) -> dict:
    """A DTensor-sharded state (rows split over the ranks, uneven at 3), a replicated plain tensor
    (DCP's planner writes it once), a bf16 scalar and non-tensor values."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    g = torch.Generator().manual_seed(seed)
    full = torch.randn(10, 6, generator=g)
    mesh = init_device_mesh("cpu", (world,))
    return {"w": distribute_tensor(full, mesh, [Shard(0)]), "shared": torch.arange(12, dtype=torch.int64) * seed,
            "scale": torch.tensor(seed / 3, dtype=torch.bfloat16),
            "meta": {"step": seed, "name": f"run{seed}", "betas": (0.9, 0.95)}}


def _full(state: dict) -> dict:
    return {"w": state["w"].full_tensor(), "shared": state["shared"].clone(), "scale": state["scale"].clone(),
            "meta": state["meta"]}


def _save_then_load_body(rank, world, root):
    state = _state(rank, world, seed=5)
    dcp.save(state, storage_writer=DistCkptStorageWriter(f"{root}/ck"))
    # The same state, async (thread mode): staged, then written and committed in the background.
    fut = dcp.async_save(state, storage_writer=DistCkptStorageWriter(f"{root}/ck_async"))
    fut.result(timeout=120)
    # Saving over a committed checkpoint without overwrite: CheckpointExistsError on every rank.
    try:
        dcp.save(state, storage_writer=DistCkptStorageWriter(f"{root}/ck"))
        exists = None
    except CheckpointException as exc:
        exists = type(_failure(exc)).__name__
    # A value only rank 1 holds that DCP cannot serialize: rank 1 fails before distckpt's
    # collectives, rank 0 must not wait for it until a timeout: both raise at once, nothing saved.
    bad = dict(state, meta={**state["meta"], "fn": (lambda: 0) if rank == 1 else 0})
    t0 = time.monotonic()
    try:
        dcp.save(bad, storage_writer=DistCkptStorageWriter(f"{root}/bad"))
        unpicklable = None
    except CheckpointException as exc:
        unpicklable = (sorted(exc.failures), type(exc.failures[rank][0]).__name__, time.monotonic() - t0)
    return _full(state), exists, unpicklable


def _load_body(rank, world, root):
    out = []
    for name in ("ck", "ck_async"):
        state = _state(rank, world, seed=99)  # other values, same structure, this world size
        dcp.load(state, storage_reader=DistCkptStorageReader(f"{root}/{name}"))
        out.append(_full(state))
    return out


def _same(a: dict, b: dict) -> None:
    for k in ("w", "shared", "scale"):
        assert a[k].dtype == b[k].dtype and torch.equal(a[k].view(-1).view(torch.uint8), b[k].view(-1).view(torch.uint8)), k
    assert a["meta"] == b["meta"]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("dcpw")
    results = run_ranks(_save_then_load_body, 2, str(root), timeout=240)
    return root, results


def test_dcp_save_writes_a_distckpt_checkpoint_that_dcp_loads_at_other_world_sizes(saved):
    root, results = saved
    (saved_state, exists, unpicklable), (_, _, unpicklable1) = results
    assert exists == "CheckpointExistsError"  # on every rank; the checkpoint untouched
    for ranks, kind, seconds in (unpicklable, unpicklable1):
        assert ranks == [0, 1] and kind in ("DistCkptError", "RankFailureError") and seconds < 30, (ranks, kind, seconds)
    assert not (root / "bad").exists()
    # A distckpt checkpoint: MANIFEST + one data file per rank, verify passes, read gives DCP's fqns.
    assert sorted(os.listdir(root / "ck")) == ["MANIFEST", "rank00000.bin", "rank00001.bin"]
    assert not [n for n in os.listdir(root) if n.startswith(".")], os.listdir(root)  # no leftovers
    out = subprocess.run([sys.executable, "-m", "distckpt", "verify", str(root / "ck")], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    flat = distckpt.read(root / "ck")
    assert torch.equal(flat["w"], saved_state["w"]) and torch.equal(flat["shared"], saved_state["shared"])
    # Values are stored as DCP's torch.save bytes and read back decoded, as dcp.load decodes them.
    assert flat["meta.step"] == 5 and flat["meta.betas"] == (0.9, 0.95)
    for world in (1, 3):
        for per_rank in run_ranks(_load_body, world, str(root), timeout=240):
            for loaded in per_rank:
                _same(loaded, saved_state)


def _no_dist_body(rank, world, root):
    import torch.distributed as dist
    os.environ["DISTCKPT_TIMEOUT_S"] = "20"  # a collective over the job fails (PeerLostError) at 20 s
    from distckpt.config import get_config
    get_config.cache_clear()
    if rank == 0:  # one process of the job saves alone (DCP's no_dist), the other is elsewhere
        dcp.save({"x": torch.arange(4.0), "step": 3}, storage_writer=DistCkptStorageWriter(f"{root}/alone"),
                 no_dist=True)
    dist.barrier()
    # Every rank saves its own checkpoint alone.
    dcp.save({"x": torch.full((3,), float(rank)), "rank": rank},
             storage_writer=DistCkptStorageWriter(f"{root}/own{rank}"), no_dist=True)
    dist.barrier()
    loaded = {"x": torch.zeros(3), "rank": -1}
    distckpt.load(loaded, f"{root}/own{1 - rank}", no_dist=True)
    return loaded["rank"], loaded["x"].tolist()


def test_dcp_save_with_no_dist_in_a_running_job_saves_alone(tmp_path):
    """dcp.save(no_dist=True) inside a job of two ranks: DCP makes each caller a coordinator of
    rank 0 with use_collectives=True; the writer must save alone, not wait for the other rank."""
    results = run_ranks(_no_dist_body, 2, str(tmp_path), timeout=120)
    for rank, (other, x) in enumerate(results):
        assert other == 1 - rank and x == [float(1 - rank)] * 3, rank
    out = {"x": torch.zeros(4), "step": 0}
    distckpt.load(out, tmp_path / "alone", no_dist=True)
    assert out["step"] == 3 and out["x"].tolist() == [0.0, 1.0, 2.0, 3.0]


def test_dcp_async_save_in_process_and_thread_modes(tmp_path):
    """DCP's two async modes through torchrun (the process mode pickles the writer to a background
    process per rank, which saves on a process group of its own)."""
    worker = os.path.join(os.path.dirname(__file__), "..", "helpers", "dcp_async_worker.py")
    # A port of its own: torchrun's default (29500) may be held by another job on the machine.
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
                          "--master-addr", "127.0.0.1", "--master-port", str(free_port()), worker,
                          str(tmp_path)], capture_output=True, text=True, timeout=240,
                         env=dict(os.environ, PYTHONPATH=os.getcwd()))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    # torchrun merges the ranks' stdout: two ranks' lines may share one line of it.
    lines = sorted(re.findall(r"OK \w+ \d+ \S+ \d+", out.stdout))
    assert lines == sorted(f"OK {m} {r} 780.0 5" for m in ("process", "thread") for r in (0, 1)), out.stdout
    for mode in ("process", "thread"):
        assert sorted(os.listdir(tmp_path / mode)) == ["MANIFEST", "rank00000.bin", "rank00001.bin"]


def test_dcp_load_through_the_reader_reads_native_and_filesystemwriter_checkpoints(tmp_path):
    """One process (DCP's no-process-group mode): the reader also serves a checkpoint written by
    distckpt.save and a directory written by DCP's own FileSystemWriter."""
    src = {"a": torch.randn(4, 3), "b": torch.arange(5), "n": 3, "s": "x"}
    distckpt.save(src, tmp_path / "native")
    dcp.save(src, checkpoint_id=str(tmp_path / "fsw"))
    for name in ("native", "fsw"):
        dst = {"a": torch.zeros(4, 3), "b": torch.zeros(5, dtype=torch.int64), "n": 0, "s": ""}
        dcp.load(dst, storage_reader=DistCkptStorageReader(tmp_path / name))
        assert torch.equal(dst["a"], src["a"]) and torch.equal(dst["b"], src["b"]), name
        assert (dst["n"], dst["s"]) == (3, "x"), name


def test_distckpt_load_and_read_decode_the_values_the_writer_stored_as_dcp_does(tmp_path):
    """The writer stores DCP's torch.save bytes for each value; distckpt.load and read hand back
    the values (as dcp.load does), never the archive's bytes."""
    src = {"w": torch.arange(4.0), "step": 7, "lst": [1, "two"], "nested": {"a": [1, 2], "b": b"raw"},
           "cfg": {"lr": 0.5, "betas": (0.9, 0.99)}}
    dcp.save(src, storage_writer=DistCkptStorageWriter(tmp_path / "ck"))
    dst = {"w": torch.zeros(4), "step": 0, "lst": [], "nested": {"a": [], "b": b""}, "cfg": {"lr": 0.0, "betas": ()}}
    distckpt.load(dst, tmp_path / "ck", no_dist=True)
    assert torch.equal(dst["w"], src["w"])
    assert (dst["step"], dst["lst"], dst["nested"], dst["cfg"]) == (7, [1, "two"], {"a": [1, 2], "b": b"raw"},
                                                                    {"lr": 0.5, "betas": (0.9, 0.99)})
    flat = distckpt.read(tmp_path / "ck")
    assert flat["step"] == 7 and flat["nested.b"] == b"raw" and flat["cfg.betas"] == (0.9, 0.99)
    # A value the restricted unpickler refuses is refused by name, not returned as bytes.
    dcp.save({"t": torch.ones(2), "evil": _Evil()}, storage_writer=DistCkptStorageWriter(tmp_path / "bad"))
    with pytest.raises(PickleNotAllowedError) as info:
        distckpt.load({"t": torch.zeros(2), "evil": None}, tmp_path / "bad", no_dist=True)
    assert info.value.keys == ["evil"]
    # What the restricted unpickler refused, named; torch's terminal escapes stripped.
    dcp.save({"t": torch.ones(2), "bio": io.BytesIO(b"raw")}, storage_writer=DistCkptStorageWriter(tmp_path / "bio"))
    with pytest.raises(PickleNotAllowedError) as info:
        distckpt.load({"t": torch.zeros(2), "bio": None}, tmp_path / "bio", no_dist=True)
    assert info.value.keys == ["bio"] and "BytesIO" in str(info.value), str(info.value)
    assert "\x1b" not in str(info.value), repr(str(info.value))


def test_a_planner_that_rebuilds_the_state_dict_from_the_metadata_gets_its_nesting(tmp_path):
    """DCP's load-everything helpers (_EmptyStateDictLoadPlanner) nest keys by the metadata's
    planner_data: the reader gives it for every kind of checkpoint, as FileSystemReader does, and
    in the saved order (it gave tensors first, and a distckpt.save checkpoint's leaves reversed)."""
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys
    src = {"step": 3, "model": {"w": torch.arange(4.0), "sub": {"b": torch.ones(2)}, "name": "m",
                                "layers": [torch.zeros(1), torch.ones(1)]}}
    distckpt.save(src, tmp_path / "native")
    dcp.save(src, checkpoint_id=str(tmp_path / "fsw"))
    dcp.save(src, storage_writer=DistCkptStorageWriter(tmp_path / "writer"))
    want = _load_state_dict_from_keys(storage_reader=dcp.FileSystemReader(str(tmp_path / "fsw")))
    assert list(want) == ["step", "model"] and list(want["model"]) == ["w", "sub", "name", "layers"]
    for name in ("native", "fsw", "writer"):
        got = _load_state_dict_from_keys(storage_reader=DistCkptStorageReader(tmp_path / name))
        assert list(got) == ["step", "model"] and got["step"] == 3, (name, list(got))
        assert list(got["model"]) == ["w", "sub", "name", "layers"], (name, list(got["model"]))
        assert torch.equal(got["model"]["sub"]["b"], torch.ones(2)) and torch.equal(got["model"]["w"], src["model"]["w"])
        assert [t.item() for t in got["model"]["layers"]] == [0.0, 1.0], name


@pytest.mark.parametrize("path_of_a_w", ["xyz", [], 5, [0, "w"], ["b"], ["b", "x"], [["a"], "w"]])
def test_planner_data_whose_paths_do_not_lead_to_their_keys_is_corrupt(tmp_path, path_of_a_w):
    """A crafted planner_data path nested "a.w" as x.y.z (DCP: "Missing key"), failed in DCP's
    planner (IndexError, TypeError), or put "a.w" where "b" is (a.w silently lost). Now the reader's
    read_metadata refuses it: CheckpointCorruptError naming the key."""
    from distckpt.errors import CheckpointCorruptError
    good = tmp_path / "good"
    dcp.save({"a": {"w": torch.arange(4.0)}, "b": torch.ones(2)}, storage_writer=DistCkptStorageWriter(good),
             no_dist=True)
    user = distckpt.read_manifest(good)["meta"]["user"]
    assert DistCkptStorageReader(good).read_metadata().planner_data == {"a.w": ("a", "w"), "b": ("b",)}
    crafted = tmp_path / "crafted"
    planner = {"t": "dict", "k": [["a.w", path_of_a_w], ["b", ["b"]]]}
    distckpt.save(distckpt.read(good), crafted, no_dist=True,
                  metadata={**user, "distckpt.dcp": {**user["distckpt.dcp"], "planner_data": ["value", planner]}})
    with pytest.raises(CheckpointCorruptError, match="'a.w'"):
        DistCkptStorageReader(crafted).read_metadata()


@pytest.mark.parametrize("state", [
    {"optim": {"state": {0: {"exp_avg": torch.ones(2)}, 1: {"exp_avg": torch.full((2,), 3.0)}}}},
    {"optim": {"state": {1: {"exp_avg": torch.ones(2)}, 3: {"exp_avg": torch.full((2,), 3.0)}}}},
    {"d": {0: torch.zeros(1), "a": torch.ones(1)}, "l": [torch.ones(1), {5: torch.zeros(2)}]},
], ids=["dense-int-keys", "sparse-int-keys", "mixed-keys-and-a-list"])
def test_int_dict_keys_of_a_distckpt_save_nest_as_dcp_names_them(tmp_path, state):
    """DCP names every dict key by str(key) and reads an int in a planner_data path as a list
    position. The reader gave a distckpt.save checkpoint's int dict keys as ints: a raw optimizer
    state {0: .., 1: ..} came back as a list through DCP's load-everything helpers (silently), and
    {1: .., 3: ..} or {0: .., "a": ..} failed untyped in DCP's set_element. Now it nests as
    FileSystemReader nests the same state saved by dcp.save."""
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys
    distckpt.save(state, tmp_path / "native", no_dist=True)
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(tmp_path / "fsw")), no_dist=True)
    want = _load_state_dict_from_keys(storage_reader=dcp.FileSystemReader(str(tmp_path / "fsw")))
    got = _load_state_dict_from_keys(storage_reader=DistCkptStorageReader(tmp_path / "native"))

    def same(a, b) -> bool:
        if isinstance(a, torch.Tensor):
            return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
        if isinstance(a, dict):
            return isinstance(b, dict) and list(a) == list(b) and all(same(a[k], b[k]) for k in a)
        if isinstance(a, list):
            return isinstance(b, list) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
        return type(a) is type(b) and a == b

    assert same(want, got), (want, got)


@pytest.mark.parametrize("state, paths", [
    ({"x": {"0": torch.zeros(1), "1000000000000": torch.ones(1)}}, {"x.0": ["x", 0], "x.1000000000000": ["x", 10**12]}),
    ({"x": {"-1": torch.zeros(1)}}, {"x.-1": ["x", -1]}),
    ({"x": {"0": torch.zeros(1), "a": torch.ones(1)}}, {"x.0": ["x", 0], "x.a": ["x", "a"]}),
    ({"x": torch.zeros(1), "x.y": torch.ones(1)}, {"x": ["x"], "x.y": ["x", "y"]}),
    ({"x.y": torch.ones(1), "x": torch.zeros(1)}, {"x.y": ["x", "y"], "x": ["x"]}),
], ids=["huge-list-position", "negative-position", "a-list-and-a-dict-at-once", "a-value-then-a-container",
        "a-container-then-a-value"])
def test_planner_data_paths_that_build_no_tree_are_corrupt(tmp_path, state, paths):
    """Paths that each join back to their key but together build no state dict: a list position
    of 10**12 (DCP's set_element pads the list with None up to it: memory exhausted), a negative
    one (IndexError), one container reached by an int and a str key, one key both a value and a
    container (TypeError in set_element, or a value silently replaced). CheckpointCorruptError."""
    from distckpt.errors import CheckpointCorruptError
    crafted = tmp_path / "crafted"
    planner = {"t": "dict", "k": [[k, v] for k, v in paths.items()]}
    distckpt.save(state, crafted, no_dist=True,
                  metadata={"distckpt.dcp": {"version": "1.0.0", "planner_data": ["value", planner]}})
    with pytest.raises(CheckpointCorruptError, match="planner data gives"):
        DistCkptStorageReader(crafted).read_metadata()


def test_a_list_of_many_empty_dicts_saved_through_the_writer_loads_through_the_reader(tmp_path):
    """A list whose entry 1100 holds a tensor after 1,100 empty dicts (which have no keys in DCP's
    planner data): the writer saved it and the reader refused it as damaged (a list position more
    than 1,024 past its keys; an outside trial), though FileSystemReader loads it. The reader
    bounds the places left without a key over all lists (memory), not per list."""
    from distckpt.integrations.dcp import DistCkptStorageWriter
    state = {"experts": [{} for _ in range(1100)] + [{"w": torch.arange(4.0)}]}
    dcp.save(state, storage_writer=DistCkptStorageWriter(tmp_path / "mine"), no_dist=True)
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(tmp_path / "fsw")), no_dist=True)
    from torch.distributed.checkpoint import DefaultLoadPlanner
    for reader in (dcp.FileSystemReader(str(tmp_path / "fsw")), DistCkptStorageReader(tmp_path / "mine")):
        dest = {"experts": [{} for _ in range(1100)] + [{"w": torch.zeros(4)}]}
        # allow_partial_load: DCP itself does not ask for the empty dicts' keys
        dcp.load(dest, storage_reader=reader, planner=DefaultLoadPlanner(allow_partial_load=True), no_dist=True)
        assert torch.equal(dest["experts"][1100]["w"], torch.arange(4.0)), reader


def _subgroup_body(rank: int, world: int, root: str) -> str | None:
    import torch.distributed as dist
    group = dist.new_group([0, 1])
    out = None
    if rank in (0, 1):
        try:
            dcp.save({f"r{rank}": torch.ones(2), "w": torch.arange(4.0)}, process_group=group,
                     storage_writer=DistCkptStorageWriter(os.path.join(root, "untold")))
            out = "saved"
        except CheckpointException as exc:
            out = type(_failure(exc)).__name__
        # told the group, it saves
        dcp.save({f"r{rank}": torch.ones(2), "w": torch.arange(4.0)}, process_group=group,
                 storage_writer=DistCkptStorageWriter(os.path.join(root, "told"), process_group=group))
    dist.barrier()
    return out


def test_dcp_save_on_a_subgroup_the_writer_was_not_told_of_fails_at_once(tmp_path):
    """dcp.save(process_group=G) through a writer made without process_group=G: the writer's
    collectives ran over the world and waited for ranks that were not saving until
    DISTCKPT_TIMEOUT_S, then blamed a lost peer (an outside trial), where FileSystemWriter saves.
    The coordinator sees fewer plans than its group has ranks: ConfigError on every saving rank at
    once, saying to pass the group; told the group, the same save succeeds."""
    results = run_ranks(_subgroup_body, 3, str(tmp_path), env={"DISTCKPT_TIMEOUT_S": "120"}, timeout=240)
    # the class says it: the old code's wait ended in PeerLostError after DISTCKPT_TIMEOUT_S
    assert results[0] == results[1] == "ConfigError", results
    assert not (tmp_path / "untold").exists()
    assert sorted(distckpt.read(tmp_path / "told")) == ["r0", "r1", "w"]


def test_no_path_and_a_dcp_directory_in_the_way_are_typed_errors_saying_so(tmp_path):
    """The writer without a path said "checkpoint path None is a NoneType" (the reader: "no
    checkpoint path"); overwrite=True over a FileSystemWriter directory is refused (distckpt
    replaces only its own checkpoints), its message saying what is there and the old files kept."""
    with pytest.raises(CheckpointException) as info:
        dcp.save({"t": torch.ones(1)}, storage_writer=DistCkptStorageWriter(), no_dist=True)
    err = _failure(info.value)
    assert isinstance(err, ConfigError) and "no checkpoint path" in err.message, err
    assert "checkpoint_id=path" in err.remedy
    dcp.save({"t": torch.ones(2)}, checkpoint_id=str(tmp_path / "ck"), no_dist=True)
    before = sorted(os.listdir(tmp_path / "ck"))
    with pytest.raises(CheckpointException) as info:
        dcp.save({"t": torch.zeros(2)}, storage_writer=DistCkptStorageWriter(tmp_path / "ck", overwrite=True),
                 no_dist=True)
    err = _failure(info.value)
    assert isinstance(err, distckpt.errors.CheckpointExistsError) and "torch.distributed.checkpoint" in err.message
    assert sorted(os.listdir(tmp_path / "ck")) == before
    back = {"t": torch.zeros(2)}
    dcp.load(back, checkpoint_id=str(tmp_path / "ck"), no_dist=True)
    assert torch.equal(back["t"], torch.ones(2))


class _Evil:
    """A value whose unpickling would call os.system: torch's restricted unpickler refuses it."""

    def __reduce__(self):
        return (os.system, ("echo owned > /dev/null",))


def test_a_value_that_would_run_code_is_refused_and_a_flipped_bit_is_a_checksum_error(tmp_path):
    dcp.save({"t": torch.ones(64, 64), "evil": _Evil()}, storage_writer=DistCkptStorageWriter(tmp_path / "ck"))
    with pytest.raises(CheckpointException) as info:
        dcp.load({"t": torch.zeros(64, 64), "evil": None}, storage_reader=DistCkptStorageReader(tmp_path / "ck"))
    err = _failure(info.value)
    assert isinstance(err, PickleNotAllowedError) and err.keys == ["evil"]
    # Tensors alone load; then one flipped bit in the data file is a typed checksum error.
    dst = {"t": torch.zeros(64, 64)}
    dcp.load(dst, storage_reader=DistCkptStorageReader(tmp_path / "ck"))
    assert torch.equal(dst["t"], torch.ones(64, 64))
    data = tmp_path / "ck" / "rank00000.bin"
    raw = bytearray(data.read_bytes())
    raw[100] ^= 0x01  # inside the first chunk (chunks start at aligned offsets from 0)
    data.write_bytes(bytes(raw))
    with pytest.raises(CheckpointException) as info:
        dcp.load({"t": torch.zeros(64, 64)}, storage_reader=DistCkptStorageReader(tmp_path / "ck"))
    assert isinstance(_failure(info.value), ChecksumMismatchError)
    with pytest.raises(ConfigError):
        DistCkptStorageWriter(tmp_path / "x", metadata={"distckpt.dcp": 1})


_KILL_WORKER = textwrap.dedent("""
    import sys, torch, torch.distributed.checkpoint as dcp
    from distckpt.integrations.dcp import DistCkptStorageWriter
    path, first = sys.argv[1], int(sys.argv[2])
    print("ready", flush=True)
    for v in range(first, first + 1000):
        state = {"t": torch.full((256, 1024), float(v)), "v": v}
        dcp.save(state, storage_writer=DistCkptStorageWriter(path, overwrite=True))
        print("saved", v, flush=True)
""")


@pytest.mark.slow
def test_dcp_save_killed_at_random_times_leaves_the_previous_checkpoint_or_the_new_one(tmp_path):
    """SIGKILL at random points of repeated dcp.save(overwrite) calls: the path always holds one
    complete checkpoint (verify passes, every element equals its saved value), never a mix."""
    path = tmp_path / "ck"
    dcp.save({"t": torch.full((256, 1024), 0.0), "v": 0}, storage_writer=DistCkptStorageWriter(path))
    rng = random.Random(7)
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    committed = {0}
    for kill in range(4):
        proc = subprocess.Popen([sys.executable, "-c", _KILL_WORKER, str(path), str(1000 * (kill + 1))],
                                stdout=subprocess.PIPE, text=True, env=env)
        try:
            assert proc.stdout.readline().strip() == "ready"
            time.sleep(rng.uniform(0.05, 0.6))
        finally:
            proc.send_signal(signal.SIGKILL)
            out, _ = proc.communicate(timeout=60)
        # a line the kill cut short ("saved" alone: seen once in a full run) names no save
        committed |= {int(m.group(1)) for m in map(re.compile(r"saved (\d+)$").match, out.splitlines()) if m}
        dst = {"t": torch.zeros(256, 1024), "v": -1}
        dcp.load(dst, storage_reader=DistCkptStorageReader(path))
        v = dst["v"]
        assert torch.equal(dst["t"], torch.full((256, 1024), float(v))), v
        # What is there is the last save known committed, or the next one (killed after its commit point).
        assert v in {max(committed), max(committed) + 1, 1000 * (kill + 1)}, (v, sorted(committed)[-3:])
        committed.add(v)
        check = subprocess.run([sys.executable, "-m", "distckpt", "verify", str(path)], capture_output=True,
                               text=True, timeout=120)
        assert check.returncode == 0, check.stdout + check.stderr




def test_dcp_async_save_beside_loads_in_the_callers_thread(tmp_path):
    """dcp.async_save runs the writer in DCP's thread while the caller's thread loads (a real
    torchrun job: the store is the agent's). The writer once ran the control channel's arrival
    check there too, interleaving with the load's: every save and load failed (an outside
    trial). And the arrival check's wait held the job's store client for its whole length, so
    DCP's thread, creating its gloo group through the same store at the first save, waited
    behind it and the load's check timed out. Every call succeeds."""
    import json
    env = dict(os.environ, DISTCKPT_TIMEOUT_S="4", DISTCKPT_ARRIVAL_TIMEOUT_S="3")
    worker = os.path.join(os.path.dirname(__file__), "..", "helpers", "dcp_async_beside_load_worker.py")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           worker, str(tmp_path)], env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for rank in range(2):
        with open(tmp_path / f"rank{rank}.json") as f:
            assert json.load(f) == [["ok", "ok"]] * 3, (rank, proc.stderr[-2000:])
