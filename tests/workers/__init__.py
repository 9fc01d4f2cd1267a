"""Processes the tests start (torchrun ranks, launchers, scrapers, a signalled trainer): each runs
as a script, so its siblings (worker_exit) import by their plain names."""
