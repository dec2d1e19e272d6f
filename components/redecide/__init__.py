"""redecide: a local re-run whose only change is in `gates` or `promotion`, decided in one task on the stored
measurements of an earlier run (issue 25)."""
