"""Wiring: the command line, the run's configuration tree and shipped
configs, the tiny model, launchers. The only package that imports the others."""
