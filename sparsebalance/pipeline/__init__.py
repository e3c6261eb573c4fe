"""SparseBalance: pipeline."""
