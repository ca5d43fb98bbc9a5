"""Unit tests: no Ray cluster, no engine process (fakes at the edges; see tests/support/)."""
