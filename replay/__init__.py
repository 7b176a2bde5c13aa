"""The replay service: segment ingest, rollout assembly, staleness bound,
credits, durable log, batches for the learner. Depends on ``protocol`` and
``ops`` only (tests/unit/test_package_layers.py)."""
