"""The prefill role (layer 8): ``PrefillRole`` (``node.py``), ``PrefillScheduler``
(``scheduler.py``) and its ``OutgoingQueue`` (``outgoing.py``: each request on its way to a
decode node). It never imports ``decode``."""
