"""The prefill role (layer 6): ``PrefillRole`` (``node.py``) and ``PrefillScheduler``
(``scheduler.py``). It never imports ``decode``."""
