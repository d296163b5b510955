"""PyTorch Lightning: distckpt as the Trainer's ``CheckpointIO`` plugin.

Import explicitly; ``import distckpt`` never imports lightning (PyPI ``lightning`` 2.6.6).

    from distckpt.integrations.lightning import DistCkptCheckpointIO, load_from_checkpoint
    trainer = Trainer(plugins=[DistCkptCheckpointIO()], callbacks=[ModelCheckpoint(save_last=True)])
    trainer.fit(model, ckpt_path="last")                       # unchanged user code
    model = load_from_checkpoint(MyModule, "ckpt/last.ckpt")   # for MyModule.load_from_checkpoint
    # or, saving in the background:
    Trainer(plugins=[DistCkptCheckpointIO(async_save=True)])   # or AsyncCheckpointIO(DistCkptCheckpointIO())

What a checkpoint is: every path Lightning names (``.../epoch=3-step=400.ckpt``, ``last.ckpt``) is
one distckpt checkpoint *directory* of that name, committed atomically (tmp directory, fsync,
rename): a crash leaves the previous checkpoint of that name or the new one, never a torn file.
Its tensors (weights, optimizer state, ``best_model_score``...) are in the data file, every other
value of Lightning's dict (epoch, global_step, loops, callbacks, hyper_parameters, param_groups,
lr_schedulers) in the MANIFEST as typed plain data, without pickle. ``distckpt.read(path)`` gives
the same values outside Lightning (OrderedDicts and Counters as plain dicts; ``load_checkpoint``
restores them).

Lightning's call paths (2.6.6) this follows:
  * ``Strategy.save_checkpoint`` calls the plugin on global rank 0 only, with the full
    (replicated) checkpoint dict; so each save here is a single-process save (``no_dist``), with
    no collective. ``Strategy.load_checkpoint`` calls ``load_checkpoint`` on every rank; each
    rank reads the whole checkpoint itself (no collective either).
  * Lightning overwrites a name it saved before (``last.ckpt`` at every save): saves here replace
    an existing checkpoint by distckpt's atomic exchange, never in place.
  * ``ModelCheckpoint(save_last="link")`` makes ``last.ckpt`` a relative symlink to the newest
    checkpoint directory (and ``shutil.rmtree``s a previous ``last.ckpt`` directory itself, outside
    this plugin). Loading through the link reads the checkpoint it points to; ``remove_checkpoint``
    of a link removes the link only; rotation never deletes a checkpoint a link in its directory
    points to. With ``async_save=True`` the link is made while its save is in flight: a job killed
    before the commit leaves it dangling, and ``ckpt_path="last"`` trains from scratch (as with
    Lightning's AsyncCheckpointIO); :func:`last_checkpoint` finds the newest committed one.
  * ``ckpt_path="last"`` picks the newest ``last*.ckpt`` entry of the ModelCheckpoint directory by
    modification time; a checkpoint directory qualifies like a file (distckpt's own entries there
    are hidden: ``.NAME.tmp-*``, ``.NAME.lock``, ``.distckpt.lock``).

Exactness (what torch.save would give back, checked at save, before any byte is written):
  * Containers come back with their type (:mod:`distckpt.containers`): ``dict``, ``list``,
    ``tuple``, ``collections.OrderedDict`` with its ``_metadata`` (the module versions
    ``load_state_dict`` reads: ``state_dict`` is one), ``collections.Counter`` (a stock
    ``MultiStepLR``'s milestones) and a ``collections.defaultdict`` of a builtin type. Any other
    dict subclass (or defaultdict factory), a namedtuple or list subclass holding tensors, or an
    object with ``state_dict()``/``load_state_dict()`` (a torchmetrics Metric put in by
    ``on_save_checkpoint``) would come back as a plain container: UnsupportedValueError naming
    its key, whatever ``allow_pickle`` says (store ``dict(x)`` / ``obj.state_dict()``).
  * Other values: those of :mod:`distckpt.values` (scalars, str/bytes, containers of them, Enum,
    dataclass, namedtuple, torch.dtype/device/Size, numpy) round-trip exactly; anything else (a
    class object such as omegaconf's ``hyper_parameters_type``, a lambda) is an
    UnsupportedValueError naming its key, unless ``allow_pickle=True``.
  * ``nn.Parameter``s come back as Parameters (with ``requires_grad``), one tensor under two keys
    as one object, tied weights (two tensors over the same elements) over one memory: recorded
    at save (:func:`distckpt.tensorrecords.record`) and put back after the read. A partial view of another
    tensor's memory comes back as its own tensor, logged by name at save.
  * Tensors come back on CPU (``map_location=None``), every rank reading its own copy; Lightning
    copies them into the module's parameters and casts optimizer state to its parameters' devices.
    TorchCheckpointIO instead puts every tensor back on the device it was saved from (``cuda:0``
    on every rank of a DDP job).

Saves in the background: ``async_save=True`` returns once the tensors are copied into distckpt's
staging memory (the values are a snapshot: training may go on and change them); the write and
commit run on distckpt's thread. The next ``save_checkpoint``, ``load_checkpoint``,
``remove_checkpoint``, :meth:`~DistCkptCheckpointIO.wait` and ``teardown`` (Lightning calls it
when fit/validate/test ends) first wait for it and raise its error, so no error is lost, and
``ModelCheckpoint``'s removal of the previous checkpoint happens only after the newer one is
committed. Lightning's ``AsyncCheckpointIO(DistCkptCheckpointIO())`` works too (tensors cloned
on the caller, the whole save on its thread), but it removes the previous checkpoint while the
newer one may still be unwritten (its ``remove_checkpoint`` is not queued) and reports a failed
save only at the next save or at teardown; prefer ``async_save=True``, and never combine both
(Lightning does not forward ``teardown`` through the wrapper).

Rotation: ``keep_last=N`` keeps, in the directory of each save, the N newest checkpoints (commit
order) written through this plugin; for the saves ModelCheckpoint never deletes: ``save_top_k=-1``
(every checkpoint kept), ``every_n_train_steps`` / ``every_n_epochs`` with ``save_top_k=-1``,
several ModelCheckpoint callbacks in one directory, direct ``trainer.save_checkpoint(path)``
calls, and checkpoints of an earlier run of the job (ModelCheckpoint never deletes what the run
resumed from). It deletes by age, not by score: do not combine it with a monitored ``save_top_k``
in the same directory (it could delete the best checkpoint). Never deleted: the checkpoint just
saved, the one this plugin loaded (resumed from), one a symlink in the directory points to, and
anything not written through this plugin.
"""

