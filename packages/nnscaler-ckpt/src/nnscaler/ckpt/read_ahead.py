"""`ReadAhead`: a generator run in a helper thread a bounded number of items ahead of its consumer,
so that reading and assembling the next part of a merge overlaps writing and hashing the current
one while at most `depth` items wait (memory stays bounded: `merge` yields slabs of a tensor)."""
from __future__ import annotations

import queue
import threading
from typing import Any, Callable, Iterator

__all__ = ["ReadAhead"]

_DONE = object()


class ReadAhead:
    """``for item in ReadAhead(produce, depth)``: the items of ``produce()`` (a generator
    function), made in a helper thread; an exception it raises is raised here, in order. `close`
    (also on leaving a ``with`` block) stops the helper early and waits for it."""

    def __init__(self, produce: Callable[[], Iterator[Any]], depth: int = 2):
        self._queue: "queue.Queue" = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(produce,), daemon=True,
                                        name="nnscaler-ckpt-read-ahead")
        self._thread.start()

    def _put(self, item) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.05)
                return True
            except queue.Full:
                continue
        return False

    def _run(self, produce) -> None:
        try:
            for item in produce():
                if not self._put((item, None)):
                    return
        except BaseException as e:  # noqa: BLE001 - raised in the consumer
            self._put((None, e))
            return
        self._put((_DONE, None))

    def __iter__(self) -> Iterator[Any]:
        while True:
            item, error = self._queue.get()
            if error is not None:
                raise error
            if item is _DONE:
                return
            yield item

    def close(self) -> None:
        self._stop.set()
        while True:  # unblock a helper waiting to put
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
        self._thread.join()

    def __enter__(self) -> "ReadAhead":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
