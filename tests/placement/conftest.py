"""The placement suite's helper modules (`placement_seed_reference`, `sync_processes`) live here,
beside the family folders of tests: pytest's default (prepend) import mode puts the folder of this
conftest on ``sys.path``, so a test in any family folder imports them by name."""
