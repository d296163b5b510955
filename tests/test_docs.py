"""README.md and docs/*.md stand alone: every repository file they name exists, and they name no
path outside the repository (launch/env.sh names docs/INSTALL.md, which once did not exist)."""

from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SCRIPTS = [*sorted((ROOT / "launch").glob("*.sh")), ROOT / "tests" / "run.sh"]
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
