"""``lossbeat watch``: a live, pageable monitor of a run whose code you cannot change, from its log.

:mod:`~lossbeat.watch.follow` reads a growing file without re-reading it (rotation, truncation,
half-written lines); :mod:`~lossbeat.watch.command` feeds each record the live parsers
(:mod:`lossbeat.logs.live`) read to a real :class:`~lossbeat.monitor.Monitor`;
:mod:`~lossbeat.watch.ranks` says which rank each log is. See docs/watch.md.
"""

from lossbeat.watch.command import EXIT_COMPLETED, EXIT_IDLE, MonitorFeed, Watcher, add_arguments, run
from lossbeat.watch.follow import Follower

__all__ = ["Watcher", "MonitorFeed", "Follower", "add_arguments", "run", "EXIT_COMPLETED", "EXIT_IDLE"]
