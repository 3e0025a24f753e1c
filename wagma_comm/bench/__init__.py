"""``wagma bench``: nccl-tests-style collective benchmarks, peers side by side."""
