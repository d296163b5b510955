"""Loaded at interpreter start when this directory is on PYTHONPATH (tests/helpers/s3server.py's
ignore_conditional_writes_env): S3 clients of this process then send no If-None-Match header."""
import os

if os.environ.get("S3_TESTS_IGNORE_IF_NONE_MATCH") == "1":
    from tests.helpers.s3server import ignore_conditional_writes

    ignore_conditional_writes()
