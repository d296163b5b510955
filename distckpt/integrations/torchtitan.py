"""distckpt as torchtitan's checkpoint manager: one line in the job config.

    from distckpt.integrations.torchtitan import DistckptCheckpointManager
    config = Trainer.Config(..., checkpoint=DistckptCheckpointManager.Config(
        enable=True, folder="checkpoint", interval=500, keep_latest_k=3, async_mode="async"))
    # the Trainer builds it: config.checkpoint.build(dataloader=..., model_parts=..., ...)

Import explicitly; ``import distckpt`` never imports torchtitan. Written against torchtitan 0.3.0
(``torchtitan.components.checkpointer.BaseCheckpointManager``): the same build keywords, the same
``states`` (``model`` flattened into the top level as torchtitan's ModelWrapper gives it,
``optimizer``, ``lr_scheduler``, ``dataloader``, ``train_state`` and any other Stateful the trainer
passes), so a distckpt checkpoint has the keys torchtitan's DCP checkpoint has.

Layout and what is loaded:
  * Step N is ``<folder>/step_000000NN`` (distckpt's :class:`~distckpt.CheckpointManager` layout),
    committed atomically: a save killed at any point leaves no directory that looks complete.
  * torchtitan's own DCP manager writes ``<folder>/step-N``. This manager loads those too (through
    distckpt's DCP reader), so a run can switch managers mid-run with the same ``folder``. With
    ``load_step=-1`` the highest step number among complete checkpoints of both kinds is loaded
    (a DCP folder counts when it has ``.metadata``, as torchtitan requires); when both kinds hold
    the same step, distckpt's is loaded. The reverse switch is not possible: torchtitan's manager
    neither sees ``step_*`` directories nor reads distckpt's format.
  * ``keep_latest_k`` rotates distckpt's steps only (committed ones, inside the commit, never the
    step just saved): DCP ``step-N`` folders left by torchtitan's manager are never deleted here.
    As in torchtitan, the last step's save rotates nothing: the newest ``keep_latest_k`` steps
    stay beside a model-only export.
  * Step 0 (a seed checkpoint) loads the model only. A checkpoint holding no state but the
    model's (a ``last_save_model_only`` save, by either manager) loads the model only when asked
    for by its step, with a warning; as the newest checkpoint of a ``load_step=-1`` load it is a
    StateDictMismatchError naming the newest full-state step (torchtitan's manager fails on the
    missing keys there too): a relaunch never quietly restarts the optimizer and train_state.
"""

from __future__ import annotations

import contextlib
import logging
import re
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Callable, Literal

try:
    import torch
    from torchtitan.components.checkpointer import MODEL, BaseCheckpointManager, ModelWrapper
    from torchtitan.config import TORCH_DTYPE_MAP
    from torchtitan.tools import filesystem
except ImportError as exc:  # pragma: no cover - exercised only without torchtitan
    raise ImportError("distckpt.integrations.torchtitan needs torchtitan 0.3.0 (pip install "
                      "torchtitan==0.3.0 --no-deps, plus tyro, einops, torchdata: launch/env.sh)") from exc

from ..errors import (CheckpointExistsError, CheckpointNotFoundError, ConfigError, ReshardError,
                      StateDictMismatchError)
from ..manager import CheckpointManager
from ..restore import load, load_manifest, read
from ..storage import is_url

__all__ = ["DistckptCheckpointManager", "AsyncMode", "FORMAT"]

log = logging.getLogger("distckpt")

DATALOADER = "dataloader"  # torchtitan's key for the dataloader's state
_DP_RANK = re.compile(r"dp_rank_[0-9]+")  # its pickled per-rank entries (ParallelAwareDataloader)

#: ``meta["user"]["torchtitan"]["format"]`` of the checkpoints this manager writes.
FORMAT = 1
AsyncMode = Literal["disabled", "async", "async_with_pinned_mem"]
_ASYNC_MODES = ("disabled", "async", "async_with_pinned_mem")
# torchtitan's own pattern for its DCP step folders (dcp.py, _find_load_step).
_DCP_STEP_RE = re.compile(r"step-([0-9]+)\Z")


