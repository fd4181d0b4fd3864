"""Logs: the value codec, the streamed log, its lock, readers, files, checkpoints.

Nothing here imports torch when imported.
"""
