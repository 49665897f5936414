"""The disk tier of heterogeneous memory: working files on a local disk (NVMe), their I/O, and the optimizer step
that streams state through them. No Lightning here.

- ``files.py``: the per-run working directory (never a checkpoint, removed at the end and after a crash) and the
  one file per rank that holds fixed-size records, read and written with large aligned I/O on threads;
- ``optimizer_state.py``: optimizer state kept in those records between steps, stepped record by record through a
  small pool of staging buffers while the next record is read and the previous one written;
- ``bandwidth.py``: this disk's sequential read and write bandwidth with the tier's own block size (the bound a
  step that streams ``B`` bytes cannot beat: ``B / bandwidth``).
"""

from lightning_colossal.disk.files import DiskTierError, DiskTierFull, TierDirectory, TierFile

__all__ = ["DiskTierError", "DiskTierFull", "TierDirectory", "TierFile"]
