"""Storage back ends. ``local`` is the POSIX fast path (rename-based commit); an fsspec back end for
object stores (no rename: MANIFEST written last is the commit marker) plugs in beside it."""
