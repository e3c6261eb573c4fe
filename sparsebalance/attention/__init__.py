"""SparseBalance: attention."""
