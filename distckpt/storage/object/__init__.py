"""The object-store back end (fsspec; s3:// through s3fs): store.py is the Store, lease.py a save's
lease, settings.py the knobs read at each save, request.py the deadline on every request, errors.py
the client exceptions as typed errors, check.py the pre-flight."""
