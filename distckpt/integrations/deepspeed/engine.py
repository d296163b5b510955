"""distckpt as DeepSpeed's checkpoint engine: one line after ``deepspeed.initialize``.

    engine, optimizer, _, scheduler = deepspeed.initialize(model=model, config=cfg, ...)
    distckpt.integrations.deepspeed.install(engine, keep_last=3)
    engine.save_checkpoint(save_dir, tag, client_state={...})     # unchanged user code
    engine.load_checkpoint(save_dir)                               # unchanged user code

What changes (DeepSpeed 0.19.8; the seam is ``engine.checkpoint_engine``, DeepSpeed's own
pluggable writer, plus a few engine methods replaced on the instance for what that seam does not
reach: ``save_checkpoint`` / ``load_checkpoint`` (the ``latest`` pointer, refused options), the
model-states file lookup (a glob on disk) and the ZeRO optimizer load):

  * Everything DeepSpeed would write for a tag (``mp_rank_00_model_states.pt``, one
    ``[bf16_]zero_pp_rank_R_mp_rank_00_optim_states.pt`` per data-parallel rank, ZeRO-3's per-rank
    model states) becomes ONE distckpt checkpoint ``save_dir/tag``, committed atomically by rank 0
    once every rank has written its own data file. Each DeepSpeed "file" is the subtree
    ``files.<name without .pt>``: its tensors in the data files, its plain values (ints, strings,
    ``ds_config``, ``client_state``, torch.Size, ZeroStageEnum, ``fragment_address`` dataclasses)
    in the MANIFEST. No torch.save and no pickle, on save or load (the one torch.save is the
    export ``save_16bit_model`` asks for: ``pytorch_model.bin``, not a checkpoint). Its OrderedDicts
    (``param_shapes``), Counters (a ``MultiStepLR``'s milestones) and defaultdicts of builtin types
    come back as such: ``containers.<name>`` records them (:mod:`distckpt.containers`); any other
    dict subclass fails the save.
  * ZeRO stages 1-3: the fp32 master weights and every optimizer state are stored once, in the
    reshardable form of :mod:`.zero` (``model.<param>``, ``optim.<param>.<state>``: global tensors,
    each rank writing the element ranges of its partition; ``deepspeed``: its layout as JSON).
    DeepSpeed's ``*_optim_states`` entries keep only their plain values (loss scaler, overflow,
    clip_grad, ...). With ZeRO 1/2 the module weights in ``*_model_states`` are stored as they are,
    as DeepSpeed stores them: they equal the masters cast to the model dtype only until something
    changes them between steps (a weight constraint), and the load gives back the saved ones, with
    the masters built from them under ``zero_optimization.load_from_fp32_weights: false``, as
    DeepSpeed's does. (Checkpoints of distckpt before this held only the masters; their module
    weights are set from the loaded masters.) So ``distckpt.read(path, keys=["model"])``
    is the consolidated fp32 model, and a load at another data-parallel size reshards (each rank
    reads the byte ranges of its new partition). Stage 0 stores DeepSpeed's files as they are
    (nothing is partitioned: they load at any data-parallel size).
  * DeepSpeed's loss scalers (``LossScaler``, ``DynamicLossScaler``: plain objects, not data) are
    the only non-data objects in its state. They are stored as ``{"__deepspeed_object__": NAME,
    "state": vars(obj)}`` and rebuilt on load from an allow-list of exactly those two classes
    (:data:`REBUILDABLE`), never by importing a name found in the checkpoint. Any other object in
    the state (in ``client_state`` too) is an UnsupportedValueError at save, on every rank.
  * ``save_dir/latest`` (the tag as text, the format DeepSpeed reads) is replaced by
    tmp + fsync + rename + directory fsync, inside the commit, before any rank returns; DeepSpeed
    writes it in place with open(). A ``latest`` that exists but names no tag (empty or blank: a
    crash in DeepSpeed's write leaves it so) is a CheckpointNotFoundError on load, never "nothing
    saved yet", and ``keep_last`` deletes nothing while it reads so.
  * ``keep_last``: after each commit, rank 0 deletes the oldest checkpoints of this integration in
    ``save_dir`` (by commit order) beyond the newest ``keep_last``; never the one just saved, never
    the one ``latest`` names. Deleted files are closed, so the space is free at once. Other
    directories in ``save_dir`` are never touched.
  * A failed save (ENOSPC, a lost rank, an unsupported value) raises the same typed error on every
    rank; nothing new is visible, ``latest`` and earlier tags are unchanged.
  * DeepSpeed's ``zero_to_fp32.py`` / ``zero_to_torch.py`` copies into ``save_dir`` are skipped:
    they read torch.save files.

Load: ``engine.load_checkpoint(dir, tag)`` runs DeepSpeed's own load logic; the files it asks for
are served from the checkpoint (each rank reads only the subtrees it asks for), and its ZeRO
optimizer load is replaced by :func:`.zero.load` (any data-parallel size) plus DeepSpeed's own
restore of the optimizer's plain values. It returns what DeepSpeed returns: ``(load_path,
client_state)``, ``load_path`` being ``load_dir/tag/<model-states file name>`` (e.g.
``mp_rank_00_model_states.pt``; ZeRO-3: this rank's ``zero_pp_rank_R_mp_rank_00_model_states.pt``),
the DeepSpeed file whose contents the checkpoint holds as ``files.<name>``: no such file exists,
its dirname is the tag directory. ``load_module_only=True`` (weights only: no optimizer state, lr
scheduler or step counters restored, the fp32 masters set from the loaded weights),
``load_optimizer_states=False`` and ``load_lr_scheduler_states=False`` behave as DeepSpeed's,
with the module weights read from the stored model states (ZeRO 1/2; an older checkpoint that
holds only the masters: from the masters) or, at ZeRO-3 without optimizer states, where
DeepSpeed runs ``zero_to_fp32``, from the stored masters. Two differences: at ZeRO-3
``load_module_only=True`` loads the weights (DeepSpeed 0.19.8 loads them only together with
``load_optimizer_states=False``; otherwise its file holds placeholders and no weight is loaded),
and a ZeRO-3 load without optimizer states reads the tag asked for (DeepSpeed reads the one
``latest`` names). Options this engine does not serve (``custom_load_fn``, universal
checkpoints, MoE, pipeline or model parallelism, NVMe offload, node-local storage) raise
ConfigError up front: never a half-served load. Another ZeRO stage than the saved one raises
ReshardError (the standalone :func:`.zero.load` has ``allow_stage_change``), and so does a ZeRO
load with optimizer states into an engine of another precision (fp32 <-> bf16; DeepSpeed raises
FileNotFoundError there, after its partial load). Before DeepSpeed's own load, each rank checks
its load and reads and verifies the files DeepSpeed will ask it for, and the ranks exchange the
outcome and what each is about to load (tag, options): a failure on one rank, or ranks that
disagree, raise one typed error on every rank with no engine changed. The ZeRO state is read
after DeepSpeed's module load, collectively: its failures reach every rank at once too, but the
module weights and step counters are set by then.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import io
import logging
import os
import re
from typing import Any

import msgpack
import torch
from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointCommitInfo, CheckpointEngine
from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler

from ... import containers, tensorrecords
from ... import manifest as mf
from ..._dist import _portable, control_group
from ...errors import (CheckpointNotFoundError, ConfigError, DistCkptError, ManifestCorruptError, ReshardError,
                       StateDictMismatchError, UnsupportedValueError)
from ...listing import owned_checkpoints
from ...restore import read
from ...commit import SaveResult, commit_guard
from ...save_sync import save_in_root
from ...source import pinned
from ...storage import ROOT_LOCK_NAME, Store, is_url, join, open_store
from ...values import holds_tensor
from . import zero

__all__ = ["install", "DistckptCheckpointEngine", "REBUILDABLE", "FORMAT"]

log = logging.getLogger("distckpt")

#: ``meta["user"]["deepspeed"]["engine"]`` of checkpoints written through :func:`install`.
FORMAT = 1
#: The only non-data DeepSpeed objects a checkpoint may hold, rebuilt from their plain attributes.
REBUILDABLE = {"LossScaler": LossScaler, "DynamicLossScaler": DynamicLossScaler}
_OBJ = "__deepspeed_object__"
_FILES = "files"
# {file name: msgpack of its container records (distckpt.containers)}: each rank records the files
# it saves (ZeRO-3's model states are per rank), so the records travel with the state, not in
# rank 0's metadata.
_CONTAINERS = "containers"
# {file name: msgpack of its nn.Parameter and shared-tensor records (distckpt.tensorrecords)}:
# torch.save keeps both (a Parameter in client_state, tied weights of the module's state dict).
_TENSORS = "tensors"
# A tag becomes a directory name beside `latest` and distckpt's hidden tmp/lock entries.
_TAG_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.+=-]{0,199}\Z")


def _export_file(state_dict: Any, path: str) -> None:
    """``torch.save(state_dict, path)`` made durable and atomic: a tmp file beside the target (a
    symlink's target: written through it, as torch.save does), created with the mode torch.save
    gives (0666 less the umask), fsync, rename, fsync of the directory. A failure leaves no
    partial file and raises the typed error of the OS error (torch.save turns a failed write into
    its own RuntimeError: the OSError under it is what is raised); ConfigError for a URL or a
    directory."""
    import secrets

    from ...errors import from_os_error
    from ...storage.posix.paths import fsync_path
    if is_url(str(path)):
        raise ConfigError(f"DeepSpeed's export to {path}: distckpt's engine writes exports to a local path only",
                          path=str(path), remedy="Export to a local directory and upload the file.")
    path = os.path.realpath(path)
    if os.path.isdir(path):
        raise ConfigError(f"{path} is a directory: DeepSpeed's export writes one file there", path=path)
    parent = os.path.dirname(path)
    tmp = os.path.join(parent, f".{os.path.basename(path)}.{secrets.token_hex(8)}.tmp")
    created = False
    failed: list[OSError] = []

    class _Sink(io.RawIOBase):
        """The file, remembering an OSError of write() (torch.save reports it as RuntimeError)."""

        def __init__(self, fd: int):
            self.fd = fd

        def writable(self) -> bool:
            return True

        def write(self, data) -> int:
            try:
                return os.write(self.fd, data)
            except OSError as exc:
                failed.append(exc)
                raise

    try:
        os.makedirs(parent, exist_ok=True)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)
        created = True
        try:
            with io.BufferedWriter(_Sink(fd), buffer_size=1 << 20) as f:
                try:
                    torch.save(state_dict, f)
                except RuntimeError:
                    if failed:
                        raise failed[0] from None
                    raise
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
        created = False
    except OSError as exc:
        raise from_os_error(exc, path=path, operation="export") from exc
    finally:
        if created:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
    fsync_path(parent)  # the rename, durable (typed errors of its own)


# ---------------------------------------------------------------------------------------------
# DeepSpeed's state <-> plain data.



@dataclasses.dataclass(frozen=True, slots=True)
class _LoadPlanned:
    """Each rank's outcome of planning load_checkpoint(), exchanged before DeepSpeed's own load:
    its error (None when it planned), ``nothing`` when it found no ``latest`` to load, and
    ``call``: what it is about to load and how (the checkpoint's path, the tag, the options),
    which must be the same on every rank."""

    error: BaseException | None
    nothing: bool
    call: tuple | None = None

def _encode(value: Any) -> Any:
    """DeepSpeed's state dict as distckpt stores it: loss scalers as allow-listed plain records.
    Containers keep their types (an OrderedDict, Counter or defaultdict is rebuilt after the read
    from the records :func:`distckpt.containers.record` takes at save; any other dict subclass
    fails the save). Everything else is left as it is: what distckpt cannot store without pickle
    then fails the (collective) save with UnsupportedValueError on every rank."""
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, dict):
        items = {k: _encode(v) for k, v in value.items()}
        if all(items[k] is v for k, v in value.items()):
            return value
        out = copy.copy(value)  # the same type, _metadata and default_factory
        out.clear()
        out.update(items)
        return out
    if type(value) in (list, tuple):
        return type(value)(_encode(v) for v in value)
    for name, cls in REBUILDABLE.items():
        if type(value) is cls:
            return {_OBJ: name, "state": _encode(dict(vars(value)))}
    return value


def _records(files: dict[str, Any]) -> dict[str, dict[str, bytes]]:
    """{_CONTAINERS: {file name: its container records, packed}, _TENSORS: {file name: its
    Parameter and shared-tensor records, packed}}. Raises UnsupportedValueError for a container
    that would not load back as its own type."""
    return {_CONTAINERS: {name: msgpack.packb(containers.record(sd), use_bin_type=True) for name, sd in files.items()},
            _TENSORS: {name: msgpack.packb(tensorrecords.record(sd), use_bin_type=True) for name, sd in files.items()}}


def _unpack_records(raw: Any, where: str, path: str) -> list:
    """The records packed at ``where`` (``containers.NAME`` / ``tensors.NAME``). Raises
    ManifestCorruptError when they are not msgpack bytes."""
    try:
        if not isinstance(raw, bytes):
            raise TypeError(f"a {type(raw).__name__}, not bytes")
        return msgpack.unpackb(raw, raw=False, strict_map_key=False)
    except (TypeError, ValueError, msgpack.UnpackException) as exc:
        raise ManifestCorruptError(f"{where}: the records are malformed: {exc}",
                                   path=path) from None


def _decode(value: Any) -> Any:
    if isinstance(value, dict):
        if _OBJ in value and set(value) == {_OBJ, "state"}:
            cls = REBUILDABLE.get(value[_OBJ])
            if cls is None:
                raise ConfigError(f"the checkpoint holds a DeepSpeed object {value[_OBJ]!r}, not one of "
                                  f"{sorted(REBUILDABLE)}", remedy="Load it with the distckpt version that saved it.")
            obj = cls.__new__(cls)  # no __init__: its attributes are the saved ones, nothing else
            obj.__dict__.update(_decode(value["state"]))
            return obj
        for k, v in value.items():  # in place: the container was rebuilt with its type
            value[k] = _decode(v)
        return value
    if type(value) in (list, tuple):
        return type(value)(_decode(v) for v in value)
    return value


# ---------------------------------------------------------------------------------------------
# The checkpoint engine.


class DistckptCheckpointEngine(CheckpointEngine):
    """DeepSpeed's CheckpointEngine interface over one distckpt checkpoint per tag.

    Save: ``create`` starts a tag, each ``save(state_dict, path)`` records the state under its file
    name (nothing written yet), ``commit`` writes them all as one collective :func:`distckpt.save`
    (every rank its own files), then ``latest`` and rotation run inside the commit on rank 0.
    Load: only between :meth:`begin_load` and :meth:`end_load` (the wrapped ``load_checkpoint``):
    ``load(path)`` reads the subtree of that file name.
    """

    def __init__(self, engine: Any, *, keep_last: int | None):
        super().__init__(None)
        self.engine = engine
        self.name = "DistckptCheckpointEngine"
        self.keep_last = keep_last
        self.save_latest = True
        self.exclude_frozen_parameters = False  # save_checkpoint's option, for the save in progress
        self.last_result: SaveResult | None = None
        self._info: CheckpointCommitInfo | None = None
        self._files: dict[str, Any] = {}
        self._extra_meta: dict[str, Any] = {}
        self._load_path: str | None = None
        self._load_names: list[str] = []
        self.model_states_name: str | None = None
        self.load_meta: dict = {}
        self._masters: set[str] = set()
        self._weights_from_masters = False
        # {name: state} of the files read for this load (prefetch(), then DeepSpeed's requests)
        self._cache: dict[str, Any] = {}
        self._consolidated: dict | None = None  # consolidated_module(), read by prefetch()
        self.in_save_checkpoint = False  # set by the installed save_checkpoint (else: an export)

    # -- save ------------------------------------------------------------------------------
    def create(self, info: CheckpointCommitInfo) -> None:
        self._info = info
        self._files = {}

    def makedirs(self, path: str, exist_ok: bool = False) -> None:
        # DeepSpeed asks for save_dir (rank 0) and save_dir/tag (every rank). The tag directory is
        # distckpt's to create, atomically, at the commit; an empty one made here would be what a
        # crash leaves behind.
        if self._info is not None and os.path.abspath(path) == self._tag_dir():
            return
        open_store(path).make_root(path)

    def _tag_dir(self) -> str:
        return os.path.abspath(os.path.join(self._info.save_dir, str(self._info.tag)))

    def _name(self, path: str, tag_dir: str) -> str:
        path = os.path.abspath(path)
        if os.path.dirname(path) != tag_dir or not path.endswith(".pt"):
            raise ConfigError(f"DeepSpeed asked to write {path}, outside the checkpoint {tag_dir} or not a .pt "
                              "file: a DeepSpeed feature this engine does not serve",
                              path=path, remedy="Save without distckpt's engine installed for this feature.")
        return os.path.basename(path)[:-3]

    def save(self, state_dict: Any, path: str) -> None:
        if self._info is None:
            raise ConfigError("DeepSpeed called save() outside save_checkpoint()", path=path)
        if not self.in_save_checkpoint:
            # DeepSpeed's exports through its checkpoint engine (save_16bit_model: rank 0 alone
            # writes pytorch_model.bin for Hugging Face's from_pretrained): not a checkpoint, a
            # torch.save file the user asked for, written as DeepSpeed's engine writes it but
            # atomically (tmp + fsync + rename), and no collective at the commit.
            _export_file(state_dict, path)
            return
        self._files[self._name(path, self._tag_dir())] = state_dict

    def commit(self, info: CheckpointCommitInfo) -> bool:
        """Write every file recorded since ``create`` as one checkpoint (collective; every rank).
        An export (``save_16bit_model``: no ``save_checkpoint`` around it) was written by
        :meth:`save`: nothing to commit, no collective.

        Raises what :func:`distckpt.save` raises, on every rank; then nothing new is visible,
        ``latest`` is unchanged and earlier tags are intact."""
        if not self.in_save_checkpoint:
            self._files, self._info = {}, None
            return True
        files, self._files = self._files, {}
        self._info = None
        save_dir = os.path.abspath(info.save_dir)
        store = open_store(save_dir)
        final = join(save_dir, str(info.tag))
        save_latest = self.save_latest  # the user's save_latest (DeepSpeed's own write is off)
        if _rank() == 0:
            store.reclaim(save_dir)  # leftovers of crashed saves (dead ones only)
        # Every rank builds its own state (ZeRO-3's model states differ per rank): one that cannot
        # (a container that would not load back as its own type) must fail every rank here, not
        # leave the others waiting at the save's collective.
        state = meta = error = None
        try:
            state, meta = self._state(files)
        except Exception as exc:  # noqa: BLE001 - raised on every rank below
            error = exc
        control_group(operation="save_checkpoint()").exchange_outcome(error, operation="save_checkpoint")
        meta.update(engine=FORMAT, tag=str(info.tag), **self._extra_meta)
        self.last_result = save_in_root(state, final,
                                        overwrite=True, metadata={"deepspeed": meta},
                                        after_commit=lambda: self._after_commit(store, save_dir, str(info.tag),
                                                                                save_latest),
                                        lock_path=join(save_dir, ROOT_LOCK_NAME))
        return True

    def _state(self, files: dict[str, Any]) -> tuple[dict, dict]:
        """The checkpoint's state dict and its ``deepspeed`` metadata.

        ZeRO stages 1-3: the fp32 master weights and optimizer state go in the reshardable form of
        :mod:`.zero` (``model.*``, ``optim.*``, ``deepspeed``: global tensors, each rank writing its
        partition), and DeepSpeed's own ``*_optim_states`` files keep only their plain values
        (loss scaler, overflow, clip_grad, ...): their flat partitions would be the same bytes a
        second time. Stage 0 holds nothing partitioned: DeepSpeed's files as they are.
        """
        if int(self.engine.zero_optimization_stage()) == 0:
            out = {name: _encode(sd) for name, sd in files.items()}
            return {_FILES: out, **_records(out)}, {"containers": True, "tensors": True}
        zsd, zmeta = zero.state_dict(self.engine, lr_scheduler=False,
                                     exclude_frozen_parameters=self.exclude_frozen_parameters)
        stage = int(zmeta["stage"])
        out = {}
        for name, sd in files.items():
            if name.endswith("_optim_states"):
                osd = sd["optimizer_state_dict"]
                sd = {**sd, "optimizer_state_dict": {k: v for k, v in osd.items() if not holds_tensor(v)}}
            # ZeRO 1/2 module weights are stored as they are, beside the masters, as DeepSpeed
            # does: they equal the masters cast to the model dtype only until something changes
            # them between steps (a weight constraint, a re-initialization), and DeepSpeed's load
            # gives back the saved ones (and, with load_from_fp32_weights=False, masters built
            # from them).
            out[name] = _encode(sd)
        meta = {"format": zero.FORMAT, "stage": stage, "dp_size": zmeta["dp_size"],
                "model_dtype": zmeta["model_dtype"], "master_dtype": zmeta["master_dtype"],
                "optimizer": zmeta["optimizer"], "params": len(zmeta["params"]),
                "module_from_masters": False,
                "containers": True, "tensors": True}
        return {_FILES: out, **_records(out), **zsd}, meta

    def _after_commit(self, store: Store, save_dir: str, tag: str, save_latest: bool) -> None:
        # Rank 0, inside the commit, holding the root lock, after the new tag is durable; its
        # lock or lease proven before each change (a save frozen past its lease stops there).
        guard = commit_guard()
        if save_latest:
            guard(f"point {save_dir}/latest at {tag}")
            store.replace_pointer(join(save_dir, "latest"), tag.encode())
        if self.keep_last is None:
            return
        try:
            pointed = read_latest(save_dir)
        except DistCkptError as exc:
            # Which tag `latest` protects is unknown (save_latest=False left a damaged one as it
            # was): delete nothing rather than maybe the one it should name.
            log.warning("distckpt: keep_last=%d: nothing deleted in %s: %s", self.keep_last, save_dir, exc)
            return
        ours = sorted(_our_checkpoints(store, save_dir), key=lambda e: (e[1], e[0]))
        doomed = [name for name, _ in ours[:max(0, len(ours) - self.keep_last)] if name not in (tag, pointed)]
        for name in doomed:
            guard(f"delete {join(save_dir, name)}")
            store.remove_checkpoint(join(save_dir, name))

    def is_data_parallel_writer(self, dp_rank: int) -> bool:
        return dp_rank == 0

    def preserves_storage_sharing(self) -> bool:
        # Only the bytes of each tensor (view) are written: no need for DeepSpeed to clone views
        # out of flat buffers first, as it does for torch.save.
        return False

    # -- load ------------------------------------------------------------------------------
    def begin_load(self, path: str, names: list[str], meta: dict, masters: set[str], *,
                   weights_from_masters: bool = False) -> None:
        """Serve ``path`` until :meth:`end_load`. ``weights_from_masters``: DeepSpeed's ZeRO
        optimizer load will not run (``load_module_only``, ``load_optimizer_states=False``), so the
        module weights stored only as fp32 masters are served, cast to the module's dtype."""
        self._load_path, self._load_names, self.load_meta, self._masters = path, names, meta, masters
        self._weights_from_masters = weights_from_masters

    def end_load(self) -> None:
        self._load_path, self._load_names = None, []
        self._weights_from_masters = False
        self._cache, self._consolidated = {}, None
        self.model_states_name = None

    def prefetch(self, names: list[str], *, consolidated: bool) -> None:
        """Read, verify and decode now every file of the checkpoint DeepSpeed's load will ask this
        rank for (``names``: its model states, its ZeRO ``*_optim_states`` entry) and, with
        ``consolidated``, the consolidated module (:meth:`consolidated_module`): called while the
        load is planned, so a failure that only this rank sees (a damaged block of its own ZeRO-3
        model states, an I/O error) is raised before DeepSpeed's load changes the engine, and is
        exchanged with the other ranks. :meth:`load` then serves them from memory."""
        for name in names:
            self.load(os.path.join(self._load_path, name + ".pt"))
        if consolidated:
            self._consolidated = self.consolidated_module()

    def load(self, path: str, map_location: Any = None) -> Any:
        """The state DeepSpeed saved as ``path``, on CPU (every caller in DeepSpeed 0.19.8 maps to
        CPU). Raises StateDictMismatchError when the checkpoint has no such file."""
        if self._load_path is None:
            raise ConfigError(f"DeepSpeed asked to read {path} outside load_checkpoint() through distckpt's engine",
                              path=path, remedy="Call engine.load_checkpoint(); other DeepSpeed loaders read "
                              "torch.save files.")
        if os.path.abspath(path) == self._load_path:  # see install()._get_all_ckpt_names
            name = self.model_states_name
        else:
            name = self._name(path, self._load_path)
        if name in self._cache:
            # Read by prefetch() while the load was planned. DeepSpeed 0.19.8 also asks for the
            # model-states file twice in a row (SDLoader's check_ckpt_list reads one key,
            # mp_world_size, of it and drops it, then its load takes it): the state read and
            # verified once is handed to both, instead of reading and checking the file again.
            return self._cache[name]
        keys = [f"{_FILES}.{name}"]
        if self.load_meta.get("containers"):
            keys.append(f"{_CONTAINERS}.{name}")
        if self.load_meta.get("tensors"):
            keys.append(f"{_TENSORS}.{name}")
        got = read(self._load_path, keys=keys)
        sd = got[_FILES][name]
        if _CONTAINERS in got:
            # Containers first (their records name paths of the stored tree), then loss scalers.
            sd = containers.rebuild(sd, _unpack_records(got[_CONTAINERS][name], f"{_CONTAINERS}.{name}", self._load_path),
                                    where=f"{_CONTAINERS}.{name}", path=self._load_path)
        if _TENSORS in got:
            sd = tensorrecords.restore(sd, _unpack_records(got[_TENSORS][name], f"{_TENSORS}.{name}", self._load_path),
                                       where=f"{_TENSORS}.{name}", path=self._load_path)
        sd = _decode(sd)
        if name.endswith("_model_states"):
            self._check_frozen(sd)
        if name.endswith("_model_states") and self.load_meta.get("module_from_masters"):
            # The weights were stored once, as fp32 masters (see _state). A weight without a saved
            # master is not filled here: DeepSpeed's strict module load reports it.
            current = self.engine.module.state_dict()
            module = sd.setdefault("module", {})
            wanted = [key for key in current if key not in module and key in self._masters]
            if self._weights_from_masters:
                # No ZeRO load follows: the module gets the masters cast to its dtype, which is
                # what DeepSpeed's own file holds (it copies them so after every step).
                masters = read(self._load_path, keys=[f"model.{key}" for key in wanted])["model"] if wanted else {}
                for key in wanted:
                    module[key] = masters[key].to(current[key].dtype)
            else:
                # DeepSpeed's module load gets the module's own tensors (a no-op copy); the ZeRO
                # load that follows sets them from the loaded masters, as a step does.
                for key in wanted:
                    module[key] = current[key]
        self._cache[name] = sd
        return sd

    def _check_frozen(self, sd: Any) -> None:
        """Raise StateDictMismatchError when DeepSpeed's module load would look up a frozen
        parameter of this engine in the checkpoint's frozen fragments that are not there (frozen
        now, trained when saved): DeepSpeed 0.19.8 raises a bare KeyError there, after the module
        weights changed. Every rank serves the same names, so every rank raises here alike."""
        fragments = sd.get("frozen_param_fragments") if isinstance(sd, dict) else None
        if fragments is None:  # saved with exclude_frozen_parameters=True: DeepSpeed skips them
            return
        from deepspeed.runtime.utils import is_optimized_parameter
        names = getattr(self.engine, "param_names", {})
        missing = [names.get(p, "?") for p in self.engine.module.parameters()
                   if not is_optimized_parameter(p) and names.get(p) not in fragments]
        if missing:
            raise StateDictMismatchError(
                f"this engine's frozen parameter(s) {missing[:5]} were not frozen when the checkpoint was saved "
                "(it holds no frozen fragment of them)", path=self._load_path,
                missing=missing, unexpected=[], shape_mismatch={}, dtype_mismatch={},
                remedy="Freeze the parameters that were frozen at save (set requires_grad as then), or save with "
                       "exclude_frozen_parameters=True so that a load keeps the engine's own frozen weights.")

    def consolidated_module(self) -> dict:
        """The checkpoint's consolidated module state (``model.*``: fp32 masters, frozen
        parameters and persistent buffers in the module's dtype): what DeepSpeed reads with
        ``zero_to_fp32`` for a ZeRO-3 load without optimizer states. Tied parameters get their
        aliases as ``zero_to_fp32`` gives them (``shared_params`` of rank 0's model states, the
        only rank DeepSpeed records them on: a tied ``lm_head.weight`` is the saved
        ``wte.weight``), so a strict module load finds them."""
        if self._consolidated is not None:  # read by prefetch()
            return self._consolidated
        model = read(self._load_path, keys=["model"])["model"]
        first = [n for n in ("zero_pp_rank_0_mp_rank_00_model_states", "mp_rank_00_model_states")
                 if n in self._load_names]
        name = first[0] if first else self.model_states_name
        stored = read(self._load_path, keys=[f"{_FILES}.{name}"])[_FILES][name] if name else {}
        shared = stored.get("shared_params") or {}
        for alias, source in shared.items():
            if source in model:
                model[alias] = model[source]
        return model


# ---------------------------------------------------------------------------------------------
# Helpers on save_dir.


def _rank() -> int:
    import torch.distributed as dist
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def read_latest(save_dir: str) -> str | None:
    """The tag ``save_dir/latest`` names, or None when there is no such file.

    Raises:
        CheckpointNotFoundError: ``latest`` exists but names no tag (empty, whitespace only: what a
            crash in the middle of DeepSpeed's in-place write of it leaves; or not a plain tag
            name). Never "nothing saved yet": a job that took it so would start again from step 0
            (and its ``keep_last`` could then delete the checkpoints of the run before).
        StorageError subclasses: it cannot be read.
    """
    latest = join(save_dir, "latest")
    tag = open_store(save_dir).read_pointer(latest)
    if tag is None:
        return None
    # read_pointer strips whitespace and decodes with replacement characters: a name that did not
    # decode fails _TAG_RE, as does one that could be a path (no tag of install() is either).
    if not _TAG_RE.match(tag) or tag == "latest":
        what = "holds no tag (it is empty or blank)" if not tag else f"holds {tag[:100]!r}, not a checkpoint tag"
        raise CheckpointNotFoundError(
            f"{latest} exists but {what}: it names no checkpoint (a crash while DeepSpeed wrote it in place "
            "leaves it so); the load does not start from scratch on that", path=latest,
            remedy=f"Pass the tag to load: load_checkpoint(load_dir, tag=...) (the tags are the checkpoint "
                   f"directories of {save_dir}: `distckpt ls {save_dir}`), or write the tag to load into {latest}.")
    return tag


def _ds_meta(manifest: "mf.Manifest") -> dict | None:
    user = manifest.meta.get("user")
    return _ds_user_meta(user if isinstance(user, dict) else None)


def _ds_user_meta(user: dict | None) -> dict | None:
    """This integration's entry of a MANIFEST's user metadata, or None when it did not write it."""
    ds = user.get("deepspeed") if user is not None else None
    return ds if isinstance(ds, dict) and ds.get("engine") == FORMAT else None


def _our_checkpoints(store: Store, save_dir: str) -> list[tuple[str, float]]:
    """(tag, commit time) of every committed checkpoint of this integration in ``save_dir``."""
    return owned_checkpoints(store, save_dir, lambda user: _ds_user_meta(user) is not None)


# ---------------------------------------------------------------------------------------------
# install()


def _unsupported_engine_features(engine: Any) -> list[str]:
    from deepspeed.runtime.pipe.engine import PipelineEngine
    found = []
    if isinstance(engine, PipelineEngine):
        found.append("pipeline parallelism (PipelineEngine)")
    if getattr(engine, "has_moe_layers", False):
        found.append("MoE layers")
    if engine.optimizer is not None:  # NVMe and partial offload, ZenFlow
        try:
            zero.check_offload(engine, engine.optimizer)
        except UnsupportedValueError as exc:
            found.append(exc.message)
    if engine.load_universal_checkpoint():
        found.append("universal checkpoint loading (checkpoint.load_universal)")
    if engine.use_node_local_storage():
        found.append("checkpoint.use_node_local_storage")
    if getattr(engine, "mp_world_size", 1) != 1 or getattr(engine, "mpu", None) is not None:
        found.append("model (tensor) parallelism through an mpu")
    return found


def _plan_load(engine: Any, load_dir: str, tag: Any, pin: contextlib.ExitStack) -> tuple | None:
    """What load_checkpoint(load_dir, tag) will read, checked: (tag, path, file names, DeepSpeed
    meta, master names), or None when ``tag`` is None and there is no ``latest`` (nothing saved).
    The checkpoint is pinned (:func:`distckpt.source.pinned`) on ``pin`` before its MANIFEST is
    read: DeepSpeed reads its files one by one and the ZeRO load reads more, and pinned the
    MANIFEST is decoded once for all of them (this plan included), and all come from one
    checkpoint (CheckpointRemovedError otherwise).

    Raises:
        CheckpointNotFoundError: no committed checkpoint there, or one not written by install().
        ReshardError: saved at another ZeRO stage.
    """
    from_latest = tag is None
    if tag is None:
        tag = read_latest(load_dir)  # CheckpointNotFoundError when it exists but names nothing
        if tag is None:
            return None
    path = join(load_dir, str(tag))
    store = open_store(path)
    if not store.is_committed(path):
        try:
            names = os.listdir(path) if not is_url(path) and os.path.isdir(path) else []
        except OSError:  # unreadable: the plain message below
            names = []
        native = sorted(n for n in names if n.endswith(("_model_states.pt", "_optim_states.pt")))
        if native:
            raise CheckpointNotFoundError(
                f"{path} holds DeepSpeed's own checkpoint ({native[0]}, ...: torch.save files), not one written "
                "through distckpt's install(), which reads only its own (DeepSpeed's files are pickles)", path=path,
                remedy="Load it with DeepSpeed's own load_checkpoint before install() (it unpickles those files: "
                       "only if you trust them), then install() and save: the next tags are distckpt's.")
        named = f" (the tag {os.path.join(load_dir, 'latest')} names)" if from_latest else ""
        raise CheckpointNotFoundError(f"no committed checkpoint at {path}{named}", path=path)
    manifest = pin.enter_context(pinned(path)).manifest()
    ds = _ds_meta(manifest)
    if ds is None:
        raise CheckpointNotFoundError(
            f"{path} is a distckpt checkpoint but was not written through "
            "distckpt.integrations.deepspeed.install()", path=path,
            remedy="Load it with distckpt.load / distckpt.integrations.deepspeed.load instead.")
    names = sorted({fqn.split(".", 2)[1] for fqn in (*manifest.tensors, *manifest.objects)
                    if fqn.startswith(_FILES + ".")})
    if ds.get("zero_stage", 0) != int(engine.zero_optimization_stage()):
        raise ReshardError(f"{path} was saved at ZeRO stage {ds.get('zero_stage')}, this engine runs stage "
                           f"{engine.zero_optimization_stage()}", path=path,
                           remedy="Resume with the saved ZeRO stage, or load with "
                           "distckpt.integrations.deepspeed.load(engine, path, allow_stage_change=True).")
    saved_dp, dp = ds.get("dp_world_size"), int(engine.seq_dp_world_size)
    # the frozen parameters' partitions DeepSpeed's ZeRO-3 model states hold (none when saved
    # with exclude_frozen_parameters=True: then nothing is resharded and the load goes on)
    frozen = sorted({fqn.split(".frozen_param_fragments.", 1)[1] for fqn in manifest.tensors
                     if fqn.startswith(_FILES + ".") and ".frozen_param_fragments." in fqn})
    if int(engine.zero_optimization_stage()) == 3 and saved_dp != dp and frozen:
        # ZeRO-3's model states hold each rank's partition of a frozen parameter; DeepSpeed's
        # module load copies the served one into this rank's partition of another size (torch's
        # RuntimeError, after parts of the engine changed). Refused first.
        raise ReshardError(
            f"{path} was saved by ZeRO-3 at data-parallel size {saved_dp} and this engine runs {dp} with frozen "
            f"parameters ({frozen[0]}, ...): their partitions in DeepSpeed's model states do not reshard",
            path=path, key=frozen[0],
            remedy=f"Resume at data-parallel size {saved_dp}, or save with "
                   "distckpt.integrations.deepspeed.save(engine, path) and load with .load(engine, path), which "
                   "reshard frozen parameters too.")
    masters = {fqn.split(".", 1)[1] for fqn in manifest.tensors if fqn.startswith("model.")}
    return tag, path, names, ds, masters


@contextlib.contextmanager
def _zero3_fp32_from(ce: DistckptCheckpointEngine, load_dir: Any):
    """While it is entered, DeepSpeed's ZeRO-3 load without optimizer states gets the consolidated
    module from the checkpoint being loaded instead of running ``zero_to_fp32`` on torch.save files.

    DeepSpeed 0.19.8 calls ``get_fp32_state_dict_from_zero_checkpoint(load_dir)`` by its name in
    ``deepspeed.runtime.engine`` (no engine method to replace), so that module attribute is
    replaced for the duration of the load and restored after. Calls for any other directory go to
    DeepSpeed's function. DeepSpeed reads the tag ``latest`` names there whatever tag was asked
    for; this serves the tag being loaded.
    """
    import deepspeed.runtime.engine as ds_engine
    original = ds_engine.get_fp32_state_dict_from_zero_checkpoint
    target = os.path.abspath(os.fspath(load_dir))

    def from_checkpoint(checkpoint_dir, *args, **kwargs):
        if ce._load_path is None or os.path.abspath(os.fspath(checkpoint_dir)) != target:
            return original(checkpoint_dir, *args, **kwargs)
        return ce.consolidated_module()

    ds_engine.get_fp32_state_dict_from_zero_checkpoint = from_checkpoint
    try:
        yield
    finally:
        ds_engine.get_fp32_state_dict_from_zero_checkpoint = original


def install(engine: Any, *, keep_last: int | None = None) -> DistckptCheckpointEngine:
    """Route ``engine.save_checkpoint`` / ``engine.load_checkpoint`` through distckpt.

    Call on every rank after ``deepspeed.initialize``. The user's calls stay as they are; see the
    module docstring for what a checkpoint then is. Returns the installed checkpoint engine
    (``last_result`` holds the SaveResult of the latest save).

    Args:
        engine: the DeepSpeedEngine ``deepspeed.initialize`` returned.
        keep_last: keep the newest ``keep_last`` checkpoints of this integration in a save
            directory, deleting older ones right after each commit. None keeps all.

    Raises:
        ConfigError: ``keep_last`` is not a positive int, or the engine uses a DeepSpeed feature
            this engine does not serve (pipeline or model parallelism, MoE, NVMe or partial offload, ZenFlow,
            universal checkpoints, node-local storage).
    """
    if keep_last is not None and (not isinstance(keep_last, int) or isinstance(keep_last, bool) or keep_last < 1):
        raise ConfigError(f"keep_last={keep_last!r}: expected a positive int or None")
    unsupported = _unsupported_engine_features(engine)
    if unsupported:
        raise ConfigError(f"distckpt's DeepSpeed engine does not serve: {', '.join(unsupported)}",
                          remedy="Use DeepSpeed's own checkpoint engine for this job (do not call install()).")
    ce = DistckptCheckpointEngine(engine, keep_last=keep_last)
    engine.checkpoint_engine = ce
    engine._copy_recovery_script = lambda save_path: None  # they read torch.save files: see docstring

    cls = type(engine)
    orig_save = functools.partial(cls.save_checkpoint, engine)
    orig_load = functools.partial(cls.load_checkpoint, engine)
    orig_names = functools.partial(cls._get_all_ckpt_names, engine)
    orig_load_zero = functools.partial(cls._load_zero_checkpoint, engine)

    @functools.wraps(cls.save_checkpoint)
    def save_checkpoint(save_dir, tag=None, client_state={}, save_latest=True,  # noqa: B006 - DeepSpeed's default
                        exclude_frozen_parameters=False):
        tag_s = f"global_step{engine.global_steps}" if tag is None else str(tag)
        if not _TAG_RE.match(tag_s) or tag_s == "latest":
            raise ConfigError(f"checkpoint tag {tag_s!r}: expected a plain directory name of at most 200 "
                              "characters: letters, digits, '_', '-', '.', '+', '=', starting with a letter, "
                              "digit or '_'; not 'latest'",
                              remedy="Pass such a tag (DeepSpeed's default is global_step<N>); the tag names a "
                                     "directory of save_dir, so nothing that could be a path, an option or hidden.")
        ce._extra_meta = {"dp_world_size": int(engine.seq_dp_world_size),
                          "zero_stage": int(engine.zero_optimization_stage()),
                          "bf16": bool(engine.bfloat16_enabled())}
        ce.save_latest = bool(save_latest)
        ce.exclude_frozen_parameters = bool(exclude_frozen_parameters)
        ce.in_save_checkpoint = True
        try:
            # save_latest=False: DeepSpeed would write `latest` in place after our commit; the
            # commit writes it atomically instead (ce.save_latest).
            return orig_save(save_dir, tag_s, client_state=client_state, save_latest=False,
                             exclude_frozen_parameters=exclude_frozen_parameters)
        finally:
            ce.save_latest, ce.exclude_frozen_parameters, ce.in_save_checkpoint = True, False, False
            ce._files, ce._info = {}, None

    @functools.wraps(cls.load_checkpoint)
    def load_checkpoint(load_dir, tag=None, load_module_strict=True, load_optimizer_states=True,
                        load_lr_scheduler_states=True, load_module_only=False, custom_load_fn=None):
        if custom_load_fn is not None:
            raise ConfigError(f"load_checkpoint(custom_load_fn={custom_load_fn!r}) is not served by distckpt's "
                              "DeepSpeed engine",
                              remedy="Load without it, or read single values with distckpt.read().")
        options = {"load_module_strict": bool(load_module_strict), "load_optimizer_states": bool(load_optimizer_states),
                   "load_lr_scheduler_states": bool(load_lr_scheduler_states),
                   "load_module_only": bool(load_module_only)}
        # Every check and every read that can fail on one rank alone runs before DeepSpeed's own
        # load (the files DeepSpeed will ask this rank for are read and verified here), and the
        # ranks exchange their outcome and what each is about to load: past this point
        # DeepSpeed's collectives (with its own, 30-minute timeout) would leave the other ranks
        # waiting for a rank that already raised, and its load changes the engine.
        planned, error, returned, loaded = None, None, False, None
        try:
            with contextlib.ExitStack() as pin:
                try:
                    planned = _plan_load(engine, os.path.abspath(os.fspath(load_dir)), tag, pin)
                    if planned is not None:
                        pin.callback(ce.end_load)
                        _prepare_load(planned, load_dir, options)
                except Exception as exc:  # noqa: BLE001 - exchanged, then raised on every rank
                    error = exc
                loaded = _load_planned(planned, error, load_dir, options)
                returned = True
        except Exception as exc:
            if not returned:
                raise
            # The pin's last look (another save took the name as the load ended) is this rank's
            # alone: every rank raises it, or the others would go on training from a load it failed.
            control_group(operation="load_checkpoint()").exchange_outcome(exc, operation="load_checkpoint")
        control_group(operation="load_checkpoint()").exchange_outcome(None, operation="load_checkpoint")
        return loaded

    def _prepare_load(planned, load_dir, options):
        """This rank's checks of the planned load, and its reads of what DeepSpeed will ask for."""
        tag, path, names, ds, masters = planned
        stage = int(engine.zero_optimization_stage())
        # DeepSpeed runs its ZeRO optimizer load only for load_optimizer_states and not
        # load_module_only; without it the module weights come from the stored masters.
        zero_load = stage > 0 and options["load_optimizer_states"] and not options["load_module_only"]
        weights_only = options["load_module_only"] or not options["load_optimizer_states"]
        ce.begin_load(path, names, ds, masters, weights_from_masters=weights_only)
        wanted = [_model_states_name(load_dir, tag)]
        if zero_load:
            optim_name = _optim_states_name(load_dir, tag)
            _check_optim_states(path, ds, optim_name)
            if masters:
                # What the ZeRO load (last, _load_zero_checkpoint) would refuse is refused now:
                # DeepSpeed's own load restores the module weights, step counters and lr
                # scheduler before it, and would leave them changed.
                zero.check_loadable(engine, path)
            wanted.append(optim_name)
        ce.prefetch(wanted, consolidated=stage == 3 and weights_only)

    def _check_optim_states(path, ds, name):
        """Refuse, before anything changes, a ZeRO load whose ``*_optim_states`` entry the
        checkpoint lacks: saved in another precision (DeepSpeed names the entry bf16_... under
        bf16 only), or not at all."""
        if name in ce._load_names:
            return
        saved_files = [n for n in ce._load_names if n.endswith("_optim_states")]
        saved_bf16 = bool(ds["bf16"]) if "bf16" in ds else any(n.startswith("bf16_") for n in saved_files)
        now_bf16 = bool(engine.bfloat16_enabled())
        if saved_files and saved_bf16 != now_bf16:
            saved = "bf16" if saved_bf16 else ("fp16" if ds.get("model_dtype") == "float16" else "fp32")
            now = "bf16" if now_bf16 else ("fp16" if engine.fp16_enabled() else "fp32")
            raise ReshardError(
                f"{path} was saved with precision {saved} and this engine uses {now}: its ZeRO optimizer state is "
                f"DeepSpeed's {saved} form ({saved_files[0]}, ...), not the {now} one this engine's load reads "
                f"({name}); nothing was loaded", path=path, key=f"{_FILES}.{name}",
                remedy=f"Resume with the saved precision (bf16.enabled: {str(saved_bf16).lower()}), or load the "
                       "weights only: load_checkpoint(..., load_optimizer_states=False) keeps the step counters "
                       "and lr scheduler, load_module_only=True the weights alone.")
        raise StateDictMismatchError(
            f"{path} holds no DeepSpeed ZeRO optimizer state {name!r} (it has {saved_files or 'none'})", path=path,
            missing=[f"{_FILES}.{name}"], unexpected=[], shape_mismatch={}, dtype_mismatch={},
            remedy="Resume with the ZeRO stage, precision and data-parallel size the checkpoint was saved with, "
                   "or load with load_optimizer_states=False.")

    def _load_planned(planned, error, load_dir, options):
        group = control_group(operation="load_checkpoint()")
        call = None if planned is None else (planned[1], str(planned[0]), tuple(sorted(options.items())))
        mine = _LoadPlanned(_portable(error), planned is None, call)
        outcomes = group.all_gather(mine) if group.world_size > 1 else [_LoadPlanned(error, planned is None, call)]
        group.raise_failures([o.error for o in outcomes], error, operation="load_checkpoint")
        if len({o.nothing for o in outcomes}) > 1:  # `latest` seen by some ranks only
            raise CheckpointNotFoundError(
                f"{os.path.join(load_dir, 'latest')} exists for rank(s) "
                f"{[r for r, o in enumerate(outcomes) if not o.nothing]} only", path=load_dir,
                remedy="Every rank must see the same save directory (a shared file system).")
        if len({o.call for o in outcomes}) > 1:
            # Checked before DeepSpeed's load: its module, lr-scheduler and step restore would run
            # on every rank from another tag (or with other options) before any later check.
            def said(c):
                return f"{c[0]} ({', '.join(f'{k}={v}' for k, v in c[2])})"
            raise ConfigError(
                "the ranks called load_checkpoint() with different checkpoints or options: "
                + "; ".join(f"rank {r}: {said(o.call)}" for r, o in enumerate(outcomes)), path=planned[1],
                remedy="Pass every rank the same load_dir, tag and options (tag=None: every rank reads the same "
                       "`latest`, on a shared file system, with no save in between).")
        if planned is None:
            # DeepSpeed's contract: no `latest` means no checkpoint yet (a fresh start).
            log.warning("distckpt: no %s: nothing to load", os.path.join(load_dir, "latest"))
            return None, None
        tag = planned[0]
        load_optimizer_states, load_module_only = options["load_optimizer_states"], options["load_module_only"]
        weights_only = load_module_only or not load_optimizer_states
        stage3 = int(engine.zero_optimization_stage()) == 3
        # ZeRO-3's model states hold placeholders for the partitioned weights: DeepSpeed 0.19.8
        # reads real ones (zero_to_fp32) only when load_optimizer_states=False, so its
        # load_module_only alone would load no weight. Weights only are asked for here.
        ds_load_optimizer_states = load_optimizer_states and not (stage3 and load_module_only)
        try:
            with _zero3_fp32_from(ce, load_dir) if stage3 and weights_only else contextlib.nullcontext():
                loaded, client_state = orig_load(load_dir, tag, load_module_strict=options["load_module_strict"],
                                                 load_optimizer_states=ds_load_optimizer_states,
                                                 load_lr_scheduler_states=options["load_lr_scheduler_states"],
                                                 load_module_only=load_module_only)
            served = ce.model_states_name
        finally:
            ce.end_load()
        if loaded is None:
            return loaded, client_state
        if ds_load_optimizer_states != load_optimizer_states and isinstance(client_state, dict):
            # DeepSpeed leaves 'optimizer' out of client_state when optimizer states were asked for
            client_state.pop("optimizer", None)
        # DeepSpeed returns the path of the model-states file it loaded (callers take its dirname
        # for the tag directory): the same path, naming the file whose contents this checkpoint
        # holds as its subtree files.<name>; no such file exists on disk.
        return os.path.join(os.fspath(load_dir), str(tag), served + ".pt"), client_state

    def _model_states_name(checkpoints_path, tag) -> str:
        """The name of this rank's model-states file in the checkpoint being loaded: the one
        DeepSpeed's glob of the tag directory would find. Raises StateDictMismatchError when there
        is not exactly one."""
        import fnmatch
        pattern = os.path.basename(engine._get_ckpt_name(checkpoints_path, tag, mp_placeholder="*"))[:-3]
        found = [n for n in ce._load_names if fnmatch.fnmatchcase(n, pattern)]
        if not found and ce.load_meta.get("dp_world_size") != int(engine.seq_dp_world_size):
            # ZeRO-3 at another data-parallel size: a rank without a model-states file of its own
            # takes rank 0's (its module entries are empty placeholders on every rank; the weights
            # come from the reshardable ZeRO state).
            pattern = os.path.basename(engine._get_ckpt_name(checkpoints_path, tag, mp_placeholder="*",
                                                             pp_placeholder="0"))[:-3]
            found = [n for n in ce._load_names if fnmatch.fnmatchcase(n, pattern)]
        if len(found) != 1:
            raise StateDictMismatchError(
                f"{ce._load_path} holds {found or 'no'} DeepSpeed model states matching {pattern!r} "
                f"(rank {_rank()}); expected exactly one", path=ce._load_path, missing=[pattern],
                unexpected=found, shape_mismatch={}, dtype_mismatch={},
                remedy="Resume with the ZeRO stage and data-parallel size the checkpoint was saved with.")
        ce.model_states_name = found[0]
        return found[0]

    def _optim_states_name(load_dir, tag) -> str:
        """This rank's ZeRO ``*_optim_states`` entry (at another data-parallel size, where this
        rank had none: rank 0's; its plain values are the same on every rank)."""
        mine = os.path.basename(engine._get_zero_ckpt_name(load_dir, tag))[:-3]
        return mine if mine in ce._load_names else os.path.basename(engine._get_rank_zero_ckpt_name(
            load_dir, tag, engine.checkpoint_mp_rank, 0, engine.bfloat16_enabled()))[:-3]

    def _get_all_ckpt_names(checkpoints_path, tag):
        # DeepSpeed globs the tag directory for this rank's model-states file and asserts that the
        # path exists. Here the file is a subtree of the checkpoint: the path handed back is the
        # checkpoint directory (it exists) and the engine maps it to the one name the same pattern
        # matches (found when the load was planned); load_checkpoint returns the file's path, as
        # DeepSpeed does.
        if ce._load_path is None:
            return orig_names(checkpoints_path, tag)
        if ce.model_states_name is None:
            _model_states_name(checkpoints_path, tag)
        return [ce._load_path]

    def _load_zero_checkpoint(load_dir, tag, load_optimizer_states=True):
        # DeepSpeed's ZeRO load reads every rank's flat partitions and refuses another
        # data-parallel size. Here: the reshardable state (each rank reads its new partition's
        # byte ranges), then the optimizer's plain values from the saved *_optim_states entry.
        if ce._load_path is None:
            return orig_load_zero(load_dir, tag, load_optimizer_states=load_optimizer_states)
        # the lr scheduler and step counters came with the model states (DeepSpeed's own load)
        stage12 = int(engine.zero_optimization_stage()) in (1, 2)
        # DeepSpeed's load keeps the module weights its module load has just set from the
        # checkpoint; so does this one where the checkpoint stores them (older ones hold only the
        # masters: the weights are then rebuilt from them, as a step does).
        zero.load(engine, ce._load_path, load_lr_scheduler_states=False,
                  keep_module_weights=stage12 and not ce.load_meta.get("module_from_masters"))
        if stage12 and not engine.zero_load_from_fp32_weights():
            engine.optimizer.refresh_fp32_params()  # DeepSpeed's option 1: masters from the bit16 weights
        name = _optim_states_name(load_dir, tag)
        plain = ce.load(os.path.join(ce._load_path, name + ".pt"))["optimizer_state_dict"]
        opt = engine.optimizer
        if hasattr(opt, "_load_global_state"):  # ZeRO 1/2: DeepSpeed's own restore of these values
            opt._load_global_state(plain)
        else:  # ZeRO 3 (_rigid_load_state_dict's first lines)
            for key in ("loss_scaler", "dynamic_loss_scale", "overflow"):
                if key in plain:
                    setattr(opt, key, plain[key])
        return True

    engine.save_checkpoint = save_checkpoint
    engine.load_checkpoint = load_checkpoint
    engine._get_all_ckpt_names = _get_all_ckpt_names
    engine._load_zero_checkpoint = _load_zero_checkpoint
    return ce
