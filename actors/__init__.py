"""Actor processes: a vLLM engine, compaction-enabled agent episodes against
environments, segments pushed to the replay. Depends on ``protocol`` and
``ops`` only (tests/unit/test_package_layers.py)."""
