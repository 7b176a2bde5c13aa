"""The learner: PPO with a critic, cross-trajectory GAE, token-level
normalisation, FSDP2 under torchrun, weight publication. Depends on
``protocol`` and ``ops`` only (tests/unit/test_package_layers.py)."""
