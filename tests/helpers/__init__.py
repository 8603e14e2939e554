"""Code the tests share: the rank side of multi-rank checks and bounded waits on events."""
