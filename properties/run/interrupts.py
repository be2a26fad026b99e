"""Ctrl-C reaches a main thread blocked in C.

The kernel hands a process-directed SIGINT to any thread that does not block it,
and jax's runtime threads do not. Python's C handler then only marks the signal:
a main thread asleep in a system call (a hung kernel, a hung case's sleep) raises
KeyboardInterrupt when that call returns, which may be never, and the case is
not marked interrupted. A watcher thread reads the signal's byte from Python's
wakeup fd and pokes the main thread with a signal of its own, whose handler does
nothing; the system call fails with EINTR and Python runs the pending SIGINT
handler there (docs/VERIFICATION.md, "Crashes, hangs, replay").
"""

from __future__ import annotations

import os
import signal
import threading

_POKE = getattr(signal, "SIGURG", None)  # ignored by default: no other use of it is harmed
_STOP = b"\0"  # no signal has number 0


class _Watcher:

  def __init__(self, read_fd: int, write_fd: int, old_poke_handler):
    self.read_fd, self.write_fd = read_fd, write_fd
    self.old_poke_handler = old_poke_handler
    self.thread = threading.Thread(target=self._run, name="ua-interrupts", daemon=True)

  def _run(self):
    main = threading.main_thread().ident
    while True:
      try:
        data = os.read(self.read_fd, 64)
      except OSError:
        return
      if not data or _STOP in data:
        return
      if signal.SIGINT in data:
        signal.pthread_kill(main, _POKE)


_WATCHER: _Watcher | None = None


def install() -> bool:
  """Starts the watcher, where this is the main thread, the platform has the
  poke signal and nothing else uses Python's wakeup fd; whether it runs."""
  global _WATCHER
  if _WATCHER is not None:
    return True
  if _POKE is None or threading.current_thread() is not threading.main_thread():
    return False
  if signal.getsignal(_POKE) not in (signal.SIG_DFL, signal.SIG_IGN, None):
    return False  # the program handles it itself
  read_fd, write_fd = os.pipe()
  os.set_blocking(write_fd, False)
  try:
    old = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
  except (ValueError, OSError):
    os.close(read_fd), os.close(write_fd)
    return False
  if old != -1:  # someone else's (an event loop's): leave it theirs
    signal.set_wakeup_fd(old)
    os.close(read_fd), os.close(write_fd)
    return False
  old_handler = signal.signal(_POKE, lambda signum, frame: None)
  _WATCHER = _Watcher(read_fd, write_fd, old_handler)
  _WATCHER.thread.start()
  return True


def uninstall() -> None:
  """Stops the watcher and gives back the wakeup fd and the poke's handler."""
  global _WATCHER
  watcher, _WATCHER = _WATCHER, None
  if watcher is None:
    return
  signal.set_wakeup_fd(-1)
  signal.signal(_POKE, watcher.old_poke_handler)
  os.write(watcher.write_fd, _STOP)
  watcher.thread.join(timeout=5)
  os.close(watcher.write_fd)
  if not watcher.thread.is_alive():
    os.close(watcher.read_fd)