@contextlib.contextmanager
def _torchtitan_remedy():
    """A step that exists (an earlier run's, in a folder this manager did not resume from) is
    refused, where torchtitan's DCP manager overwrites it: give the remedy this manager's
    configuration offers (distckpt.CheckpointManager's own names ``overwrite=True``, which
    torchtitan's Config has no field for)."""
    try:
        yield
    except CheckpointExistsError as exc:
        if type(exc) is CheckpointExistsError:
            exc.remedy = ("The folder holds this step from an earlier run, and this manager did not load it "
                          "(torchtitan's DCP manager would overwrite it; distckpt never replaces a committed step "
                          "it was not told to, docs/SEMANTICS.md). Resume from the folder (checkpoint.load(), "
                          "load_step), point checkpoint.folder at a new directory, or delete that step first.")
        raise


class DistckptCheckpointManager(BaseCheckpointManager):
    """torchtitan's checkpoint manager contract, saving and loading through distckpt.

    Built by the trainer as ``config.checkpoint.build(dataloader=, model_parts=, optimizers=,
    lr_schedulers=, states=, sd_adapter=, base_folder=)``, like torchtitan's DCP manager.
    ``save(step, last_step)`` saves every ``interval`` steps (and at step 1 with
    ``enable_first_step_checkpoint``, and at the last step); ``load(step)`` loads ``step`` or, at
    -1, the newest complete checkpoint (distckpt's or DCP's, see the module docstring); with no
    checkpoint in ``folder`` it loads ``initial_load_path`` (model only unless
    ``initial_load_model_only=False``) or returns False (a fresh start).

    Async modes (``async_mode``): ``"disabled"`` saves synchronously (returns once the step is
    committed and durable); ``"async"`` and ``"async_with_pinned_mem"`` return once the state is
    staged in host memory (distckpt's :func:`~distckpt.async_save`): ``save_future`` is then the
    save's :class:`~distckpt.AsyncSaveHandle` (``result()`` waits and raises the save's typed
    error) and the write and commit run in the background. ``"async_with_pinned_mem"`` also
    reserves the staging memory (:func:`distckpt.reserve_staging_memory`, pinned where CUDA is
    available) at the first ``save()`` call, after the first optimizer step, so the first
    checkpoint does not pay for allocating it, and stages in the background as torchtitan's DCP
    manager does (``use_async_staging``): ``save()`` returns after the plan, the copy runs on the
    save's thread beside the next forward and backward, and ``maybe_wait_for_staging()`` (which
    the trainer calls before its optimizer step) waits for what is left of it, through
    ``staging_future``. An optimizer step taken before the copy ended waits for it; another
    in-place change fails that save with StateChangedError (nothing committed;
    :func:`distckpt.async_save`, ``stage_in_background``).
    ``"async"`` stages before ``save()`` returns. A save waits for the previous one still in
    flight first, as torchtitan's does. ``close()`` waits for the save in flight, raises its error, and
    frees the staging memory.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(BaseCheckpointManager.Config):
        """torchtitan's checkpoint fields (BaseCheckpointManager.Config) plus distckpt's.

        Every field of torchtitan's DCP manager is honoured except the Hugging Face ones
        (``last_save_in_hf``, ``initial_load_in_hf``, ``initial_load_in_hf_quantized``), which
        raise ConfigError when set: that format goes through torchtitan's state-dict adapter and
        DCP's safetensors writer/reader, which this manager does not drive. Every invalid value
        raises ConfigError (a ValueError, as torchtitan's checks raise) when the config is
        constructed and again when it is built.
        """

        async_mode: AsyncMode = "disabled"
        """Synchronous save, async save, or async save into pinned staging memory reserved
        up front (distckpt.async_save + distckpt.reserve_staging_memory)."""

        storage_options: dict[str, Any] | None = None
        """fsspec options for a URL ``folder`` (``s3://bucket/run7``); passed to every save and
        load. Only for a URL folder."""

        incremental: bool = False
        """Write only the rows of the DTensor / ShardedTensor tensors that changed since the
        previous step (distckpt.incremental: a chain of deltas on a full step). Local folders
        only."""

        incremental_full_every: int = 8
        """With ``incremental``: a full checkpoint at least every this many saves."""

        allow_pickle: bool = False
        """torchtitan's dataloader state is ``pickle.dumps`` bytes, which its ``load_state_dict``
        unpickles. By default a load first decodes them with :mod:`distckpt.safepickle` (plain
        data and tensors only) and refuses anything else with PickleNotAllowedError before any
        state changes; True hands them over unchecked, for checkpoints you trust."""

        def __post_init__(self) -> None:
            # The fields' types first: torchtitan's own checks compare them, and a str or None
            # there was a bare TypeError (and an unknown export_dtype a KeyError at build).
            def whole(v: Any, least: int) -> bool:
                return isinstance(v, int) and not isinstance(v, bool) and v >= least
            problems = {"interval": None if whole(self.interval, 1) else "an int >= 1",
                        "keep_latest_k": None if whole(self.keep_latest_k, 0) else "an int >= 0",
                        "folder": None if isinstance(self.folder, str) else "a str",
                        "initial_load_path": None if self.initial_load_path is None
                        or isinstance(self.initial_load_path, str) else "a str or None",
                        "export_dtype": None if self.export_dtype in TORCH_DTYPE_MAP
                        else f"one of {sorted(TORCH_DTYPE_MAP)}",
                        "load_step": None if whole(self.load_step, -1) else "an int >= -1",
                        "exclude_from_loading": None if isinstance(self.exclude_from_loading, (list, tuple))
                        and all(isinstance(k, str) for k in self.exclude_from_loading) else "a list of state names"}
            for name, expected in problems.items():
                if expected is not None:
                    raise ConfigError(f"checkpoint.{name}={getattr(self, name)!r}: expected {expected}")
            try:
                BaseCheckpointManager.Config.__post_init__(self)
            except ValueError as exc:  # torchtitan's own checks, typed
                if isinstance(exc, ConfigError):
                    raise
                raise ConfigError(f"checkpoint config: {exc}") from exc
            mode = str(self.async_mode).lower()
            if mode not in _ASYNC_MODES:
                raise ConfigError(f"checkpoint.async_mode={self.async_mode!r}: expected one of {_ASYNC_MODES}")
            self.async_mode = mode
            for name in ("last_save_in_hf", "initial_load_in_hf", "initial_load_in_hf_quantized"):
                if getattr(self, name):
                    raise ConfigError(
                        f"checkpoint.{name}=True: the Hugging Face safetensors format is written and read "
                        "through torchtitan's state-dict adapter and DCP, which DistckptCheckpointManager does "
                        "not drive", remedy="Use torchtitan's CheckpointManager for a Hugging Face export or "
                        "import, or set the field to False (distckpt.read gives the model's tensors by name)")
            if self.storage_options is not None and not isinstance(self.storage_options, dict):
                raise ConfigError(f"checkpoint.storage_options={self.storage_options!r}: expected a dict")
            if self.incremental and (not isinstance(self.incremental_full_every, int)
                                     or self.incremental_full_every < 1):
                raise ConfigError(f"checkpoint.incremental_full_every={self.incremental_full_every!r}: "
                                  "expected an int >= 1")

    def __init__(self, config: Config, *, dataloader: Any, model_parts: list[torch.nn.Module],
                 optimizers: Any, lr_schedulers: Any, states: dict[str, Any], sd_adapter: Any = None,
                 base_folder: str = "") -> None:
        """Set the manager up (no collective, nothing written). Raises ConfigError for a field
        that cannot apply to these objects or this folder: ``exclude_from_loading`` naming a
        state the trainer does not pass, ``storage_options`` with a local folder,
        ``incremental`` with a URL folder."""
        self.enable = config.enable
        self.save_future: Any = None
        self.staging_future: Future | None = None
        if not self.enable:
            return
        self.folder = filesystem.join(base_folder, config.folder) if base_folder else config.folder
        self.interval = config.interval
        self.states = states
        self.states.update({MODEL: ModelWrapper(model_parts), "optimizer": optimizers,
                            "dataloader": dataloader, "lr_scheduler": lr_schedulers})
        # torchtitan checks this at the first load; here it is known now, so it is said now.
        unknown = [k for k in config.exclude_from_loading if k not in self.states]
        if unknown:
            raise ConfigError(f"checkpoint.exclude_from_loading={config.exclude_from_loading!r}: {unknown} "
                              f"name no state of this trainer (it has {sorted(self.states)})")
        self.load_only = config.load_only
        self.exclude_from_loading = list(config.exclude_from_loading)
        self.initial_load_path = config.initial_load_path
        self.initial_load_model_only = config.initial_load_model_only
        self.enable_first_step_checkpoint = config.enable_first_step_checkpoint
        self.last_save_model_only = config.last_save_model_only
        self.export_dtype = TORCH_DTYPE_MAP[config.export_dtype]
        self.async_mode = config.async_mode
        self.keep_latest_k = config.keep_latest_k
        self.storage_options = config.storage_options
        self.allow_pickle = bool(config.allow_pickle)
        self.sd_adapter = sd_adapter  # kept for parity; only the HF paths (refused) would use it
        remote = is_url(self.folder)
        if self.storage_options is not None and not remote:
            raise ConfigError(f"checkpoint.storage_options is for an fsspec URL folder, not {self.folder}")
        incremental = None
        if config.incremental:
            from ..incremental import IncrementalPolicy
            incremental = IncrementalPolicy(full_every=config.incremental_full_every)
        # keep_latest_k=0 is torchtitan's "keep all"; 1 is refused by its Config (kept as is).
        self._mgr = CheckpointManager(self.folder, keep_last=self.keep_latest_k or None,
                                      storage_options=self.storage_options, incremental=incremental)
        self._reserved = False
        log.info("distckpt: torchtitan checkpointing to %s (async_mode=%s, keep_latest_k=%d)",
                 self.folder, self.async_mode, self.keep_latest_k)

    # -----------------------------------------------------------------------------------------
    # The contract's hooks.

    @torch.no_grad()
    def _save(self, curr_step: int, last_step: bool = False) -> bool:
        """Save step ``curr_step`` when the policy says so (see the class docstring); returns
        whether a save was started (sync: committed). Collective on the saving steps. Raises
        what :meth:`distckpt.CheckpointManager.save` raises (sync mode), and the error of the
        previous async save when it failed."""
        if self.async_mode == "async_with_pinned_mem" and not self._reserved and not self.load_only:
            # First call: after the first optimizer step, so the optimizer's states exist and are
            # counted; reserving runs in the background and overlaps the next training steps.
            from ..staging.pool import reserve_staging_memory
            reserve_staging_memory(self._flattened(self.states))
            self._reserved = True
        if not self._should_save(curr_step, last_step):
            return False
        self.maybe_wait_for_saving()
        if last_step:
            self._save_last_step(curr_step)
            return True
        states = self._flattened(self.states)
        meta = {"torchtitan": {"format": FORMAT, "step": curr_step, "model_only": False}}
        if self.async_mode == "disabled":
            with _torchtitan_remedy():
                self._mgr.save(curr_step, states, metadata=meta)
            return True
        pinned = self.async_mode == "async_with_pinned_mem"
        with _torchtitan_remedy():
            # Pinned mode stages on the save's thread, as torchtitan's DCP manager does
            # (use_async_staging): the next forward and backward overlap the copy, and the
            # trainer's maybe_wait_for_staging() before its optimizer step waits for what is left.
            self.save_future = self._mgr.save(curr_step, states, blocking=False, metadata=meta,
                                              stage_in_background=pinned)
        if pinned:
            staged: Future = Future()
            # Resolved, never failed: a failed staging fails the save on every rank, and
            # save_future raises it (a staging future raising on one rank alone would stop that
            # rank before its optimizer step while its peers go on).
            self.save_future._on_staged(lambda: staged.set_result(None))
            self.staging_future = staged
        return True

    @torch.no_grad()
    def _load(self, step: int = -1) -> bool:
        """Load ``step`` (-1: the newest complete checkpoint in ``folder``, distckpt's or DCP's)
        into the trainer's states; with none there, ``initial_load_path`` (model only unless
        ``initial_load_model_only=False``). Returns False when there is nothing to load (a fresh
        start). Collective.

        Raises CheckpointNotFoundError (a FileNotFoundError, as torchtitan raises) for a
        ``step`` with no complete checkpoint in ``folder``; ConfigError (a ValueError, as
        torchtitan raises) for an ``initial_load_path`` that is not a directory;
        StateDictMismatchError for a model-only newest checkpoint at ``step=-1`` (module
        docstring); and what :func:`distckpt.load` raises (ChecksumMismatchError...).
        """
        found = self._agreed_checkpoints()
        if step != -1 and step not in found:
            raise CheckpointNotFoundError(
                f"checkpoint.load_step={step}: no complete checkpoint of step {step} in {self.folder} "
                f"(complete steps: {sorted(found)})", path=self.folder)
        newest = step == -1 and bool(found)
        if newest:
            step = max(found)
        if step == -1:
            if not self.initial_load_path:
                log.info("distckpt: no checkpoint in %s and no initial_load_path: a fresh start", self.folder)
                return False
            path, kind = self.initial_load_path, None
            if not filesystem.isdir(path):  # torchtitan's check and class (a ValueError)
                raise ConfigError(f"checkpoint.initial_load_path={path!r} is not a directory",
                                  remedy="Point it at a checkpoint directory (distckpt's or DCP's).")
            model_only = self.initial_load_model_only
        else:
            path, kind = found[step]
            model_only = step == 0 or self._agreed_model_only(path)
            if model_only and step != 0 and newest:
                # torchtitan's manager fails here too (the other states' keys are missing). A resume
                # that quietly restarted the optimizer, dataloader and train_state from scratch on
                # exported weights would retrain from step 0: said, not done.
                full = [s for s in sorted(found) if s != 0 and s < step and not self._agreed_model_only(found[s][0])]
                raise StateDictMismatchError(
                    f"the newest checkpoint in {self.folder}, step {step}, holds the model only (a last save "
                    f"with last_save_model_only): resuming from it would start the optimizer, LR scheduler, "
                    f"dataloader and train_state afresh", path=path,
                    missing=sorted(k for k in self.states if k != MODEL), unexpected=[], shape_mismatch={},
                    dtype_mismatch={},
                    remedy=(f"Set checkpoint.load_step={full[-1]} to resume from the newest full state"
                            if full else "Save with last_save_model_only=False to be able to resume")
                    + f", or load_step={step} to load the model only (a warning says what stays as it is).")
            if model_only and step != 0:
                log.warning("distckpt: %s holds the model only (a last save with last_save_model_only): "
                            "loading the model; optimizer, LR scheduler, dataloader and train_state stay "
                            "as they are", path)
        states = self._states_to_load(model_only)
        if not model_only and DATALOADER in states:
            self._check_dataloader_state(path)
        log.info("distckpt: loading %s (%s)", path, "model only" if model_only else "full state")
        if kind == "distckpt":  # through the manager: the step it resumed from is protected
            self._mgr.load(states, step)
        else:
            load(states, path, process_group=self._mgr.process_group, storage_options=self.storage_options)
            if step != -1:
                # A DCP step of this folder (torchtitan's manager wrote it): the run resumes from it
                # as from one of the manager's own, so distckpt steps numbered above it are the
                # abandoned branch the next saves replace (they raised CheckpointExistsError,
                # whose remedy was the very load just done).
                self._mgr._note_resumed(step, chosen=not newest)
        self.states[MODEL].load_state_dict(states)
        return True

    def _check_dataloader_state(self, path: str) -> None:
        """Before anything is loaded: refuse torchtitan's pickled dataloader state unless it is
        plain data and tensors (Config.allow_pickle lifts that), and a state saved at another
        data-parallel size (torchtitan's dataloader asserts it after the model has loaded).

        Raises:
            PickleNotAllowedError: a pickle names a global that is not plain data.
            CheckpointCorruptError: a ``dp_rank_*`` value is not a readable pickle.
            ReshardError: saved at another data-parallel size.
        """
        from .. import safepickle
        try:
            saved = read(path, keys=[DATALOADER], storage_options=self.storage_options)[DATALOADER]
        except StateDictMismatchError:
            return  # not in the checkpoint: the load names it missing
        if not isinstance(saved, dict):
            return  # not torchtitan's form: the load's own checks name it
        size = getattr(self.states[DATALOADER], "dp_world_size", None)
        if size is not None and "world_size" in saved and saved["world_size"] != size:
            raise ReshardError(
                f"the dataloader state in {path} was saved at data-parallel size {saved['world_size']!r}, this job "
                f"runs {size}: torchtitan's dataloader does not reshard its state", path=path,
                key=f"{DATALOADER}.world_size",
                remedy="Add 'dataloader' to checkpoint.exclude_from_loading to resume with a fresh dataloader.")
        if self.allow_pickle:
            return
        for key, value in saved.items():
            if isinstance(key, str) and _DP_RANK.fullmatch(key) and isinstance(value, (bytes, bytearray)):
                safepickle.check(value, key=f"{DATALOADER}.{key}", path=path)

    def _maybe_wait_for_staging(self) -> None:
        """Wait until the pinned-mode save in flight has copied the state into staging memory
        (its write goes on): from then on the optimizer may change the state."""
        if self.staging_future is not None:
            self.staging_future.result()
            self.staging_future = None

    def _wait_for_saving(self) -> None:
        """Wait for the async save in flight and clear ``save_future``. Raises the save's typed
        error (the same class a sync save raises)."""
        handle, self.save_future = self.save_future, None
        with _torchtitan_remedy():
            handle.result()

    def _close(self) -> None:
        """Wait for the save in flight (raising its error), free the staging memory."""
        try:
            if self.save_future is not None:
                self._wait_for_saving()
        finally:
            self.staging_future = None
            self._mgr.close()

    # -----------------------------------------------------------------------------------------
    # Helpers.

    def checkpoints(self) -> dict[int, tuple[str, str]]:
        """The complete checkpoints in ``folder``: ``{step: (path, "distckpt" | "dcp")}``.
        distckpt's committed steps, and torchtitan's DCP ``step-N`` folders holding ``.metadata``;
        distckpt's wins when both hold a step. Never writes."""
        found: dict[int, tuple[str, str]] = {}
        try:
            if filesystem.isdir(self.folder):
                for name in filesystem.listdir(self.folder):
                    m = _DCP_STEP_RE.match(name)
                    if m and filesystem.isfile(filesystem.join(filesystem.join(self.folder, name), ".metadata")):
                        found[int(m.group(1))] = (filesystem.join(self.folder, name), "dcp")
        except FileNotFoundError:
            pass  # the folder went away between the check and the listing: no DCP steps
        for s in self._mgr.steps():
            found[s] = (self._mgr.path(s), "distckpt")
        return found

    def _agreed_checkpoints(self) -> dict[int, tuple[str, str]]:
        """:meth:`checkpoints` as rank 0 lists them, on every rank (:meth:`_from_rank0`): ranks
        listing on their own could see a save commit in between and load different steps."""
        return self._from_rank0(self.checkpoints)

    def _agreed_model_only(self, path: str) -> bool:
        """:meth:`_model_only` as rank 0 finds it, on every rank (:meth:`_from_rank0`)."""
        return self._from_rank0(lambda: self._model_only(path))

    def _from_rank0(self, fn: Callable[[], Any]) -> Any:
        """``fn()`` as rank 0 computes it, broadcast to every rank (collective on the manager's
        group). Why: a rank whose own listing or MANIFEST read failed (a step directory one node
        cannot look at) raised alone while its peers went on into the load's collectives and
        waited for it. Raises ``fn``'s error on every rank."""
        from .._dist import control_group
        group = control_group(self._mgr.process_group, operation="DistckptCheckpointManager.load()")
        found, error = None, None
        if group.rank == 0:
            try:
                found = fn()
            except Exception as exc:  # noqa: BLE001 - raised on every rank below
                error = exc
        group.exchange_outcome(error, operation="DistckptCheckpointManager.load()")
        return found if group.world_size == 1 else group.broadcast(found)

    def _model_only(self, path: str) -> bool:
        # A model-only checkpoint (torchtitan's last save, either manager's) holds no key of the
        # trainer's other states; loading those would fail on the missing keys.
        manifest = load_manifest(path, self.storage_options)
        others = tuple(f"{name}." for name in self.states if name != MODEL)
        return not any(k.startswith(others) for k in (*manifest.tensors, *manifest.objects))

    def _flattened(self, states: dict[str, Any]) -> dict[str, Any]:
        # torchtitan's layout: the model's keys at the top level, the other states as subtrees.
        sd = {k: v for k, v in states.items() if k != MODEL}
        if MODEL in states:
            sd.update(states[MODEL].state_dict())
        return sd

    def _states_to_load(self, model_only: bool) -> dict[str, Any]:
        if model_only:
            return dict(self.states[MODEL].state_dict())
        return self._flattened({k: v for k, v in self.states.items() if k not in self.exclude_from_loading})

    def _save_last_step(self, curr_step: int) -> None:
        # As torchtitan: synchronous; model only (in export_dtype) unless last_save_model_only=False.
        if self.last_save_model_only:
            states = {k: v.to(self.export_dtype) if isinstance(v, torch.Tensor) and v.is_floating_point()
                      and v.dtype != self.export_dtype else v
                      for k, v in self.states[MODEL].state_dict().items()}
        else:
            states = self._flattened(self.states)
        meta = {"torchtitan": {"format": FORMAT, "step": curr_step, "model_only": self.last_save_model_only,
                               "export_dtype": str(self.export_dtype) if self.last_save_model_only else None}}
        # As torchtitan: the last save purges nothing (with last_save_model_only, the newest
        # keep_latest_k full-state steps stay resumable beside the export).
        with _torchtitan_remedy():
            self._mgr.save(curr_step, states, metadata=meta, rotate=False)

    def _should_save(self, curr_step: int, last_step: bool = False) -> bool:
        if self.load_only:
            return False
        if curr_step == 1 and self.enable_first_step_checkpoint:
            return True
        return last_step or curr_step % self.interval == 0

    def path(self, step: int) -> str:
        """The directory step ``step`` is (or would be) saved to by this manager."""
        return self._mgr.path(step)

