"""The libraries the commands in ``scripts/`` share; not part of the runtime (no module of pd,
prefill, decode or transfer imports it: tests/test_layers.py). Installed with pd so that
``python scripts/X.py`` imports it from anywhere; it needs the ``dev`` extra (httpx, matplotlib).

- benchmarks: ``bench_client`` (one timed streamed request), ``bench_workloads`` (what is sent),
  ``bench_launch`` (pd and its peers started and stopped), ``bench_report`` (tables and plots),
  ``trace`` (the Mooncake trace format), ``block_hash_cache`` (the block-hash cache baseline);
- the routing simulation's model of a prefill pool: ``routing_model``;
- the chaos soak: ``chaos_load``, ``chaos_faults``, ``chaos_hostile``, ``chaos_cluster``,
  ``chaos_report``;
- hosts in network namespaces, with ``ray up`` on them: ``netns_hosts``, ``netns_ray``.
"""
