"""The cluster (layer 7, above the node and its roles): the ``Coordinator`` (it books what
``RoutePolicy`` chooses; pull costing in ``pulls``), the ``Cluster`` launcher with its ``Pools``
(a record per node) and ``NodeActors`` (its Ray actors ``PrefillNode``, ``DecodeNode``), the
``ClusterClient`` (the cluster as an ``EngineClient`` in the server process: membership, over
its ``NodeSockets`` and ``Flights``), liveness, the queue for room, cache-mirror sync, the
autoscaler and the admin operations."""
