"""Progress bars: tqdm when it is installed (on stderr), else a plain line every few seconds."""

import sys
import time
from typing import Callable, Iterable

try:
    from tqdm import tqdm
except ImportError:  # pragma: no cover - tqdm comes with transformers' usual installs
    tqdm = None

PLAIN_EVERY_S = 10.0


class Bar:
    """update(n, **postfix) / close(); `enabled` False writes nothing (quick mode in tests)."""

    def __init__(self, total: int, desc: str, initial: int = 0, log: Callable[[str], None] = print,
                 enabled: bool = True):
        self.total, self.desc, self.count, self.log = total, desc, initial, log
        self.enabled = enabled
        self._bar = None
        if enabled and tqdm is not None and sys.stderr.isatty():
            self._bar = tqdm(total=total, initial=initial, desc=desc, dynamic_ncols=True)
        self._last = time.monotonic()

    def update(self, n: int = 1, **postfix) -> None:
        self.count += n
        if self._bar is not None:
            self._bar.update(n)
            if postfix:
                self._bar.set_postfix(postfix, refresh=False)
        elif self.enabled and (time.monotonic() - self._last >= PLAIN_EVERY_S or self.count == self.total):
            self._last = time.monotonic()
            extra = " ".join(f"{k}={v}" for k, v in postfix.items())
            self.log(f"{self.desc}: {self.count}/{self.total} {extra}".rstrip())

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def progress(items: Iterable, desc: str, log: Callable[[str], None] = print, enabled: bool = True):
    """Iterates `items` (a sized iterable) under a bar."""
    items = list(items)
    bar = Bar(len(items), desc, log=log, enabled=enabled)
    try:
        for item in items:
            yield item
            bar.update(1)
    finally:
        bar.close()
