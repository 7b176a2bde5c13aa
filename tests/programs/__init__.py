"""Programs the tests start as processes of their own (under torchrun, as
``python -m``), and that a person can run by hand: each says how."""
