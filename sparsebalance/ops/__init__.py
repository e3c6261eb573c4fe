"""SparseBalance: ops."""
