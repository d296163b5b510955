"""distckpt.fill's read session (kept readers and bounce slots across the fills of a convert)."""

from __future__ import annotations

import threading
import time

from distckpt.fill import _Session


class _Reader:
    """A pipeline reader holding a view of the session's slots (as the C reader holds them
    registered) until it is closed; closing takes a while."""

    def __init__(self, slots):
        self.view, self.closed = memoryview(slots), False

    def close(self):
        time.sleep(0.05)
        self.view.release()
        self.closed = True


def test_workers_taking_buffers_at_once_never_unmap_the_slots_under_a_reader_still_closing():
    """Every read worker of a fill calls take(), which drops the slots the previous fill kept. A
    second worker saw the readers already taken by the first, which was still closing them, and
    unmapped the slots under them: a raw BufferError ("cannot close exported pointers exist")
    from convert, seen in about half of an outside user's DCP conversions. Now one thread drops
    them while the others wait."""
    session = _Session(keep_open=True)
    try:
        slots = session.slots(1 << 20, lambda: None)
        for i in range(2):
            session.reader(f"f{i}", lambda path: _Reader(slots))
        errors, start = [], threading.Barrier(4)

        def worker():
            start.wait()
            try:
                session.give(session.take(4096))
            except BaseException as exc:  # noqa: BLE001 - the test reports it
                errors.append(exc)

        threads = [threading.Thread(target=worker) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert errors == [], errors
        assert session._slots is None and session._readers == {}
    finally:
        session.close()
