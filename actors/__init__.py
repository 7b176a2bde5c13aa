"""Actor processes: a vLLM engine, compaction-enabled agent episodes against
environments, segments pushed to the replay. Depends on ``protocol`` only."""
