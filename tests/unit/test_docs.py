"""README.md and docs/*.md stand alone: every repository file they name exists, and they name no
path outside the repository (launch/env.sh names docs/INSTALL.md, which once did not exist)."""

from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# The launch scripts (env.sh, demo.sh, bench/, examples/) and the test runner: their usage lines
# and pointers name repository files too.
SCRIPTS = [*sorted(p for p in (ROOT / "launch").rglob("*") if p.suffix in (".sh", ".py", ".sbatch")),
           ROOT / "tests" / "run.sh"]
# A repository path: one of the top-level folders, then a file name with an extension.
_PATH = re.compile(r"(?<![\w/.])((?:distckpt|docs|launch|tests|csrc)/[\w./-]*\w\.(?:py|md|sh|c|sbatch|json|toml))\b")


def _named(files):
    for f in files:
        for m in _PATH.finditer(f.read_text()):
            yield f.relative_to(ROOT), m.group(1)


def test_every_file_the_docs_and_scripts_name_exists():
    missing = [(str(where), name) for where, name in _named(DOCS + SCRIPTS) if not (ROOT / name).exists()]
    assert missing == []
    assert any(name == "docs/INSTALL.md" for _, name in _named(SCRIPTS))  # the check sees env.sh's pointer


def test_docs_name_no_path_outside_the_repository():
    bad = [(str(f.relative_to(ROOT)), m) for f in DOCS for m in re.findall(r"/work/\S*|\.\./shared\S*|REFERENCE\.md", f.read_text())]
    assert bad == []


def test_cli_doc_lists_every_command_and_exit_status_of_the_program():
    """docs/CLI.md's synopsis names every subcommand the parser has, and its exit statuses are
    the ones `distckpt --help` lists (convert and 130 were once missing)."""
    import argparse

    from distckpt.cli import build_parser
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    text = (ROOT / "docs" / "CLI.md").read_text()
    synopsis = text.split("```")[1]
    assert sorted(c for c in sub.choices if f"distckpt {c} " not in synopsis) == []
    epilog = " ".join(parser.epilog.split())
    for code, meaning in (("0", "success"), ("1", "failed"), ("2", "bad usage"), ("130", "interrupted")):
        assert re.search(rf"\b{code}\b[^.;,]*{meaning}", epilog), (code, epilog)
        assert re.search(rf"\b{code}\b[^.;]*{meaning}", " ".join(text.split())), (code, meaning)


def test_docs_print_sizes_as_the_program_does_and_cite_no_issue_numbers():
    """Sizes the program prints are binary (GiB, never GB: docs quoting a message must agree) and
    decimal suffixes are refused, not read as powers of 1000; an outside reader cannot follow
    "issue 14", so the docs say what they mean instead."""
    quoted, issues, decimal = [], [], []
    for f in DOCS:
        text = f.read_text()
        name = str(f.relative_to(ROOT))
        if f.name != "BENCHMARKS.md":  # its tables report MB/s and byte counts as measured (fio's units)
            quoted += [(name, m) for m in re.findall(r"`[^`\n]*\b\d+(?:\.\d+)? [KMGTP]B\b[^`\n]*`", text)]
        issues += [(name, m) for m in re.findall(r"\(issue[^)]*\)|\bissues? #?\d+", text)]
        decimal += [(name, m) for m in re.findall(r"powers of 1000", text)]
    assert quoted == [] and issues == [] and decimal == []


def test_the_path_check_flags_a_file_that_is_not_there():
    """The check above would catch a stale reference: paths of the layout before tests/ had tier
    folders and launch/ had bench/ and examples/ are recognised as repository paths, and missing."""
    text = "see `tests/test_manifest.py`, tests/_powercut_fs.py and `torchrun launch/demo.py save` (launch/bench.py)"
    named = [m.group(1) for m in _PATH.finditer(text)]
    assert named == ["tests/test_manifest.py", "tests/_powercut_fs.py", "launch/demo.py", "launch/bench.py"]
    assert [n for n in named if (ROOT / n).exists()] == []
