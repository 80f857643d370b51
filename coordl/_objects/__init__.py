"""Datasets in an object store (S3 API): the bucket's client, the manifest of its keys, the storage misses are read from, and the datasets."""
