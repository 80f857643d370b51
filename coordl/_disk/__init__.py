"""The local-disk cache tier: a dataset's raw bytes in pack files on a local file system, kept after the job
(see ``_disk.tier`` NOTE [ Disk tier ])."""
