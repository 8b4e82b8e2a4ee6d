"""The watched folder: `python -m app.watcher` (`doctune watch`; `doctune up` starts it).

Each project has an inbox folder. A file put there becomes a document through the same
services as an upload (`receive_local_file` + `register_uploads`; extraction is queued to
the worker after the commit), once it is complete: its size, modification time and change
time held still for `settings.watch_stable_s` seconds, and it is read whole without
changing. Editing a file adds a version, deleting it retires its document, moving it
keeps the document (app/services/inbox.py).

File-system events (watchdog: inotify, FSEvents, ReadDirectoryChangesW) only say "look
again soon"; what counts is a scan of the folder, repeated every `watch_rescan_s` anyway,
so an event lost to a full kernel queue, a network drive without events, or a watcher that
was not running costs a delay, never a file. The loop also runs auto-train
(app/services/autotrain.py). Every step is guarded: a bad file or a database hiccup is
logged and tried again later, and the watcher keeps running.

The loop is `loop.Watcher`, its per-folder state `state`, the scan of one folder `scan`,
the read of one file that held still `read`.
"""

from app.watcher.loop import Watcher, main

__all__ = ["Watcher", "main"]
