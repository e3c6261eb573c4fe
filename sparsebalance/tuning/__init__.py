"""SparseBalance: tuning."""
