"""Optional integrations with other libraries.

Each submodule imports its library only when it is itself imported (``import
distckpt.integrations.torchrec``); ``import distckpt`` never imports any of them, so distckpt works
without them installed.
"""

__all__: list[str] = []
