"""The GPU check's parts (bench/gpu_check.py), a module each."""