from __future__ import annotations

import collections.abc
import logging
import os
import threading
from typing import Any

import torch

try:
    from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
except ImportError as _exc:  # pragma: no cover - exercised only without lightning
    raise ImportError("distckpt.integrations.lightning needs PyTorch Lightning "
                      "(pip install lightning==2.6.6)") from _exc

from .. import commitclock, containers, tensorrecords
from ..commit import SaveResult, commit_guard
from ..errors import (CheckpointCorruptError, CheckpointIncompleteError, CheckpointNotFoundError, ConfigError, DistCkptError,
                      PickleNotAllowedError)
from ..listing import owned_checkpoints
from ..restore import read
from ..save_async import AsyncSaveHandle, async_save_in_root
from ..save_sync import save_in_root
from ..source import open_source
from ..storage import ROOT_LOCK_NAME, Store, dirname, is_url, join, normalize_path, open_store

__all__ = ["DistCkptCheckpointIO", "FORMAT", "load_from_checkpoint", "last_checkpoint"]

log = logging.getLogger("distckpt")

#: ``meta["user"]["lightning"]["format"]`` of checkpoints written by :class:`DistCkptCheckpointIO`.
FORMAT = 1
_META = "lightning"


# ---------------------------------------------------------------------------------------------
# Lightning's dict <-> what distckpt stores.


