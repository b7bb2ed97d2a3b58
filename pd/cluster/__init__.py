"""The server's request plane (above the router): the ``ClusterClient`` (``client.py``: the
cluster as an ``EngineClient`` in the server process, and its membership) composed of its
``NodeSockets`` (``sockets.py``), ``Flights`` (``flights.py``, one ``Flight`` a request in
``flight.py``), ``Liveness`` (the watchdog), ``MirrorSync`` (cache snapshots, ``mirror.py``), the
queue for room (``room.py``), latency windows (``slo.py``) and its event loop
(``event_loop.py``); its settings and the pools it knows in ``client_config.py``."""
