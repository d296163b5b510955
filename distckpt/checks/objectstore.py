"""An object store's pre-flight in the report: the outcomes of
:func:`distckpt.storage.object.check.run_checks` (credentials, endpoint, bucket, a probe object)
as :class:`~distckpt.checks.report.CheckResult` rows."""

from __future__ import annotations

from typing import Any, Mapping

from .report import ERROR, OK, CheckResult

__all__ = ["object_store_results"]


def object_store_results(url: str, storage_options: Mapping[str, Any] | None,
                         rank: int | None) -> list[CheckResult]:
    """One result per object-store check that ran, in order; the checks stop at the first failure,
    which is the last result (status error, carrying its typed error). Writes one probe object
    next to the checkpoint and always removes it. Raises only what the object-store checks do not
    translate (a bug), which :func:`distckpt.preflight` turns into a warning."""
    # Imported here: the object-store stack (asyncio, the fsspec client) costs tens of ms to
    # import, and `import distckpt` runs this package; only an object-store URL pays for it.
    from ..storage.object.check import run_checks
    results = []
    for name, msg, details, err in run_checks(url, storage_options, rank, probe=True):
        if err is None:
            results.append(CheckResult(name, OK, msg, details))
        else:
            results.append(CheckResult(name, ERROR, getattr(err, "message", str(err)), dict(details), err))
    return results
