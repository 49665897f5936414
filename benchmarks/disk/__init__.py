"""The disk tier of optimizer state on this machine: disk bandwidth and the streamed step against its I/O bound."""
