"""The object-store back end (fsspec; s3:// through s3fs): store.py is the Store, request.py the
deadline on every request, errors.py the client exceptions as typed errors, check.py the pre-flight."""