def _map_tensors(tree: Any, device: torch.device) -> Any:
    if isinstance(tree, torch.Tensor):
        return tree.to(device)
    if isinstance(tree, dict):  # in place: keeps the (Ordered)dict and its _metadata
        for key, value in tree.items():
            tree[key] = _map_tensors(value, device)
        return tree
    if isinstance(tree, list):
        tree[:] = [_map_tensors(v, device) for v in tree]
        return tree
    if type(tree) is tuple:
        return tuple(_map_tensors(v, device) for v in tree)
    return tree


def _device(map_location: Any) -> torch.device | None:
    """The device ``map_location`` names, None for "leave the tensors on CPU".

    Raises:
        ConfigError: a dict or a function (torch.load's remapping by saved location: the saved
            devices are not recorded, every tensor is read into CPU memory), or a CUDA device on a
            host without one.
    """
    if map_location is None:
        return None
    if isinstance(map_location, (str, torch.device)):
        try:
            device = torch.device(map_location)
        except (RuntimeError, TypeError) as exc:
            raise ConfigError(f"map_location={map_location!r} is not a device: {exc}") from None
        if device.type == "cuda" and not torch.cuda.is_available():
            # checked before anything is read (torch's own check is a bare AssertionError, raised
            # at the first tensor's copy)
            raise ConfigError(f"map_location={map_location!r}: no CUDA device here (torch {torch.__version__}, "
                              f"cuda available: False)", remedy="Load with map_location=None or 'cpu'.")
        return device
    raise ConfigError(f"map_location={map_location!r}: only a device (str or torch.device) or None is supported",
                      remedy="Pass a device such as 'cpu' or 'cuda:0' (or None: the tensors stay on CPU); "
                             "the saved devices are not recorded, so a remapping by location has nothing to map.")


# ---------------------------------------------------------------------------------------------
# The plugin.


def _load_torch_file(path: str, device: Any, allow_pickle: bool) -> dict[str, Any]:
    """A torch.save checkpoint file (Lightning's TorchCheckpointIO wrote it), read as Lightning's
    default plugin would but with torch's restricted unpickler unless ``allow_pickle``: a run that
    switches to this plugin resumes from its last ``.ckpt`` file without running code from it.

    Raises PickleNotAllowedError (the global it refused, named) or CheckpointCorruptError."""
    import pickle

    from ..dcp import _unpickler_reason
    log.warning("distckpt: %s is a torch.save file (Lightning's TorchCheckpointIO): reading it with torch.load(%s); "
                "this plugin's own saves are distckpt checkpoint directories", path,
                "weights_only=False" if allow_pickle else "weights_only=True")
    try:
        return torch.load(path, map_location=device if device is not None else "cpu", weights_only=not allow_pickle)
    except pickle.UnpicklingError as exc:
        raise PickleNotAllowedError(
            f"the torch.save file {path} holds values torch.load(weights_only=True) refuses: "
            f"{_unpickler_reason(exc)}", path=path,
            remedy="Pass allow_pickle=True to DistCkptCheckpointIO for a checkpoint you trust, or allow the type "
                   "with torch.serialization.add_safe_globals.") from None
    except (RuntimeError, EOFError, ValueError, OSError) as exc:
        raise CheckpointCorruptError(f"the torch.save file {path} cannot be read: {type(exc).__name__}: {exc}",
                                     path=path) from None


