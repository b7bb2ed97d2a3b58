"""The cluster (layer 7, above the node and its roles): the ``Coordinator`` (routing), the
``Cluster`` launcher and its Ray actors (``PrefillNode``, ``DecodeNode``), the ``ClusterClient`` (the cluster as an
``EngineClient`` in the server process), liveness, the queue for room, cache-mirror sync, the
autoscaler and the admin operations."""
