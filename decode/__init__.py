"""The decode role (layer 6): ``DecodeRole`` (``node.py``), ``DecodeScheduler``
(``scheduler.py``) and its ``IncomingQueue`` (``incoming.py``: requests whose KV comes from a
prefill node). It never imports ``prefill``."""
