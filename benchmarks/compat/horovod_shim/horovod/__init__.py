"""A package named ``horovod`` that is pslink's adapters (benchmarks/compat/horovod_suites.py puts
its directory first on ``sys.path``): Horovod's own test files run unchanged against pslink.
Not installed, never imported by pslink itself."""

__version__ = "0.28.1"  # the Horovod API the adapters follow
