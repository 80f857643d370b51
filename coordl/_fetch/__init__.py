"""Where a sample's bytes come from: the datasets coordl wraps, storage, and the fetch path through the cache."""