class DistCkptCheckpointIO(CheckpointIO):
    """Lightning's ``CheckpointIO`` writing distckpt checkpoint directories (see the module's
    docstring for what is stored where, and how it differs from TorchCheckpointIO).

    Args:
        storage_options: fsspec options for URL paths (``s3://bucket/run7/...``; s3fs ``key``,
            ``secret``, ``endpoint_url``, ``client_kwargs``), used by every save, load and
            removal. None: s3fs reads the AWS_* variables. Refused (ConfigError) for local paths.
        keep_last: keep the newest ``keep_last`` checkpoints of this plugin in the directory of
            each save (see "Rotation" in the module docstring); None: never delete.
        allow_pickle: store values the value codec cannot (class objects, arbitrary objects) with
            pickle, and unpickle them on load. Off by default: a save then raises
            UnsupportedValueError naming the key, and a load never unpickles.
        async_save: return from ``save_checkpoint`` once the state is staged; the next call (or
            :meth:`wait`, ``teardown``) waits for the save and raises its error.
        verify: check every data block's checksum on load (distckpt's default).

    Raises:
        ConfigError: ``keep_last`` is not a positive int or None, ``storage_options`` not a dict.
    """

    def __init__(self, *, storage_options: dict | None = None, keep_last: int | None = None,
                 allow_pickle: bool = False, async_save: bool = False, verify: bool = True) -> None:
        super().__init__()
        if keep_last is not None and (not isinstance(keep_last, int) or isinstance(keep_last, bool) or keep_last < 1):
            raise ConfigError(f"keep_last={keep_last!r}: expected a positive int or None")
        if storage_options is not None and not isinstance(storage_options, dict):
            raise ConfigError(f"storage_options must be a dict of fsspec options, got {type(storage_options).__name__}")
        self.storage_options = storage_options
        self.keep_last = keep_last
        self.allow_pickle = bool(allow_pickle)
        self.async_save = bool(async_save)
        self.verify = bool(verify)
        #: The SaveResult of the last save that finished (None before).
        self.last_result: SaveResult | None = None
        # One operation at a time: under Lightning's AsyncCheckpointIO a save runs on its thread
        # while ModelCheckpoint removes on the main thread; the removal waits for the save.
        self._lock = threading.RLock()
        self._pending: AsyncSaveHandle | None = None
        # The checkpoint this plugin loaded last (the run resumed from it): rotation keeps it, as
        # ModelCheckpoint never deletes the checkpoint a run resumed from.
        self._resumed_from: str | None = None
        # The partial views already logged by a save of this plugin: logged once, not every epoch.
        self._views_warned: set[tuple[tuple, tuple]] = set()
        # The folders whose checkpoints' commit times were made known before a first save there.
        self._clock_read: set[str] = set()

    # -- save ------------------------------------------------------------------------------
    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        """Save Lightning's ``checkpoint`` dict as the checkpoint directory ``path``, atomically,
        replacing a checkpoint already there (Lightning rewrites ``last.ckpt``); the parent
        directory is created. Single-process (Lightning calls it on global rank 0 only). Returns
        once committed and durable, or with ``async_save`` once staged.

        Args:
            storage_options: fsspec options for this save only (in place of the plugin's).

        Raises:
            UnsupportedValueError: a value or container that would not come back exactly (named
                by key; see the module docstring), nothing written.
            The errors of :func:`distckpt.save` (DiskFullError, StoragePermissionError,
            SaveInProgressError...), and the error of the previous async save, which comes first.
        """
        with self._lock:
            self.wait()
            options = self.storage_options if storage_options is None else storage_options
            if options is not None and not isinstance(options, dict):
                raise ConfigError(f"storage_options must be a dict of fsspec options, got {type(options).__name__}")
            final = normalize_path(path)
            ordered = containers.record(checkpoint)
            metadata = {_META: {"format": FORMAT, "ordered": ordered, "tensors": tensorrecords.record(checkpoint, warned=self._views_warned)}}
            kwargs: dict[str, Any] = dict(overwrite=True, allow_pickle=self.allow_pickle, metadata=metadata,
                                          no_dist=True, storage_options=options)
            if self.keep_last is not None:
                # Rotation runs inside the commit, under the directory's lock, so two savers into
                # one directory never rotate each other's saves half-way.
                parent = dirname(final)
                store = open_store(final, options)
                if parent not in self._clock_read:
                    # Rotation keeps the newest by commit time: this run's saves are stamped after
                    # the folder's (distckpt.commitclock), whatever this host's clock says.
                    try:
                        for _, created in _our_checkpoints(store, parent):
                            commitclock.observe(parent, created)
                        self._clock_read.add(parent)
                    except DistCkptError as exc:  # the save says what is wrong with the folder
                        log.warning("distckpt: could not read the commit times in %s before saving: %s", parent, exc)
                protect = self._resumed_from
                kwargs.update(after_commit=lambda: self._rotate(store, parent, final, protect),
                              lock_path=join(parent, ROOT_LOCK_NAME))
            if self.async_save:
                # The folder exists when this returns, as after a sync save: Lightning links
                # last.ckpt to the checkpoint at once (save_last="link"), and the link (or its
                # fallback copy) in a folder the save's thread has not created yet failed.
                open_store(final, options).make_root(dirname(final))
                handle = async_save_in_root(checkpoint, final, **kwargs)
                self._pending = handle
                if handle.done():  # failed while planning (an unsupported value): say so now
                    self.wait()
            else:
                self.last_result = save_in_root(checkpoint, final, **kwargs)

    def wait(self) -> SaveResult | None:
        """Wait for the async save in flight, if any. Returns its SaveResult (None when there was
        none). Raises that save's typed error (then it is no longer pending)."""
        with self._lock:
            handle, self._pending = self._pending, None
            if handle is None:
                return None
            self.last_result = handle.result()
            return self.last_result

    def teardown(self) -> None:
        """Lightning's end of fit/validate/test: wait for the async save in flight and raise its
        error."""
        self.wait()

    def _rotate(self, store: Store, parent: str, just_saved: str, resumed_from: str | None) -> None:
        # Rank 0, inside the commit of ``just_saved``, holding the directory's lock.
        guard = commit_guard()
        ours = sorted(_our_checkpoints(store, parent), key=lambda e: (e[1], e[0]))
        keep = {_real(just_saved), _real(resumed_from)} | _link_targets(parent)
        excess = ours[:max(0, len(ours) - self.keep_last)]
        for name, _ in excess:
            path = join(parent, name)
            if _real(path) in keep:
                continue
            log.info("distckpt: keep_last=%d: removing %s", self.keep_last, path)
            guard(f"delete {path}")  # the save's lock or lease still held (not taken over while frozen)
            store.remove_checkpoint(path)

    # -- load ------------------------------------------------------------------------------
    def load_checkpoint(self, path: Any, map_location: Any = None, weights_only: bool | None = None) -> dict[str, Any]:
        """The dict saved at ``path`` (a checkpoint directory, or a symlink to one), every value as
        saved, tensors on CPU or on ``map_location``. Read whole, every block's checksum checked,
        before anything is returned: never a partly filled dict.

        Args:
            map_location: None (CPU), or a device (str / torch.device) for every tensor.
            weights_only: True refuses pickled values even with ``allow_pickle`` (torch.load's
                promise: tensors and plain values only). False does not allow them by itself.

        Raises:
            CheckpointNotFoundError: nothing, or no distckpt checkpoint, at ``path``. A torch.save
                file there (a ``.ckpt`` Lightning's default TorchCheckpointIO wrote: a run that
                switches plugins) is read with ``torch.load``, ``weights_only=True`` unless
                ``allow_pickle`` (and ``weights_only`` is not True), with a warning.
            CheckpointIncompleteError: a directory that was never committed.
            ManifestCorruptError, ChecksumMismatchError, DataFileMissingError,
            DataFileTruncatedError (CheckpointCorruptError): a damaged checkpoint.
            CheckpointRemovedError: it was removed or replaced while being read.
            PickleNotAllowedError: it holds pickled values and ``allow_pickle`` is off (or
                ``weights_only`` is True).
            UnsupportedValueError: a value's class (Enum, dataclass, namedtuple) cannot be imported.
            ConfigError: a ``map_location`` that is not a device.
            The error of the previous async save, which comes first.
        """
        device = _device(map_location)
        with self._lock:
            self.wait()
            final = normalize_path(path)
            if not is_url(final) and os.path.islink(final):
                # save_last="link": read the checkpoint the link names (distckpt never follows a
                # symlink inside a checkpoint; the link itself is Lightning's pointer).
                final = os.path.realpath(final)
            allow_pickle = self.allow_pickle and weights_only is not True
            if not is_url(final) and os.path.isfile(final):
                from ..storage.posix.locate import check_checkpoint_dir
                try:
                    check_checkpoint_dir(final)
                except CheckpointNotFoundError as exc:
                    if getattr(exc, "found", None) != "torch.save":
                        raise
                    tree = _load_torch_file(final, device, allow_pickle)
                    self._resumed_from = final
                    return tree
            source = open_source(final, self.storage_options)
            # One guard around both reads: a checkpoint replaced between the MANIFEST read for the
            # layout and the data read raises CheckpointRemovedError instead of mixing two saves.
            with source.guard():
                manifest = source.manifest()
                tree = read(final, verify=self.verify, allow_pickle=allow_pickle,
                            storage_options=self.storage_options)
            user = manifest.meta.get("user")
            ours = user.get(_META) if isinstance(user, dict) else None
            if isinstance(ours, dict) and ours.get("format") == FORMAT:
                tree = containers.rebuild(tree, ours.get("ordered", []), where=f"meta.user.{_META}.ordered",
                                          path=final)
            if device is not None:
                tree = _map_tensors(tree, device)
            if isinstance(ours, dict) and ours.get("format") == FORMAT and "tensors" in ours:
                tree = tensorrecords.restore(tree, ours["tensors"], where=f"meta.user.{_META}.tensors", path=final)
            self._resumed_from = final
            return tree

    # -- remove ----------------------------------------------------------------------------
    def remove_checkpoint(self, path: Any) -> None:
        """Remove the checkpoint directory at ``path``: it stops being a checkpoint in one step
        (renamed aside, then deleted), so it never looks half-present. A symlink (save_last="link")
        is unlinked, its target kept. Nothing at ``path``: nothing to do (as TorchCheckpointIO).

        Raises:
            CheckpointNotFoundError: ``path`` is a file (not a distckpt checkpoint; left alone).
            CheckpointIncompleteError: a directory without MANIFEST (left alone).
            StorageError subclasses; the error of the previous async save, which comes first.
        """
        with self._lock:
            self.wait()
            final = normalize_path(path)
            if not is_url(final):
                if os.path.islink(final):
                    try:
                        os.unlink(final)
                    except FileNotFoundError:
                        pass
                    return
                if os.path.lexists(final) and not os.path.isdir(final):
                    raise CheckpointNotFoundError(
                        f"{final} is a file, not a distckpt checkpoint directory; not removed", path=final,
                        remedy="Remove it yourself if it is not needed (a torch.save file from another "
                               "CheckpointIO, for example).")
            store = open_store(final, self.storage_options)
            if not store.exists(final):
                log.debug("distckpt: remove_checkpoint(%s): nothing there", final)
                return
            if not store.has_manifest(final):
                raise CheckpointIncompleteError(
                    f"{final} is not a distckpt checkpoint (no MANIFEST); not removed", path=final,
                    remedy="Remove it yourself if it is not needed.")
            store.remove_checkpoint(final)
            if final == self._resumed_from:
                self._resumed_from = None


