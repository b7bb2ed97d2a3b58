"""The decode role (layer 8): ``DecodeRole`` (``node.py``), ``DecodeScheduler``
(``scheduler.py``) and its ``IncomingQueue`` (``incoming.py``: requests whose KV comes from a
prefill node). It never imports ``prefill``."""
