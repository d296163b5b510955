"""What a check returns and what :func:`distckpt.preflight` hands back: :class:`CheckResult`,
:class:`PreflightReport` (a readable table with ``str()``, a JSON-ready dict with ``to_dict()``),
and :func:`finish`, which folds one check's findings into its result."""

from __future__ import annotations

import dataclasses

from ..errors import DistCkptError

__all__ = ["OK", "WARNING", "ERROR", "CheckResult", "PreflightReport", "finish"]

OK, WARNING, ERROR = "ok", "warning", "error"


@dataclasses.dataclass
class CheckResult:
    """The outcome of one check.

    Attributes:
        name: The check's name (e.g. ``"disk"``).
        status: ``"ok"``, ``"warning"`` or ``"error"``.
        message: One human-readable line (or a few) with the numbers.
        details: Machine-readable numbers and names (JSON-serialisable).
        error: For status ``"error"``, the typed error the check would raise; otherwise None.
    """

    name: str
    status: str
    message: str
    details: dict = dataclasses.field(default_factory=dict)
    error: DistCkptError | None = None

    @property
    def ok(self) -> bool:
        return self.status != ERROR

    def to_dict(self) -> dict:
        out = {"name": self.name, "status": self.status, "message": self.message,
               "details": self.details, "error": None}
        if self.error is not None:
            e = self.error
            out["error"] = {
                "type": type(e).__name__,
                "message": e.message,
                "remedy": e.remedy,
                "path": e.path,
                "rank": e.rank,
                "errno": getattr(e, "errno", None) if isinstance(e, OSError) else e.details.get("errno"),
                "fields": e.details,
            }
        return out


@dataclasses.dataclass
class PreflightReport:
    """Every check's result, in the order they ran.

    ``ok`` is True when no check failed (warnings allowed); ``errors`` and ``warnings`` are the
    failing / warning :class:`CheckResult` objects; ``raise_first()`` raises the typed error of the
    first failing check; ``str(report)`` is a readable table; ``to_dict()`` is JSON-ready.
    """

    path: str
    checks: list[CheckResult]

    @property
    def ok(self) -> bool:
        return not self.errors

    @property
    def errors(self) -> list[CheckResult]:
        return [c for c in self.checks if c.status == ERROR]

    @property
    def warnings(self) -> list[CheckResult]:
        return [c for c in self.checks if c.status == WARNING]

    def get(self, name: str) -> CheckResult | None:
        """The result of the check called ``name``, or None if it did not run."""
        for c in self.checks:
            if c.name == name:
                return c
        return None

    def raise_first(self) -> None:
        """Raise the typed error of the first failing check; return None when all passed.

        Raises:
            DistCkptError: the subclass the failing check produced (DiskFullError, ...).
        """
        for c in self.errors:
            if c.error is not None:
                raise c.error

    def to_dict(self) -> dict:
        return {"path": self.path, "ok": self.ok, "checks": [c.to_dict() for c in self.checks]}

    def __str__(self) -> str:
        n_err, n_warn = len(self.errors), len(self.warnings)
        head = (f"distckpt preflight for {self.path}: "
                f"{n_err} error{'s' * (n_err != 1)}, {n_warn} warning{'s' * (n_warn != 1)}")
        width = max([len("CHECK")] + [len(c.name) for c in self.checks])
        lines = [head, f"{'CHECK':<{width}}  STATUS   MESSAGE"]
        for c in self.checks:
            msg_lines = c.message.splitlines() or [""]
            lines.append(f"{c.name:<{width}}  {c.status.upper():<7}  {msg_lines[0]}")
            pad = " " * (width + 11)
            lines.extend(pad + m for m in msg_lines[1:])
            if c.error is not None:
                lines.append(f"{pad}remedy: {c.error.remedy}")
        return "\n".join(lines)


def finish(name: str, errors: list[DistCkptError], warnings: list[str], ok_message: str,
           details: dict | None = None) -> CheckResult:
    """Fold a check's findings into one result: status error when ``errors`` is not empty (the
    first error is the one the result carries), warning when only ``warnings`` are, else ok with
    ``ok_message``. Every problem is listed in the message (and ``details["problems"]``) so one
    run shows them all. Never raises."""
    details = dict(details or {})
    problems = [e.message for e in errors] + warnings
    if problems:
        details["problems"] = problems
    if errors:
        return CheckResult(name, ERROR, "\n".join(problems), details, errors[0])
    if warnings:
        return CheckResult(name, WARNING, "\n".join(problems), details)
    return CheckResult(name, OK, ok_message, details)
