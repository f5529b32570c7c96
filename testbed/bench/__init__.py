"""Benchmarks run by `testbed bench NAME`; each module here exposes main(argv) -> int."""
