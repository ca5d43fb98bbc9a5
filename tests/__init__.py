"""The test suite: unit/ (no Ray), integration/ (real Ray and Serve), support/ (shared helpers)."""
