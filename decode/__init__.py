"""The decode role (layer 6): ``DecodeRole`` and ``IncomingKV`` (``node.py``) and
``DecodeScheduler`` (``scheduler.py``). It never imports ``prefill``."""
