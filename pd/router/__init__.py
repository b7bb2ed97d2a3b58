"""The router (above the node and its roles): which nodes each request goes to. The
``Coordinator`` (``coordinator.py``) books what ``RoutePolicy`` (``policy.py``) chooses; pull
costing in ``pulls.py``, where each recent request went in ``route_log.py``. Plain Python: no
sockets, no Ray (``tests/router/test_imports.py``); the cluster client feeds it events, stats
and request life-cycle calls."""
