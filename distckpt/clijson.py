"""The version of the command line's ``--json`` documents (``ls``, ``inspect``, ``verify``,
``preflight``), which each carries as ``json_format``. A leaf: the CLI and the modules whose
subcommands it registers (preflight) both read it, neither through the other."""

#: Bumped only when a field changes meaning or disappears (new fields may be added within a version).
JSON_FORMAT = 1