def _our_checkpoints(store: Store, parent: str) -> list[tuple[str, float]]:
    """(name, commit time) of every committed checkpoint of this plugin directly in ``parent``."""
    def ours(user: dict | None) -> bool:
        meta = user.get(_META) if user is not None else None
        return isinstance(meta, dict) and meta.get("format") == FORMAT
    return owned_checkpoints(store, parent, ours)


def last_checkpoint(dirpath: str | os.PathLike, storage_options: dict | None = None) -> str | None:
    """The path of the newest committed checkpoint this plugin wrote directly in ``dirpath`` (a
    ModelCheckpoint's ``dirpath``), by commit time, or None when it holds none: a resume point that
    needs no ``last.ckpt``. Pass it as ``Trainer.fit(ckpt_path=...)``.

    Why: with ``save_last="link"`` and ``async_save=True``, Lightning links ``last.ckpt`` to a
    checkpoint whose save is still in flight; a job killed before that save commits leaves the
    link dangling, and ``ckpt_path="last"`` then finds no checkpoint and trains from scratch (as
    with Lightning's own AsyncCheckpointIO), while the committed checkpoint before it sits beside
    it. Symlinks are not followed; a checkpoint whose MANIFEST does not decode is skipped. Never
    writes.

    Raises the store's listing errors (a directory that cannot be read); CheckpointNotFoundError
    when ``dirpath`` does not exist."""
    parent = normalize_path(dirpath)
    store = open_store(parent, storage_options)
    # (a dangling symlink exists as a name, not as a directory: "no checkpoint" would start over)
    if not store.exists(parent) or (not is_url(parent) and not os.path.isdir(parent)):
        raise CheckpointNotFoundError(f"{parent} does not exist (or is no directory)", path=parent)
    found = _our_checkpoints(store, parent)
    if not found:
        return None
    name, _created = max(found, key=lambda e: (e[1], e[0]))
    return join(parent, name)


