"""The fleet (above the request plane): the nodes' Ray lifecycle. The ``Cluster`` launcher
(``launcher.py``) with its ``Pools`` (a record per node, ``pools.py``) and ``NodeActors``
(``actors.py``: every Ray call, its actors ``PrefillNode`` and ``DecodeNode`` in
``node_actor.py``), the Ray connection and ``ClusterConfig`` (``config.py``), how many nodes the
Ray cluster can place (``placement.py``), the SLO autoscaler (``autoscaler.py``) and the admin
operations (``admin.py``)."""
