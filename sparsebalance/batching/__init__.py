"""SparseBalance: batching."""
