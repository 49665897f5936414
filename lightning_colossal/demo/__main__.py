"""Entry point of ``python -m lightning_colossal.demo``."""

# Imported first: it registers the strategy names ("colossal_ddp", ...) that the CLI's defaults use.
import lightning_colossal  # noqa: F401
from lightning_colossal.demo.cli import main

if __name__ == "__main__":
    main()