def _real(path: str | None) -> str | None:
    """``path`` with symlinks resolved (local paths; a URL as it is), for comparing names."""
    return path if path is None or is_url(path) else os.path.realpath(path)


def _link_targets(parent: str) -> set[str]:
    """The paths the symlinks directly in the local directory ``parent`` point to (none on an
    object store)."""
    if is_url(parent):
        return set()
    out = set()
    try:
        entries = os.listdir(parent)
    except OSError:
        return out
    for name in entries:
        link = os.path.join(parent, name)
        if os.path.islink(link):
            out.add(os.path.realpath(link))
    return out


# ---------------------------------------------------------------------------------------------
# LightningModule.load_from_checkpoint for this plugin's checkpoints.


def load_from_checkpoint(cls: Any, checkpoint_path: Any, map_location: Any = None, hparams_file: Any = None,
                         strict: bool | None = None, weights_only: bool | None = None, *,
                         allow_pickle: bool = False, storage_options: dict | None = None, **kwargs: Any) -> Any:
    """``cls.load_from_checkpoint(checkpoint_path, ...)`` for a checkpoint written through
    :class:`DistCkptCheckpointIO` (or a torch.save ``.ckpt``), for a LightningModule or a
    LightningDataModule class ``cls``: Lightning's own classmethod reads the path with torch.load
    and never asks the CheckpointIO (IsADirectoryError on a checkpoint directory). The steps are
    Lightning 2.6.6's (``lightning.pytorch.core.saving._load_from_checkpoint``): legacy migration,
    ``hparams_file`` over the saved hyper-parameters, ``kwargs`` over both, the module built from
    them and the ``state_dict`` loaded (``strict``), moved to the device of its tensors.

    Differs from Lightning's in one way: the saved devices are not recorded, so the tensors, and
    the module, are on CPU, or on ``map_location`` (one device; a dict or a function is a
    ConfigError), where Lightning's default puts them back on the device they were saved from.
    ``weights_only``: as for :meth:`DistCkptCheckpointIO.load_checkpoint`.
    ``allow_pickle``/``storage_options``: as for the plugin.

    Raises: ConfigError for a ``cls`` that is not a LightningModule/LightningDataModule class
    (before anything is read) or a bad ``map_location``/``hparams_file``; the errors of
    :meth:`DistCkptCheckpointIO.load_checkpoint`; Lightning's own for the module (a missing key
    under ``strict``, a constructor argument missing).
    """
    import lightning.pytorch as pl
    from lightning.pytorch.core import saving

    if not (isinstance(cls, type) and issubclass(cls, (pl.LightningModule, pl.LightningDataModule))):
        raise ConfigError(f"{cls!r} is not a LightningModule or LightningDataModule class",
                          remedy="Pass the class itself: load_from_checkpoint(MyModule, path).")
    checkpoint = DistCkptCheckpointIO(allow_pickle=allow_pickle, storage_options=storage_options).load_checkpoint(
        checkpoint_path, map_location=map_location, weights_only=weights_only)
    # What Lightning's steps below index or compare, checked first: a crafted checkpoint failed in
    # them untyped (a str's .update, packaging's InvalidVersion).
    where = os.fspath(checkpoint_path) if isinstance(checkpoint_path, (str, os.PathLike)) else None
    hp = checkpoint.get(cls.CHECKPOINT_HYPER_PARAMS_KEY)
    if hp is not None and not isinstance(hp, collections.abc.Mapping):  # (a dict, or OmegaConf's DictConfig)
        raise CheckpointCorruptError(f"the checkpoint's {cls.CHECKPOINT_HYPER_PARAMS_KEY!r} is a {type(hp).__name__}, "
                                     f"not a mapping", path=where, key=cls.CHECKPOINT_HYPER_PARAMS_KEY)
    version = checkpoint.get("pytorch-lightning_version")
    if version is not None:
        from packaging.version import InvalidVersion, Version
        try:
            Version(version if isinstance(version, str) else "")
        except InvalidVersion:
            raise CheckpointCorruptError(f"the checkpoint's 'pytorch-lightning_version' {str(version)[:50]!r} is not a "
                                         f"version", path=where, key="pytorch-lightning_version") from None
    sd = checkpoint.get("state_dict")
    if sd is not None and not isinstance(sd, dict):
        raise CheckpointCorruptError(f"the checkpoint's 'state_dict' is a {type(sd).__name__}, not a dict",
                                     path=where, key="state_dict")
    checkpoint = saving._pl_migrate_checkpoint(
        checkpoint, checkpoint_path=checkpoint_path if isinstance(checkpoint_path, (str, os.PathLike)) else None)
    if hparams_file is not None:
        extension = str(hparams_file).rsplit(".", 1)[-1].lower()
        if extension == "csv":
            checkpoint[cls.CHECKPOINT_HYPER_PARAMS_KEY] = saving.load_hparams_from_tags_csv(hparams_file)
        elif extension in ("yml", "yaml"):
            checkpoint[cls.CHECKPOINT_HYPER_PARAMS_KEY] = saving.load_hparams_from_yaml(hparams_file)
        else:
            raise ConfigError(f"hparams_file={hparams_file!r}: a .csv, .yml or .yaml file is required")
    checkpoint.setdefault(cls.CHECKPOINT_HYPER_PARAMS_KEY, {})
    checkpoint[cls.CHECKPOINT_HYPER_PARAMS_KEY].update(kwargs)
    if issubclass(cls, pl.LightningDataModule):
        return saving._load_state(cls, checkpoint, **kwargs)
    model = saving._load_state(cls, checkpoint, strict=strict, **kwargs)
    state_dict = checkpoint.get("state_dict") or {}
    if not state_dict:
        log.warning("distckpt: the state dict in %r contains no parameters", checkpoint_path)
        return model
    device = next((t.device for t in state_dict.values() if isinstance(t, torch.Tensor)), None)
    return model.to(device) if device is not None else model
