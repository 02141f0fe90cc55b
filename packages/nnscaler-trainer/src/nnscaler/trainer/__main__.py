"""``python -m nnscaler.trainer -f cfg.yaml [--key value ...]`` (also under torchrun)."""
import sys

from .cli.main import main

if __name__ == "__main__":
    sys.exit(main())
