"""SparseBalance: predictor."""
